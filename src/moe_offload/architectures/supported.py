"""``moe-offload models``: every MoE model type of the installed transformers and whether it is served.

The statuses come from the architecture sweep (``architectures.verify``): the recorded one
(``data/architectures.json``, written by ``moe-offload models --verify --record FILE``) when it was made with the
installed transformers version, else (and for model types the record does not have) a static check: the model
type's tiny configuration is built and checked on the meta device (``capability.inspect_model``), which tells
*refused and why* but cannot tell *lossless*; ``--verify`` runs the sweep itself (about a minute on 2 cores).
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import fields
from pathlib import Path

from ..errors import MoeOffloadError, NotServedError
from .verify import TypeResult, sweep_types, verify

RECORD = Path(__file__).resolve().parent.parent / "data" / "architectures.json"
STATUS_TEXT = {"served": "served, tested lossless", "refused": "refused", "untested": "untested",
               "failed": "FAILED", "builds": "builds; not verified here"}


def load_record(path: Path = RECORD) -> dict | None:
    """The recorded sweep ``{"transformers": version, "command": ..., "types": [TypeResult json]}``, or None."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError):
        return None


def save_record(results: list[TypeResult], path: str | Path, command: str) -> None:
    """Write ``results`` as a record (``load_record``'s format) to ``path``."""
    import transformers

    Path(path).write_text(json.dumps({"transformers": transformers.__version__, "command": command,
                                      "types": [r.to_json() for r in results]}, indent=1) + "\n")


def static_check(family: str, model_type: str) -> TypeResult:
    """``builds`` (its tiny model passes the capability check on the meta device; not run), ``refused`` with the
    reason, or ``untested`` (no tiny configuration builds)."""
    from ..models.registry import REFUSED
    from ..models.tiny import tiny_config
    from .verify import describe

    res = TypeResult(model_type, family, "builds")
    if model_type in REFUSED:
        res.status, res.reason = "refused", REFUSED[model_type]
        return res
    try:
        describe(tiny_config(model_type)[1], res)
    except NotServedError as e:
        res.status, res.reason = "refused", str(e)
    except MoeOffloadError as e:
        res.status, res.reason = "untested", str(e)
    return res


def other_types() -> list[TypeResult]:
    """Every other model type of the installed transformers, refused without building anything: a sub-configuration
    of an MoE family (an encoder, a text config without a generation class of its own), or a model whose modeling
    code declares no experts through ExpertsInterface (dense, or an MoE transformers implements another way)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES, model_type_to_module_name

    from .verify import families

    swept, fams = {t for _, t in sweep_types()}, set(families())
    out = []
    for mt in sorted(CONFIG_MAPPING_NAMES):
        if mt in swept:
            continue
        fam = model_type_to_module_name(mt)
        reason = (f"a sub-configuration of the {fam} family without a text-generation class of its own" if fam in fams
                  else "its transformers modeling code declares no experts through ExpertsInterface "
                  "(@use_experts_implementation): a dense model, or an MoE transformers implements another way")
        out.append(TypeResult(mt, fam, "refused", reason))
    return out


def current_table(verify_now: bool = False, only: list[str] | None = None, progress=None) -> tuple[list, str]:
    """``(results, source)`` for every sweep model type (or ``only`` these): verified now, recorded, or statically
    checked; ``source`` says which."""
    import transformers

    types = [(f, t) for f, t in sweep_types() if not only or t in only or f in only]
    if only and not types:
        raise MoeOffloadError(f"no model type of the sweep matches {', '.join(only)} (see moe-offload models)")
    if verify_now:
        with tempfile.TemporaryDirectory(prefix="moe-offload-sweep.") as work:
            out = []
            for fam, mt in types:
                out.append(verify(mt, work, family=fam))
                if progress:
                    progress(out[-1])
        return out, f"verified now on tiny random checkpoints (transformers {transformers.__version__})"
    rec = load_record()
    recorded = {}
    if rec and rec.get("transformers") == transformers.__version__:
        names = {f.name for f in fields(TypeResult)}
        recorded = {r["model_type"]: TypeResult(**{k: v for k, v in r.items() if k in names}) for r in rec["types"]}
    out = [recorded.get(mt) or static_check(fam, mt) for fam, mt in types]
    if recorded:
        return out, f"recorded sweep (transformers {rec['transformers']}, `{rec['command']}`)"
    return out, (f"static check on the meta device (the record is for transformers "
                 f"{rec.get('transformers') if rec else 'none'}, installed {transformers.__version__}; run --verify)")


def summary(results: list[TypeResult]) -> str:
    """One line of counts: model types by status, and transformers families (``@use_experts_implementation``
    modeling files) whose primary (first listed) model type is served."""
    from .verify import families

    counts = {s: sum(r.status == s for r in results) for s in STATUS_TEXT}
    fams, seen, moe = [], set(), set(families())
    for r in results:
        if r.family not in seen and r.family in moe:
            seen.add(r.family)
            fams.append(r)
    parts = [f"{counts[s]} {STATUS_TEXT[s]}" for s in STATUS_TEXT if counts[s]]
    return (f"{len(results)} model types: {', '.join(parts)}; transformers families with "
            f"@use_experts_implementation: {sum(r.status == 'served' for r in fams)} of {len(fams)} served "
            "(their primary model type)")


def _notes(r: TypeResult) -> str:
    if r.status not in ("served", "builds"):
        return r.reason
    notes = []
    if r.multimodal:
        notes.append("multimodal, text-only prompts")
    if len(r.layer_kinds) > 1:
        notes.append("layers: " + "/".join(r.layer_kinds))
    if r.dense_layers:
        notes.append(f"dense layers {','.join(map(str, r.dense_layers))}")
    if r.shared_experts:
        notes.append("shared experts")
    return "; ".join(notes)


def _geometry(r: TypeResult) -> str:
    return f"{r.layers}/{r.moe_layers}" if r.layers else ""


def format_text(results: list[TypeResult], source: str) -> str:
    """The table as plain text (one row per model type, the reason after a refused or untested one)."""
    head = f"{'model type':28s} {'family':22s} {'status':26s} {'tiny L/MoE':10s} {'E':>4s} {'k':>3s}  notes"
    lines = [f"# {source}", head]
    for r in results:
        lines.append(f"{r.model_type:28s} {r.family:22s} {STATUS_TEXT[r.status]:26s} {_geometry(r):10s} "
                     f"{r.experts or '':>4} {r.top_k or '':>3}  {_notes(r)}")
    return "\n".join(lines + [summary(results)])


def format_markdown(results: list[TypeResult], source: str) -> str:
    """The table as markdown (docs/architectures.md)."""
    lines = [f"Source: {source}.", "", "| model type | family | status | tiny: layers / MoE layers | experts | top-k | "
             "notes | s |", "|---|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| `{r.model_type}` | {r.family} | {STATUS_TEXT[r.status]} | {_geometry(r)} | "
                     f"{r.experts or ''} | {r.top_k or ''} | {_notes(r).replace('|', '/')} | {r.seconds or ''} |")
    return "\n".join(lines + ["", summary(results)])


def describe_config(path: str | Path) -> str:
    """What serving the checkpoint whose ``config.json`` is at ``path`` (a file, or a directory holding it) would
    take, from the config alone (the model is built on the meta device at its real size): status, layers, experts,
    bytes.

    Raises:
        MoeOffloadError: the config cannot be read, or its model type is not served (``NotServedError``: why).
    """
    import math

    import transformers

    from ..models.capability import expert_params, inspect_model
    from ..models.checkpoint import not_a_checkpoint, quantization, read_config_json
    from ..models.loader import resolve_dtype

    p = Path(path)
    if p.is_dir() and not (p / "config.json").is_file():
        raise MoeOffloadError(not_a_checkpoint(p))
    file = p / "config.json" if p.is_dir() else p
    config, arch = read_config_json(file)
    quant = quantization(json.loads(file.read_text()))
    dt = resolve_dtype(None, config)
    model, mods, geo = inspect_model(config, dt)
    per_expert = sum(math.prod(s) for _, s in geo.expert_params)
    routed = {id(p) for _, m in mods for _, p in expert_params(m)}
    rest = sum(p.numel() for p in model.parameters() if id(p) not in routed)
    size = torch_itemsize(dt)
    stored = {"fp8": (1.0, "FP8"), "mxfp4": (0.5, "MXFP4")}.get(quant.method, (size, str(dt).replace("torch.", "")))
    rec = {r.model_type: r for r in current_table()[0]}.get(config.model_type)
    status = ("served, tested lossless on a tiny random checkpoint" if rec and rec.status == "served" else
              "passes the capability check (not in the sweep of this transformers)")
    n_all = len(mods) * geo.num_experts
    return "\n".join([
        f"{config.model_type} ({arch.name}): {status}; transformers {transformers.__version__}",
        f"  decoder layers {geo.num_layers}: {len(mods)} MoE layers; dense layers: "
        f"{', '.join(map(str, geo.dense_layers)) or 'none'}",
        f"  routed experts: {geo.num_experts} per MoE layer, top-{geo.top_k}; {n_all:,} in all, about "
        f"{per_expert * stored[0] / 1e6:,.1f} MB each ({stored[1]}), {n_all * per_expert * stored[0] / 1e9:,.1f} GB",
        f"  non-expert weights (always on the device): about {rest * size / 1e9:,.2f} GB "
        f"({str(dt).replace('torch.', '')})",
    ] + (["  multimodal: served for text-only prompts"] if geo.multimodal else []))


def config_source(name: str) -> Path:
    """What ``models --config name`` reads: an existing path as it is (a local directory named like a Hub name wins),
    else for a Hub name ``ORG/NAME[@REVISION]`` its config.json alone, from the Hugging Face cache or downloaded.

    Raises:
        MoeOffloadError: a Hub name that cannot be fetched (``hub.config_file``: malformed, unknown, gated, offline
            and not cached, no config.json); a path that does not exist is left to ``describe_config``.
    """
    from ..models.hub import config_file, looks_like_hub_name

    path = Path(name)
    return config_file(name) if not path.exists() and looks_like_hub_name(name) else path


def torch_itemsize(dtype) -> int:
    """Bytes per element of a torch dtype."""
    import torch

    return torch.empty(0, dtype=dtype).element_size()
