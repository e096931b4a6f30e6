"""``moe-offload models``: every MoE model type of the installed transformers, served (tested lossless) or refused
and why (``architectures.supported``); ``--config``: one checkpoint's config before downloading it."""

from __future__ import annotations

import sys

from ..errors import MoeOffloadError


def add_parser(sub) -> None:
    """Register ``moe-offload models``."""
    p = sub.add_parser("models", help="every MoE model type of the installed transformers: served (tested "
                       "lossless) or refused and why")
    p.add_argument("--verify", action="store_true", help="run the architecture sweep now (tiny random checkpoint "
                   "per model type: offloaded at residency 0.3 vs FullLoad, one thread; about a minute)")
    p.add_argument("--type", action="append", metavar="MODEL_TYPE", help="only this model type or family "
                   "(repeatable; default: every one)")
    p.add_argument("--markdown", action="store_true", help="print a markdown table")
    p.add_argument("--all", action="store_true", help="also list every other model type of the installed "
                   "transformers (dense models, MoEs without ExpertsInterface, sub-configurations), refused")
    p.add_argument("--record", metavar="FILE", help="with --verify: also write the results as a record (JSON; "
                   "default: none)")
    p.add_argument("--config", metavar="PATH", help="check one checkpoint's config.json (the file, its directory, or a "
                   "Hugging Face Hub name ORG/NAME[@REVISION], of which config.json alone is downloaded; no weights "
                   "needed): served or why not, layers, experts, bytes (default: none)")


def run(args) -> int:
    """``moe-offload models``: print the table; exit 0."""
    from ..architectures.supported import (config_source, current_table, describe_config, format_markdown,
                                           format_text, other_types, save_record)

    if args.record and not args.verify:
        raise MoeOffloadError("--record needs --verify (a record holds verified results)")
    if args.config:
        print(describe_config(config_source(args.config)))
        return 0
    show = (lambda r: print(f"{r.model_type}: {r.status} ({r.seconds} s)", file=sys.stderr, flush=True)) \
        if args.verify else None
    results, source = current_table(args.verify, args.type, show)
    shown = results + (other_types() if args.all else [])
    print(format_markdown(shown, source) if args.markdown else format_text(shown, source))
    if args.record:
        save_record(results, args.record, "moe-offload models --verify --record FILE")
    return 0
