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
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import MoeOffloadError
from ..runtime.engine import OffloadEngine
from ..runtime.formats import ExpertFormat
from ..runtime.huge_pages import rehome_parameters
from ..runtime.decode_attention import use_decode_attention
from ..runtime.fast_linear import use_fast_linears
from ..runtime.fast_norm import use_fast_norms
from ..runtime.fused_experts import use_fused_fullload
from ..runtime.pool import SlotPool
from ..runtime.route_rows import watch_routers
from ..runtime.store import FILE_BACKED, HostStore, MmapHostStore
from .accounting import validate_checkpoint
from .capability import expert_params, experts_modules, generation_class, inspect_model, top_k as _top_k
from .checkpoint import Checkpoint, checkpoint_model_id, quantization, read_config
from .engine_build import check_policy, make_engine
from ..core.policy_spec import PolicySpec, parse_policy
from .expert_map import build_format, fill_store, map_checkpoint
from .fp8_full import fullload_kwargs
from .registry import Architecture
from .weights import load_non_expert

#: host store modes (``--host-store``)
HOST_STORES = ("pinned", "mmap", "disk")
_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16,
           "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


def resolve_device(name: str | None) -> torch.device:
    """``None``/"auto" -> cuda when available else cpu. Raises MoeOffloadError for an unusable device."""
    if name in (None, "auto"):
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name not in ("cpu", "cuda") and not name.startswith("cuda:"):
        raise MoeOffloadError(f"unknown device {name!r}; use cpu or cuda")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise MoeOffloadError("--device cuda was asked for but no CUDA device is available")
    dev = torch.device(name)
    if dev.type == "cuda" and dev.index is None:  # an indexed device: worker threads call set_device with it
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


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


@dataclass
class LoadedModel:
    """A model ready to generate: ``model`` (transformers), ``tokenizer`` (or None), ``engine`` (None for FullLoad),
    ``arch``, ``device``, ``dtype`` (compute) and the expert geometry; ``expert_bytes`` is one routed expert's
    stored bytes (native precision: FP8 about half of bf16, MXFP4 about a quarter), ``host_store`` the store mode;
    ``eos_ids`` and ``max_positions`` say where generation stops (``models.gen_limits``; set by both loaders)."""

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
    host_store: str | None = None           # "pinned" | "mmap" | "disk" (None: FullLoad)
    expert_dtypes: tuple[str, ...] = ()     # stored dtypes of the experts, e.g. ("bfloat16", "float8_e4m3fn")
    multimodal: bool = False                # a multimodal checkpoint served for text-only prompts
    eos_ids: frozenset[int] | None = None   # ids that end a generation (``gen_limits.eos_token_ids``)
    max_positions: int | None = None        # positions a sequence may use (``gen_limits.position_limit``)
    memory_plan: object = None              # the serve.memory.MemoryPlan that sized the pool (--memory-budget)

    def close(self) -> None:
        """Release the engine's copy worker and host store (no-op for FullLoad); the model must not run after."""
        if self.engine is not None:
            self.engine.close()

    @property
    def model_id(self) -> str:
        """The checkpoint's identity for traces and predictors (``models.checkpoint.checkpoint_model_id``)."""
        return checkpoint_model_id(self.path)


def _with_limits(lm: LoadedModel, config) -> LoadedModel:
    """``lm`` with its generation config read as ``from_pretrained`` reads it (``generation_config.json``, else
    ``config.json``; set on the model too, so FullLoad and offloaded models carry the same one), its EOS ids and its
    position limit (``models.gen_limits``), for every generation loop."""
    from .gen_limits import eos_token_ids, load_generation_config, position_limit

    gc = load_generation_config(lm.path, config)
    if gc is not None:
        lm.model.generation_config = gc
    lm.eos_ids = eos_token_ids(gc, config, lm.tokenizer)
    lm.max_positions = position_limit(config)
    return lm


def _load_tokenizer(path: Path):
    from transformers import AutoTokenizer

    if not any((path / n).exists() for n in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return None
    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception as e:
        raise MoeOffloadError(f"cannot load the tokenizer in {path}: {e}") from None


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


def _build_meta(config, dt: torch.dtype):
    """The model on the meta device, its experts modules ``[(name, module)]`` (one per MoE layer) and the experts'
    ``[(param, per-expert shape)]``.

    Raises:
        MoeOffloadError: the model cannot be served (``models.capability.inspect_model`` says why).
    """
    model, mods, geo = inspect_model(config, dt)
    return model, mods, list(geo.expert_params)


def _materialise(model: torch.nn.Module, mods: list, dev: torch.device, dt: torch.dtype) -> None:
    """Drop the routed experts' fused parameters (they never exist on the device), allocate everything else on
    ``dev`` and initialise non-persistent buffers (rotary ``inv_freq``)."""
    for _, mod in mods:
        for pname, _p in expert_params(mod):
            setattr(mod, pname, torch.nn.Parameter(torch.empty(0, device="meta", dtype=dt), requires_grad=False))
    model.to_empty(device=dev)
    persistent = set(model.state_dict())
    for mname, mod in model.named_modules():
        if any(f"{mname}.{b}".lstrip(".") not in persistent for b, _ in mod.named_buffers(recurse=False)):
            model._init_weights(mod)


def load_offloaded(model_dir: str | Path, *, device: str | None = None, dtype: str | None = None,
                   residency: float | None = None, slots: int | None = None,
                   policy: PolicySpec | str = "lru", progress: bool = True, link_epl: float = 1.39, link_gbps: float | None = None,
                   seconds_per_expert: float | None = None, interval: int = 1,
                   host_seconds_per_token_expert: float = 0.0, host_seconds_per_expert: float = 0.0,
                   host_store: str | None = None, host_cache_gb: float | None = None,
                   pack: str | Path | bool | None = None) -> LoadedModel:
    """Load ``model_dir`` with routed experts in a host store and a device slot pool of the requested size.

    Args:
        model_dir: Hugging Face checkpoint directory (config.json + *.safetensors [+ tokenizer]); float weights,
            FP8 block-quantized (``quant_method: fp8``) or MXFP4 (``quant_method: mxfp4``) experts, which stay in
            their native precision in the host store, on the link and in the slots (``runtime.formats``).
        device: "cpu", "cuda", "cuda:N" or None (cuda when available).
        dtype: compute dtype "float32" | "bfloat16" | "float16" | None (the checkpoint's).
        residency: slots as a fraction of all routed experts, in (0, 1].
        slots: number of slots (>= top-k). Default: residency 1.0.
        policy: a ``core.policy_spec.PolicySpec`` (a name is parsed by ``parse_policy``): a history policy
            ("lru", "lfu", "lfru-H", "prefill-hot", "auto"), "seqmoe-cacheonly" (probabilistic Belady,
            which needs a predictor's forecasts fed through ``predictor.runtime.ForecastFeed``), or a full SeqMoE
            pipeline: "seqmoe" (probabilistic Belady + JSD prefetching, SeqMoE §6-§7) / "seqmoe-infinity" (with
            MoE-Infinity's task ordering) / "xl" (the same fed cross-layer forecasts, ``predictor.cross_layer``) /
            "seqmoe-xl" (fed SeqMoE's forecasts blended with cross-layer ones, ``predictor.blend``): the engine gets
            a ``runtime.prefetcher.Prefetcher`` (feed it forecasts, e.g. ``predictor.cross_layer.attach_forecasts``).
            Or a diffusion refresh planner (TIDE, ``core.refresh``): "reactive", "tide-fixed" (``interval`` steps;
            or "tide-fixed-T<n>"), "tide" (cost model calibrated at load: ``runtime.refresh_calibrate.calibrate_costs``);
            the slots are then split into equal per-layer budgets (``ceil(slots / L)`` experts per layer, at least
            top-k) and misses are computed on the host.
        link_epl: with prefetching: the scheduler's transfer budget B_avg, experts per layer compute time.
        link_gbps / seconds_per_expert: with prefetching: emulate a link of this speed (every expert copy, on
            demand or prefetch, takes at least ``expert_bytes / (link_gbps * 1e9)`` resp. this many seconds).
        host_seconds_per_token_expert, host_seconds_per_expert: refresh planners: emulated host fallback cost
            (seconds) per token-expert and per expert computed on the host (``bench diffusion`` sets them).
        host_store: "pinned" (a private copy of the experts, page-locked on CUDA; default on CUDA) or "mmap" (slot
            loads read the safetensors files' memory maps: no private copy; default on the CPU: "pinned") or "disk"
            (``runtime.disk_store.DiskStore``: slot loads read the files with direct I/O, around the page cache; no
            expert byte in host memory but the slots; copies run on real reader threads, so ``link_gbps`` /
            ``seconds_per_expert`` emulation is refused: the disk is the link).
        host_cache_gb: with ``host_store`` "disk": a host cache of this many GB (10^9 bytes; whole experts) between
            the disk and the slots (``runtime.host_cache.HostCache``, LRU; page-locked on CUDA): three tiers.
        pack: with ``host_store`` "disk": an aligned expert pack folder (``models.expert_pack``) to read the experts
            from; None (default): the one beside the model if there is one; False: the checkpoint's files.

    Raises:
        MoeOffloadError: any bad input (see ``read_config``, ``Checkpoint``, ``num_slots_for``, ``make_policy``), an
            unsupported quantization or a checkpoint that disagrees with its config; a pack that is not this
            checkpoint's (``models.expert_pack.ExpertPack.check``).
    """
    host_store = host_store or "pinned"
    if host_store not in HOST_STORES:
        raise MoeOffloadError(f"unknown --host-store {host_store!r}; choose one of: {', '.join(HOST_STORES)}")
    path, config, arch = read_config(model_dir)
    quant = quantization(json.loads((path / "config.json").read_text()))
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, config)
    spec = parse_policy(policy)
    if spec.family == "auto" and arch.diffusion:  # the chooser simulates autoregressive decode steps
        spec = parse_policy("lru")
    check_policy(spec, arch, interval)
    refresh = spec.refresh
    ckpt = Checkpoint(path)
    ckpt.random_access = host_store == "disk"
    model, mods, shapes = _build_meta(config, dt)
    layer_of = {name: i for i, (name, _) in enumerate(mods)}
    num_experts = mods[0][1].num_experts
    top_k = _top_k(config)
    n_total = len(mods) * num_experts
    num_slots = num_slots_for(n_total, top_k, residency, slots)
    if refresh:  # a per-layer budget: the same share of every layer's experts
        budget = max(top_k, min(num_experts, -(-num_slots // len(mods))))
        num_slots = budget * len(mods)
    cmap = map_checkpoint(model, mods, ckpt, quant, {n for n, _ in shapes})
    if host_cache_gb is not None and host_store != "disk":
        raise MoeOffloadError("--host-cache sits between the disk and the device slots: use it with --host-store disk")
    if host_store == "disk" and (link_gbps is not None or seconds_per_expert is not None):
        raise MoeOffloadError("--link-gbps emulates a link; with --host-store disk the link is the disk itself")
    fmt = build_format(mods, cmap, ckpt, quant, dt, shapes, keep_file_dtype=host_store in FILE_BACKED)
    _materialise(model, mods, dev, dt)
    load_non_expert(model, cmap, ckpt, layer_of)
    if dev.type == "cpu":
        rehome_parameters(model)  # the weights a step streams on huge pages (runtime.huge_pages), as FullLoad's
        use_fast_linears(model)  # decode-step linears on the native kernel, as FullLoad (runtime.fast_linear)
        use_fast_norms(model)  # and its RMSNorms (runtime.fast_norm)
        use_decode_attention(model)  # and its attention (runtime.decode_attention)
    if host_store == "mmap":
        store = MmapHostStore(fmt.layout, n_total)
    elif host_store == "disk":
        from ..runtime.disk_store import DEFAULT_READERS, DiskStore
        from ..core.disk_link import readers_for

        store = DiskStore(fmt.layout, n_total, readers=readers_for(fmt.layout.expert_bytes, DEFAULT_READERS))
    else:
        store = HostStore(fmt.layout, n_total, pin=dev.type == "cuda")
        if store.pin_failed:
            print("moe-offload: warning: could not page-lock the host store; copies to the device are synchronous")
    _fill(store, fmt, cmap, ckpt, path, pack, len(mods), num_experts, progress)
    if host_cache_gb is not None:  # three tiers: slots <- host cache <- disk
        from ..runtime.host_cache import HostCache

        store = HostCache(store, _host_cache_rows(host_cache_gb, fmt.layout.expert_bytes), pin=dev.type == "cuda")
    ckpt.close()
    model.eval()
    model.requires_grad_(False)
    pool = SlotPool(fmt, num_slots, n_total, dev)
    engine = make_engine(spec, store, pool, mods, num_slots, top_k, num_experts,
                          budget if refresh else None, dict(link_epl=link_epl, link_gbps=link_gbps,
                          seconds_per_expert=seconds_per_expert, interval=interval,
                          host_seconds_per_token_expert=host_seconds_per_token_expert,
                          host_seconds_per_expert=host_seconds_per_expert))
    engine.attach([m for _, m in mods])
    watch_routers(model, mods)  # observers see [T, k] routing where an experts call gets one route per row
    return _with_limits(LoadedModel(model, _load_tokenizer(path), engine, arch, dev, dt, len(mods), num_experts,
                                    top_k, fmt.layout.expert_bytes, path, host_store, tuple(fmt.stored_dtypes),
                                    generation_class(config)[1]), config)


def _fill(store, fmt, cmap, ckpt, path: Path, pack, num_layers: int, num_experts: int, progress: bool) -> None:
    """The store's experts: from the aligned expert pack for ``--host-store disk`` where one is given or lies beside
    the model (``models.expert_pack``; ``pack`` False: never), else from the checkpoint's files (``fill_store``).

    Raises:
        MoeOffloadError: ``pack`` given for another host store, or a pack that does not match (``ExpertPack.check``).
    """
    if pack not in (None, False) and store.mode != "disk":
        raise MoeOffloadError("--pack needs --host-store disk (the pinned and mmap stores read the checkpoint "
                              "itself)")
    if store.mode == "disk" and pack is not False:
        from .expert_pack import find_pack

        found = find_pack(path, pack)
        if found is not None:
            found.check(path, fmt.layout, num_layers * num_experts)
            found.add_to(store, num_layers * num_experts)
            return
    fill_store(store, fmt, cmap, ckpt, num_layers, num_experts, progress)


def _host_cache_rows(gb: float, expert_bytes: int) -> int:
    """Whole experts in a host cache of ``gb`` GB.

    Raises:
        MoeOffloadError: a size that is not a finite number > 0 or holds no expert.
    """
    if not (gb > 0 and math.isfinite(gb)):
        raise MoeOffloadError(f"--host-cache must be a finite number of GB > 0, got {gb}")
    rows = round(gb * 1e9) // expert_bytes
    if rows < 1:
        raise MoeOffloadError(f"--host-cache {gb:g} GB holds no expert of {expert_bytes:,d} B")
    return rows


def load_full(model_dir: str | Path, *, device: str | None = None, dtype: str | None = None) -> LoadedModel:
    """FullLoad reference: the same checkpoint with every weight on the device (the correctness reference and the
    speed limit). Its experts run the native kernel where it serves the layer, as the offloaded engine does
    (``runtime.fused_experts.use_fused_fullload``), else transformers' own experts implementation."""
    path, config, arch = read_config(model_dir)
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, config)
    validate_checkpoint(path, config, dt)  # the offloaded path's capability check and checkpoint accounting
    auto, multimodal = generation_class(config)
    try:
        model = auto.from_pretrained(path, dtype=dt, **fullload_kwargs(config)).to(dev)  # FP8: models.fp8_full
    except Exception as e:
        raise MoeOffloadError(f"cannot load {path}: {type(e).__name__}: {str(e).strip().splitlines()[0][:300]}") \
            from None
    model.eval()
    mods = experts_modules(model)
    if dev.type == "cpu":
        rehome_parameters(model)  # the weights a step streams on huge pages, as the offloaded engine's
        use_fused_fullload([m for _, m in mods])
        use_fast_linears(model)
        use_fast_norms(model)
        use_decode_attention(model)
    n_exp = mods[0][1].num_experts
    fmt = ExpertFormat.plain([(n, tuple(p.shape[1:])) for n, p in expert_params(mods[0][1])], dt)
    return _with_limits(LoadedModel(model, _load_tokenizer(path), None, arch, dev, dt, len(mods), n_exp,
                                    _top_k(config), fmt.layout.expert_bytes, path, None, tuple(fmt.stored_dtypes),
                                    multimodal), config)
