"""Load a Hugging Face MoE checkpoint with its routed experts offloaded (DESIGN.md §4).

The model is built on the meta device; its routed experts' fused parameters are dropped (never allocated on the
device); every other weight (attention, norms, routers, shared experts, embeddings, head) is read from the
checkpoint onto the device; every routed expert is read from the safetensors, one expert at a time, into the
host store. The checkpoint key -> parameter mapping is transformers' own conversion mapping, so per-expert
checkpoints (``experts.{e}.gate_proj``...) and fused ones (GPT-OSS ``experts.gate_up_proj``) both work.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm.auto import tqdm

from ..core.policies import make_policy
from ..core.slots import SlotTable
from ..errors import MoeOffloadError
from ..runtime.engine import OffloadEngine
from ..runtime.pool import SlotPool
from ..runtime.store import ExpertLayout, HostStore
from .registry import Architecture, architecture_for

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16,
           "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


def resolve_device(name: str | None) -> torch.device:
    """``None``/"auto" -> cuda when available else cpu. Raises MoeOffloadError for an unusable device."""
    if name in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name not in ("cpu", "cuda") and not name.startswith("cuda:"):
        raise MoeOffloadError(f"unknown device {name!r}; use cpu or cuda")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise MoeOffloadError("--device cuda was asked for but no CUDA device is available")
    return torch.device(name)


def resolve_dtype(name: str | None, config) -> torch.dtype:
    """``--dtype`` name, or the checkpoint's own dtype (``config.dtype``) when ``None``/"auto"."""
    if name in (None, "auto"):
        dt = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
        if isinstance(dt, torch.dtype):
            return dt
        return _DTYPES.get(str(dt).replace("torch.", ""), torch.float32)
    try:
        return _DTYPES[name]
    except KeyError:
        raise MoeOffloadError(f"unknown dtype {name!r}; use one of {', '.join(sorted(set(_DTYPES)))}") from None


def read_config(model_dir: str | Path):
    """Validate a checkpoint directory and return ``(path, config, architecture)``.

    Raises:
        MoeOffloadError: missing directory, no config.json, no safetensors, or unsupported architecture.
    """
    from transformers import AutoConfig

    path = Path(model_dir)
    if not path.is_dir():
        raise MoeOffloadError(f"model directory not found: {path}")
    if not (path / "config.json").is_file():
        raise MoeOffloadError(f"{path} has no config.json: not a Hugging Face checkpoint directory")
    if not sorted(path.glob("*.safetensors")):
        raise MoeOffloadError(f"{path} has no *.safetensors weights")
    try:
        model_type = json.loads((path / "config.json").read_text()).get("model_type")
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise MoeOffloadError(f"{path / 'config.json'} is not valid JSON: {e}") from None
    arch = architecture_for(model_type)
    try:
        config = AutoConfig.from_pretrained(path)
    except Exception as e:  # transformers raises many kinds for bad configs
        raise MoeOffloadError(f"cannot read {path / 'config.json'}: {e}") from None
    return path, config, arch


class Checkpoint:
    """Lazy reader over a directory's safetensors files: ``key -> tensor`` without loading whole files.

    Raises:
        MoeOffloadError: a file that is not valid safetensors (corrupt or truncated header), or, on reading, a
            tensor whose bytes are missing (truncated file).
    """

    def __init__(self, path: Path):
        self.files = {}
        self.key_file: dict[str, str] = {}
        for f in sorted(path.glob("*.safetensors")):
            try:
                need = _data_end(f)
            except (ValueError, KeyError, TypeError, OSError) as e:
                raise MoeOffloadError(f"{f.name} is not a readable safetensors file (bad header: {e})") from None
            size = f.stat().st_size
            if size < need:  # a truncated file keeps its header: check the data covers every tensor
                raise MoeOffloadError(f"{f.name} is truncated: {size} bytes, its header describes {need}")
            try:
                handle = safe_open(str(f), framework="pt")
                keys = list(handle.keys())
            except Exception as e:
                raise MoeOffloadError(f"{f.name} is not a readable safetensors file ({e})") from None
            self.files[f.name] = handle
            for k in keys:
                self.key_file[k] = f.name

    def keys(self) -> list[str]:
        return list(self.key_file)

    def tensor(self, key: str) -> torch.Tensor:
        return self._read(key, lambda h: h.get_tensor(key))

    def expert_slice(self, key: str, index: int) -> torch.Tensor:
        """Row ``index`` of a fused ``[E, ...]`` tensor, reading only that row's bytes."""
        return self._read(key, lambda h: h.get_slice(key)[index])

    def _read(self, key, fn) -> torch.Tensor:
        try:
            return fn(self.files[self.key_file[key]])
        except Exception as e:
            raise MoeOffloadError(f"cannot read tensor {key} from {self.key_file[key]} ({e})") from None


def _data_end(f: Path) -> int:
    """File size in bytes that a safetensors file's header promises (8 + header + data)."""
    with f.open("rb") as fh:
        header_len = int.from_bytes(fh.read(8), "little")
        if header_len > f.stat().st_size:
            raise ValueError(f"header length {header_len} exceeds the file size")
        header = json.loads(fh.read(header_len))
    data = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    return 8 + header_len + data


@dataclass
class ExpertPiece:
    """Where part of one expert parameter lives in the checkpoint."""

    key: str
    fused_index: int | None  # row of a fused [E, ...] tensor, or None for a per-expert tensor
    position: int  # order inside a concatenation (gate before up)


def experts_modules(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """``[(qualified_name, module)]`` of every experts module declared with ``@use_experts_implementation``, in
    model order (one per MoE layer)."""
    return [(n, m) for n, m in model.named_modules()
            if hasattr(m, "is_transposed") and hasattr(m, "has_gate") and hasattr(m, "_apply_gate")]


def _expert_params(mod: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    n = mod.num_experts
    return [(name, p) for name, p in mod.named_parameters(recurse=False) if p.dim() >= 2 and p.shape[0] == n]


@dataclass
class LoadedModel:
    """A model ready to generate: ``model`` (transformers), ``tokenizer`` (or None), ``engine`` (None for FullLoad),
    ``arch``, ``device``, ``dtype`` and the expert geometry."""

    model: torch.nn.Module
    tokenizer: object
    engine: OffloadEngine | None
    arch: Architecture
    device: torch.device
    dtype: torch.dtype
    num_moe_layers: int
    num_experts: int
    top_k: int
    expert_bytes: int
    path: Path

    @property
    def model_id(self) -> str:
        """Fingerprint of the checkpoint's config.json (``trace.format.model_fingerprint``)."""
        from ..trace.format import model_fingerprint

        return model_fingerprint(json.loads((self.path / "config.json").read_text()))


def _load_tokenizer(path: Path):
    from transformers import AutoTokenizer

    if not any((path / n).exists() for n in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return None
    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception as e:
        raise MoeOffloadError(f"cannot load the tokenizer in {path}: {e}") from None


def _top_k(config) -> int:
    for name in ("num_experts_per_tok", "moe_topk", "top_k"):
        if getattr(config, name, None):
            return int(getattr(config, name))
    raise MoeOffloadError("config has no num_experts_per_tok")


def num_slots_for(num_experts_total: int, top_k: int, residency: float | None, slots: int | None) -> int:
    """Slots from ``--slots N`` or ``--residency F`` (ceil(F * N)); default residency 1.0.

    Raises:
        MoeOffloadError: residency outside (0, 1], slots < 1, or fewer slots than top-k.
    """
    if slots is not None and residency is not None:
        raise MoeOffloadError("give either --slots or --residency, not both")
    if slots is None:
        r = 1.0 if residency is None else residency
        if not (0 < r <= 1) or math.isnan(r):
            raise MoeOffloadError(f"--residency must be in (0, 1], got {residency}")
        slots = max(1, math.ceil(r * num_experts_total - 1e-9))
    if slots < top_k:
        raise MoeOffloadError(f"--slots {slots} is fewer than top-k = {top_k}: a token's experts could not all be "
                              f"resident; use at least {top_k} slots (residency >= {top_k / num_experts_total:.4f})")
    return min(slots, num_experts_total)


def is_refresh_policy(policy: str) -> bool:
    """Whether ``policy`` names a diffusion refresh planner (``reactive``, ``tide-fixed[-T<n>]``, ``tide``)."""
    p = policy.lower()
    return p in ("reactive", "tide") or p.startswith("tide-fixed")


# runtime policy names driven by a predictor's forecasts -> their prefetch scheduler (None: no prefetching)
FORECAST_RUNTIME_POLICIES = {"seqmoe-cacheonly": None, "seqmoe": "jsd", "seqmoe-infinity": "moe-infinity"}


def load_offloaded(model_dir: str | Path, *, device: str | None = None, dtype: str | None = None,
                   residency: float | None = None, slots: int | None = None, policy: str = "lru",
                   progress: bool = True, link_epl: float = 1.39, link_gbps: float | None = None,
                   seconds_per_expert: float | None = None, interval: int = 1,
                   host_seconds_per_token_expert: float = 0.0, host_seconds_per_expert: float = 0.0) -> LoadedModel:
    """Load ``model_dir`` with routed experts in a host store and a device slot pool of the requested size.

    Args:
        model_dir: Hugging Face checkpoint directory (config.json + *.safetensors [+ tokenizer]).
        device: "cpu", "cuda" or None (cuda when available).
        dtype: "float32" | "bfloat16" | "float16" | None (the checkpoint's).
        residency: slots as a fraction of all routed experts, in (0, 1].
        slots: number of slots (>= top-k). Default: residency 1.0.
        policy: eviction policy name ("lru", "lfu", "prefill-hot", or "seqmoe-cacheonly": probabilistic Belady,
            which needs a predictor's forecasts fed through ``predictor.runtime.ForecastFeed``), or a full SeqMoE
            pipeline: "seqmoe" (probabilistic Belady + JSD prefetching, SeqMoE §6-§7) / "seqmoe-infinity" (with
            MoE-Infinity's task ordering): the engine gets a ``runtime.prefetcher.Prefetcher`` (feed it forecasts).
        link_epl: with prefetching: the scheduler's transfer budget B_avg, experts per layer compute time.
        link_gbps / seconds_per_expert: with prefetching: emulate a link of this speed (every expert copy, on
            demand or prefetch, takes at least ``expert_bytes / (link_gbps * 1e9)`` resp. this many seconds).
        policy may also be a diffusion refresh planner (TIDE, ``core.refresh``): "reactive", "tide-fixed"
            (``interval`` steps; or "tide-fixed-T<n>"), "tide" (cost model calibrated at load:
            ``runtime.refresh_engine.calibrate_costs``); the slots are then split into equal per-layer budgets
            (``ceil(slots / L)`` experts per layer, at least top-k) and misses are computed on the host.
        host_seconds_per_token_expert, host_seconds_per_expert: refresh planners: emulated host fallback cost
            (seconds) per token-expert and per expert computed on the host (a fallback layer call then takes at least
            their sum; ``bench diffusion`` sets them).

    Raises:
        MoeOffloadError: any bad input (see ``read_config``, ``Checkpoint``, ``num_slots_for``, ``make_policy``).
    """
    from transformers import AutoModelForCausalLM
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

    path, config, arch = read_config(model_dir)
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, config)
    refresh = is_refresh_policy(policy)
    if refresh and not arch.diffusion:
        raise MoeOffloadError(f"--policy {policy} refreshes experts per diffusion step: it is for diffusion models "
                              f"(e.g. llada2_moe), not {arch.name}")
    if refresh:
        from ..core.refresh import make_refresh_planner

        if policy.lower() != "tide":
            make_refresh_planner(policy, 1, 1, 1, interval=interval)  # reject a bad name / interval before any work
    elif policy not in FORECAST_RUNTIME_POLICIES:
        try:  # reject an unknown or simulator-only policy before any work
            make_policy(policy, num_slots=1, top_k=1)
        except MoeOffloadError as e:
            if "only available in the simulator" in str(e):
                raise
            raise MoeOffloadError(f"unknown policy {policy!r}; choose one of: lru, lfu, prefill-hot, "
                                  f"{', '.join(FORECAST_RUNTIME_POLICIES)} (with a predictor); diffusion models: "
                                  "reactive, tide-fixed-T<n>, tide") from None
    ckpt = Checkpoint(path)

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dt)
    meta_sd = model.state_dict()
    mods = experts_modules(model)
    if not mods:
        raise MoeOffloadError(f"{arch.name} model built without experts modules: unsupported transformers version")
    layer_of = {name: i for i, (name, _) in enumerate(mods)}
    num_experts = mods[0][1].num_experts
    layout = ExpertLayout([(n, tuple(p.shape[1:])) for n, p in _expert_params(mods[0][1])], dt)
    for name, mod in mods:
        if ExpertLayout([(n, tuple(p.shape[1:])) for n, p in _expert_params(mod)], dt) != layout:
            raise MoeOffloadError(f"{name}: experts of different shapes across layers are not supported")
    top_k = _top_k(config)
    n_total = len(mods) * num_experts
    num_slots = num_slots_for(n_total, top_k, residency, slots)
    if refresh:  # a per-layer budget: the same share of every layer's experts
        budget = max(top_k, min(num_experts, -(-num_slots // len(mods))))
        num_slots = budget * len(mods)

    # drop the routed experts' fused parameters: they never exist on the device
    for _, mod in mods:
        for pname, _p in _expert_params(mod):
            setattr(mod, pname, torch.nn.Parameter(torch.empty(0, device="meta", dtype=dt), requires_grad=False))
    model.to_empty(device=dev)
    persistent = set(model.state_dict())
    for mname, mod in model.named_modules():  # rotary inv_freq and other non-persistent buffers
        if any(f"{mname}.{b}".lstrip(".") not in persistent for b, _ in mod.named_buffers(recurse=False)):
            model._init_weights(mod)

    conversions = get_model_conversion_mapping(model)
    renamings = [c for c in conversions if isinstance(c, WeightRenaming)]
    converters = [c for c in conversions if isinstance(c, WeightConverter)]
    by_pattern = {pat: c for c in converters for pat in c.source_patterns}

    store = HostStore(layout, n_total, pin=dev.type == "cuda")
    pieces: dict[tuple[int, int, str], list[ExpertPiece]] = {}
    concat_dim: dict[str, int] = {}
    non_expert: dict[str, str] = {}
    for key in ckpt.keys():
        target, pattern = rename_source_key(key, renamings, converters, model.base_model_prefix, meta_sd)
        mod_name, _, pname = target.rpartition(".")
        if mod_name not in layer_of:
            non_expert[target] = key
            continue
        layer = layer_of[mod_name]
        if pname not in layout.by_name:
            raise MoeOffloadError(f"checkpoint key {key} maps to unknown expert parameter {target}")
        if pattern is None:  # fused [E, ...] tensor in the checkpoint, already in the module's layout
            for e in range(num_experts):
                pieces[(layer, e, pname)] = [ExpertPiece(key, e, 0)]
            continue
        conv = by_pattern[pattern]
        concat_dim[pname] = _concat_dim(conv, key)
        m = re.search(re.escape(pattern).replace(r"\*", r"(\d+)"), key)
        if m is None:
            raise MoeOffloadError(f"cannot find the expert index in checkpoint key {key}")
        pieces.setdefault((layer, int(m.group(1)), pname), []).append(
            ExpertPiece(key, None, conv.source_patterns.index(pattern)))

    missing = [k for k in persistent if k not in non_expert and k.rpartition(".")[0] not in layer_of]
    tied = set(getattr(model, "all_tied_weights_keys", {}) or {})
    missing = [k for k in missing if k not in tied]
    if missing:
        raise MoeOffloadError(f"checkpoint lacks {len(missing)} weights, e.g. {missing[0]}")
    want = [(l, e, p.name) for l in range(len(mods)) for e in range(num_experts) for p in layout.params]
    lacking = [w for w in want if w not in pieces]
    if lacking:
        l, e, p = lacking[0]
        raise MoeOffloadError(f"checkpoint lacks expert weights, e.g. MoE layer {l} expert {e} {p}")

    params = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    with torch.no_grad():
        for target, key in non_expert.items():
            dst = params.get(target, buffers.get(target))
            if dst is None:
                continue  # checkpoint extras (e.g. a tied lm_head written twice)
            src = ckpt.tensor(key)
            if tuple(src.shape) != tuple(dst.shape):
                raise MoeOffloadError(f"{key}: shape {tuple(src.shape)} does not match the model's {tuple(dst.shape)}")
            dst.copy_(src.to(dst.dtype))
        model.tie_weights()
        bar = tqdm(total=n_total, desc="experts -> host store", unit="expert", disable=not progress, leave=False)
        for layer in range(len(mods)):
            for e in range(num_experts):
                eid = layer * num_experts + e
                for p in layout.params:
                    parts = sorted(pieces[(layer, e, p.name)], key=lambda x: x.position)
                    ts = [ckpt.tensor(x.key) if x.fused_index is None else ckpt.expert_slice(x.key, x.fused_index)
                          for x in parts]
                    t = ts[0] if len(ts) == 1 else torch.cat(ts, dim=concat_dim[p.name])
                    store.write(eid, p.name, t.to(dt))
                bar.update(1)
        bar.close()
    model.eval()
    model.requires_grad_(False)

    pool = SlotPool(layout, num_slots, n_total, dev)
    if refresh:
        from ..runtime.refresh_engine import RefreshEngine, calibrate_costs
        from ..runtime.transfer import TransferEngine

        transfer = TransferEngine(store, pool, link_gbps=link_gbps, seconds_per_expert=seconds_per_expert)
        costs = None
        if policy.lower() == "tide":
            costs = calibrate_costs(mods[0][1], store, pool, transfer, len(mods), num_experts, top_k,
                                    host_seconds_per_token_expert=host_seconds_per_token_expert,
                                    host_seconds_per_expert=host_seconds_per_expert)
        planner = make_refresh_planner(policy, len(mods), num_experts, budget, costs=costs, interval=interval)
        engine = RefreshEngine(store, pool, planner, len(mods), num_experts, transfer,
                               host_seconds_per_token_expert=host_seconds_per_token_expert,
                               host_seconds_per_expert=host_seconds_per_expert)
        engine.attach([m for _, m in mods])
        return LoadedModel(model, _load_tokenizer(path), engine, arch, dev, dt, len(mods), num_experts, top_k,
                           layout.expert_bytes, path)
    if policy in FORECAST_RUNTIME_POLICIES:  # SeqMoE §7.1 eviction; forecasts come from a predictor (ForecastFeed)
        from ..core.prob_belady import ProbabilisticBelady

        policy_obj = ProbabilisticBelady(num_experts, horizon=8, lam=0.5)
        policy_obj.name = policy
    else:
        policy_obj = make_policy(policy, num_slots=num_slots, top_k=top_k)
    scheduler = FORECAST_RUNTIME_POLICIES.get(policy)
    table = SlotTable(num_slots, n_total, policy_obj, experts_per_layer=num_experts if scheduler else None)
    engine = OffloadEngine(store, pool, table, num_experts)
    if scheduler:
        from ..core.prefetch import make_scheduler
        from ..runtime.prefetcher import Prefetcher
        from ..runtime.transfer import TransferEngine

        engine.prefetcher = Prefetcher(store, pool, table,
                                       make_scheduler(scheduler, num_moe_layers=len(mods), b_avg=link_epl,
                                                      auto_ema=False),
                                       TransferEngine(store, pool, link_gbps=link_gbps,
                                                      seconds_per_expert=seconds_per_expert),
                                       len(mods), num_experts, top_k)
    engine.attach([m for _, m in mods])
    return LoadedModel(model, _load_tokenizer(path), engine, arch, dev, dt, len(mods), num_experts, top_k,
                       layout.expert_bytes, path)


def _concat_dim(conv, key: str) -> int:
    """Per-expert concatenation dim implied by a converter [MergeModulelist(dim=0)] (+ Concatenate(dim=d))."""
    ops = [type(o).__name__ for o in conv.operations]
    if ops == ["MergeModulelist"] and conv.operations[0].dim == 0:
        return 0
    if ops == ["MergeModulelist", "Concatenate"] and conv.operations[0].dim == 0 and conv.operations[1].dim >= 1:
        return conv.operations[1].dim - 1
    raise MoeOffloadError(f"checkpoint key {key}: expert conversion {ops} is not supported for offloading")


def load_full(model_dir: str | Path, *, device: str | None = None, dtype: str | None = None) -> LoadedModel:
    """FullLoad reference: the same checkpoint with every weight on the device and transformers' own experts
    implementation (the correctness reference and the speed limit)."""
    from transformers import AutoModelForCausalLM

    path, config, arch = read_config(model_dir)
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, config)
    Checkpoint(path)  # same validation as the offloaded path
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dt).to(dev)
    except Exception as e:
        raise MoeOffloadError(f"cannot load {path}: {e}") from None
    model.eval()
    mods = experts_modules(model)
    n_exp = mods[0][1].num_experts
    layout = ExpertLayout([(n, tuple(p.shape[1:])) for n, p in _expert_params(mods[0][1])], dt)
    return LoadedModel(model, _load_tokenizer(path), None, arch, dev, dt, len(mods), n_exp, _top_k(config),
                       layout.expert_bytes, path)
