"""The architecture sweep: every MoE model type of the installed transformers, checked on a tiny random checkpoint.

``sweep_types()`` finds the model types itself: every transformers model family whose modeling file declares its
experts with ``@use_experts_implementation``, each with its model types that have a text-generation class (the
family's primary type is listed even without one), plus the types this package registers (LLaDA2-MoE).
``verify(model_type)`` builds a tiny random checkpoint (``models.tiny.make_tiny``: the default configuration shrunk
generically), loads it with every weight on the device (FullLoad: transformers' own model and experts
implementation) and offloaded at residency 0.3 (with misses), generates greedily with one intra-op thread from
both and records a routing trace from the offloaded run, and reports:

* ``served``: the offloaded tokens equal FullLoad's, the trace (router probabilities included) covers every step
  and MoE layer;
* ``refused``: the loader refuses the model type with a one-line reason (no experts through ExpertsInterface, no
  text-generation class, a registry refusal...);
* ``untested``: no tiny checkpoint can be built (the reason: a field the shrink cannot fill, a missing optional
  dependency...);
* ``failed``: anything else (tokens differ, an exception): a bug to fix.
"""

from __future__ import annotations

import functools
import glob
import os
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ..errors import MoeOffloadError, NotServedError

PROMPTS = ["Hello there, how are you today?",
           "The slot pool is shared by all MoE layers; a lookup table maps each expert to its slot. " * 2]
NEW_TOKENS = 8
RESIDENCY = 0.3
#: families of this package (not in transformers)
OWN_TYPES = {"llada2_moe": "llada2_moe"}


@dataclass
class TypeResult:
    """One model type's sweep result (``status``: served / refused / untested / failed; see the module doc)."""

    model_type: str
    family: str
    status: str
    reason: str = ""
    layers: int = 0
    moe_layers: int = 0
    dense_layers: list = field(default_factory=list)
    experts: int = 0
    top_k: int = 0
    multimodal: bool = False
    layer_kinds: list = field(default_factory=list)  # distinct layer_types (attention / linear attention / mamba...)
    shared_experts: bool = False
    misses: int = 0
    transformers_generate: str = ""   # "equal" | "differs" | "error: ..." (FullLoad loop vs model.generate)
    seconds: float = 0.0

    def to_json(self) -> dict:
        return asdict(self)


@functools.lru_cache(maxsize=1)
def families() -> tuple[str, ...]:
    """Model families (``transformers/models/<family>``) whose modeling file uses ``@use_experts_implementation``."""
    import transformers

    root = Path(transformers.__file__).parent / "models"
    return tuple(sorted(Path(f).parent.name for f in glob.glob(str(root / "*" / "modeling_*.py"))
                        if "@use_experts_implementation" in Path(f).read_text(errors="ignore")))


def _has_generation_class(config_class) -> bool:
    import transformers

    return any(type_ in getattr(transformers, auto)._model_mapping
               for auto in ("AutoModelForCausalLM", "AutoModelForImageTextToText", "AutoModelForMultimodalLM")
               for type_ in (config_class,) if hasattr(transformers, auto))


def sweep_types() -> list[tuple[str, str]]:
    """``[(family, model_type)]``: for each family its primary type (the family's name when that is a model type)
    and every other model type of it with a text-generation class; then this package's own types."""
    from transformers import CONFIG_MAPPING
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES, model_type_to_module_name

    out = []
    for fam in families():
        types = [mt for mt in CONFIG_MAPPING_NAMES if model_type_to_module_name(mt) == fam]
        gen = [mt for mt in types if _has_generation_class(CONFIG_MAPPING[mt])]
        primary = fam if fam in types else (gen or types)[0]
        out += [(fam, mt) for mt in [primary] + [t for t in gen if t != primary]]
    return out + [(fam, mt) for mt, fam in OWN_TYPES.items()]


def _one_thread(fn):
    def wrapper(*a, **kw):
        n = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return fn(*a, **kw)
        finally:
            torch.set_num_threads(n)
    wrapper.__doc__ = fn.__doc__
    return wrapper


def _hf_generate_check(full, prompt_ids: list[int], ours: list[int]) -> str:
    """Our decode loop against transformers' own ``generate`` on FullLoad (greedy): equal / differs / error."""
    try:
        with torch.no_grad():
            out = full.model.generate(torch.tensor([prompt_ids]), max_new_tokens=len(ours), do_sample=False)
    except Exception as e:
        return f"error: {type(e).__name__}: {str(e).strip().splitlines()[0][:160] if str(e).strip() else ''}"
    theirs = out[0, len(prompt_ids):].tolist()[:len(ours)]
    return "equal" if theirs == ours else f"differs: ours {ours} transformers {theirs}"


@_one_thread
def verify(model_type: str, workdir: str | Path, *, family: str = "", keep: bool = False) -> TypeResult:
    """Check one model type end to end on a tiny random checkpoint (module docstring), one intra-op thread.

    Args:
        model_type: a ``config.json`` model type of the installed transformers (or ``llada2_moe``).
        workdir: scratch directory; the checkpoint goes to ``workdir/model_type`` (removed unless ``keep``).

    Returns:
        The ``TypeResult`` (never raises for a model-type problem: it is the result).
    """
    from ..models.registry import REFUSED

    t0 = time.perf_counter()
    res = TypeResult(model_type, family or model_type, "failed")
    path = Path(workdir) / model_type
    try:
        if model_type in REFUSED:
            res.status, res.reason = "refused", REFUSED[model_type]
            return res
        _check_tiny(model_type, path, res)
    except NotServedError as e:
        res.status, res.reason = "refused", str(e)
    except MoeOffloadError as e:  # untested (no tiny checkpoint), or failed (the loader could not serve it)
        res.reason = str(e)
    except Exception as e:  # a bug: say where
        import traceback

        tb = traceback.extract_tb(e.__traceback__)[-1]
        res.status = "failed"
        res.reason = f"{type(e).__name__}: {str(e).strip()[:200]} ({os.path.basename(tb.filename)}:{tb.lineno})"
    finally:
        res.seconds = round(time.perf_counter() - t0, 2)
        if not keep:
            shutil.rmtree(path, ignore_errors=True)
    return res


def _check_tiny(model_type: str, path: Path, res: TypeResult) -> None:
    """Build the tiny checkpoint, compare offloaded with FullLoad tokens, record a trace; fills ``res``."""
    from ..generation.generate import encode_prompt, generate_ids, run
    from ..trace.collect import TraceRecorder
    from ..models.checkpoint import read_config
    from ..generation.diffusion import is_diffusion
    from ..models.loader import load_full, load_offloaded
    from ..models.tiny import make_tiny

    res.status = "untested"  # until the tiny checkpoint is written (a refusal is a NotServedError: see verify)
    make_tiny(model_type, path, overwrite=True)
    res.status = "failed"  # from here every error is the loader's or the engine's
    _, config, _ = read_config(path)
    describe(config, res)
    if is_diffusion(config):
        return _check_diffusion(path, res)
    full = load_full(path, device="cpu")
    ids = [encode_prompt(full.tokenizer, p) for p in PROMPTS]
    ref = [generate_ids(full, i, NEW_TOKENS)[0] for i in ids]
    res.transformers_generate = _hf_generate_check(full, ids[0], ref[0])
    del full
    lm = load_offloaded(path, device="cpu", residency=RESIDENCY, progress=False)
    with TraceRecorder(lm, router_probs=True, source="sweep") as rec:
        outs, stats = run(lm, PROMPTS, NEW_TOKENS, recorder=rec)
        trace = rec.trace()
    got = [o.token_ids for o in outs]
    res.misses = stats.offload.misses
    if got != ref:
        res.reason = f"offloaded tokens {got} differ from FullLoad's {ref}"
        return
    rows = sum(len(i) + len(t) - 1 for i, t in zip(ids, ref))
    if trace.expert_ids.shape != (rows, res.moe_layers, res.top_k) or \
            trace.router_probs.shape != (rows, res.moe_layers, res.experts):
        res.reason = (f"trace shapes {trace.expert_ids.shape} / {trace.router_probs.shape}, expected "
                      f"{(rows, res.moe_layers, res.top_k)} / {(rows, res.moe_layers, res.experts)}")
        return
    res.status = "served"


def describe(config, res: TypeResult) -> None:
    """Fill ``res``'s geometry from the model built from ``config`` (meta device)."""
    from ..models.capability import inspect_model, text_config

    model, mods, geo = inspect_model(config)
    res.layers, res.moe_layers, res.experts, res.top_k = geo.num_layers, len(mods), geo.num_experts, geo.top_k
    res.dense_layers, res.multimodal = list(geo.dense_layers), geo.multimodal
    text = text_config(config)
    kinds = getattr(text, "layer_types", None) or getattr(text, "layers_block_type", None) or []
    res.layer_kinds = sorted({k for k in kinds if isinstance(k, str)})
    res.shared_experts = any("shared_expert" in n for n, _ in model.named_modules())


def _check_diffusion(path: Path, res: TypeResult) -> None:
    """Diffusion models: the block-diffusion loop offloaded equals FullLoad's."""
    from ..generation.generate import encode_prompt
    from ..generation.diffusion import diffusion_generate_ids
    from ..models.loader import load_full, load_offloaded

    full = load_full(path, device="cpu")
    ids = [encode_prompt(full.tokenizer, p) for p in PROMPTS]
    ref = [diffusion_generate_ids(full, i, 16, block_length=8, steps=4).token_ids for i in ids]
    lm = load_offloaded(path, device="cpu", residency=RESIDENCY, progress=False)
    got = [diffusion_generate_ids(lm, i, 16, block_length=8, steps=4).token_ids for i in ids]
    res.misses = lm.engine.stats.misses
    if got != ref:
        res.reason = f"offloaded tokens {got} differ from FullLoad's {ref}"
        return
    res.status = "served"
