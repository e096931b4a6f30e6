"""moe-offload command line: generate, serve, models, testbed, trace, simulate, predictor, bench.

Every user error is one line on stderr and exit status 2 (no traceback); nothing is written except into the
cache directory or an ``--out`` the user named, and an existing non-empty ``--out`` is never overwritten. Each
command group has its module in this package (``generate``, ``serve``, ``models``, ``export``, ``testbed``,
``trace``, ``simulate``, ``simulate_diffusion``, ``predictor``, ``bench``, ``bench_disk``): an ``add_parser`` and a
``run``; this module builds the parser of all of them and dispatches.
"""

from __future__ import annotations

import argparse
import os
import sys

from .. import __version__
from ..errors import MoeOffloadError
from .args import OneLineErrorParser


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    parts = []
    for dist in ("torch", "transformers"):
        try:
            parts.append(f"{dist} {version(dist)}")
        except PackageNotFoundError:
            pass
    return f"moe-offload {__version__}" + (f" ({', '.join(parts)})" if parts else "")


def build_parser() -> argparse.ArgumentParser:
    """The ``moe-offload`` argument parser with every subcommand."""
    from .bench import add_parsers as add_bench_parsers
    from .generate import add_parser as add_generate_parser
    from .predictor import add_parser as add_predictor_parser
    from .serve import add_parsers as add_serve_parsers
    from .simulate import add_parser as add_simulate_parser
    from .simulate_diffusion import add_parser as add_simulate_diffusion_parser
    from .testbed import add_parser as add_testbed_parser
    from .trace import add_parser as add_trace_parser

    ap = OneLineErrorParser(prog="moe-offload", description=__doc__.splitlines()[0])
    ap.add_argument("--version", action="version", version=_version(), help="print the version and exit")
    sub = ap.add_subparsers(dest="cmd", required=True)
    add_generate_parser(sub)
    add_testbed_parser(sub)
    add_trace_parser(sub)
    add_simulate_parser(sub)
    add_simulate_diffusion_parser(sub)
    bench_sub = add_bench_parsers(sub)
    add_predictor_parser(sub)
    add_serve_parsers(sub, bench_sub)
    from .export import add_parser as add_export_parser
    from .models import add_parser as add_models_parser
    from .pack import add_parser as add_pack_parser

    add_models_parser(sub)
    add_export_parser(sub)
    add_pack_parser(sub)
    return ap


def _dispatch(args) -> int:
    if args.cmd == "generate":
        from .generate import run
    elif args.cmd == "serve" or getattr(args, "bench_cmd", None) in ("serve", "replicas"):
        from .serve import run
    elif args.cmd == "testbed":
        from .testbed import run
    elif args.cmd == "trace":
        from .trace import run
    elif args.cmd == "simulate":
        from .simulate import run
    elif args.cmd == "simulate-diffusion":
        from .simulate_diffusion import run
    elif args.cmd == "predictor":
        from .predictor import run
    elif args.cmd == "models":
        from .models import run
    elif args.cmd == "export":
        from .export import run
    elif args.cmd == "pack":
        from .pack import run
    else:
        from .bench import run
    return run(args)


def _command_threads(args) -> None:
    """Intra-op threads: ``--compute-threads N`` (``common.threads.set_compute_threads``: the cores partitioned
    between the compute and the expert reads and copies) or ``--threads N`` where the command has it (every
    computing path runs on torch's intra-op pool); else, for ``generate`` / ``serve`` run from the shell
    (``common.threads.command_threads``), one when another process holds a core and one thread is clearly faster,
    said on stderr unless ``--quiet``.

    Raises:
        MoeOffloadError: ``--compute-threads`` with ``--threads``, or outside 1 .. the cores."""
    import torch

    from ..common.threads import command_threads, set_compute_threads

    n = getattr(args, "compute_threads", None)
    if n is not None:
        if getattr(args, "threads", None) is not None:
            raise MoeOffloadError("give --threads or --compute-threads, not both (--compute-threads N also runs N "
                                  "intra-op threads)")
        set_compute_threads(n)
        return
    if isinstance(getattr(args, "threads", None), int):
        torch.set_num_threads(args.threads)
        return

    got = command_threads()
    if got is None or got[0] == got[1]:
        return
    torch.set_num_threads(got[0])
    if not getattr(args, "quiet", False):
        print(f"moe-offload: the CPU is busy (another process holds a core): {got[0]} intra-op thread instead of "
              f"{got[1]}, which would wait for each other (--threads N to choose)", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``moe-offload`` console script. Returns the exit status."""
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    args = build_parser().parse_args(argv)
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    import torch

    threads_before, cpus_before = torch.get_num_threads(), os.sched_getaffinity(0)
    try:
        if (isinstance(getattr(args, "threads", None), int) or getattr(args, "compute_threads", None) is not None
                or (argv is None and args.cmd in ("generate", "serve"))):
            _command_threads(args)  # --threads / --compute-threads given, or generate / serve started from the shell
        if getattr(args, "io_priority", "normal") != "normal":
            from ..common.threads import set_io_priority

            set_io_priority(args.io_priority)
        return _dispatch(args)
    except MoeOffloadError as e:
        print(f"moe-offload: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("moe-offload: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader of stdout went away (e.g. `| head`): stop quietly, as a pipe expects
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())       # so the interpreter's final flush does not raise again
        return 1
    finally:
        if argv is not None:  # called by code: its thread count, cores and I/O priority are as they were
            torch.set_num_threads(threads_before)
            if (getattr(args, "compute_threads", None) is not None
                    or getattr(args, "io_priority", "normal") != "normal"):
                from ..common.threads import undo_partition

                undo_partition(cpus_before)


if __name__ == "__main__":
    sys.exit(main())
