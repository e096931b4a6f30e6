"""Hardware and model profiles for the cost model (DESIGN.md §5 "Cost model", §6; SeqMoE §9.1, Table 1, fig. 6).

Profiles are JSON data files shipped in ``moe_offload/data/profiles/{hardware,models}/<name>.json``. Every number
in them has an entry in ``sources`` (paper section / figure / spec sheet / config it comes from, or the arithmetic
it is derived by) or is listed in ``unsourced`` with a ``note`` saying what was assumed.

One hardware profile is not shipped: ``this-machine``, written by :func:`measure_link` into
``<cache>/hardware/this-machine.json`` (cache = ``$MOE_OFFLOAD_CACHE`` or ``~/.cache/moe-offload``).
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from ..errors import MoeOffloadError

THIS_MACHINE = "this-machine"

_HW_FIELDS = ("name", "device_memory_gb", "link", "link_gbps")
_MODEL_FIELDS = ("name", "num_moe_layers", "num_experts", "top_k", "expert_bytes")


@dataclass(frozen=True)
class HardwareProfile:
    """One platform: device memory and the host->device link (SeqMoE §9.1 "Hardware").

    Attributes:
        name: profile name (file stem), e.g. ``"rtx4090"``.
        device_memory_gb: device memory in GB (10^9 bytes, as the spec sheets count).
        link: the host->device link in words, e.g. ``"PCIe 4.0 x16"``.
        link_gbps: effective host->device copy bandwidth for large pinned copies, GB/s (10^9 bytes per second).
        link_theoretical_gbps: the link's per-direction theoretical bandwidth, GB/s (None when measured).
        link_efficiency: ``link_gbps / link_theoretical_gbps`` as assumed (None when measured).
        sources: ``{field: where the number comes from}``.
        unsourced: fields whose values are assumptions (explained in ``note``).
        note: free text.
        extra: any other keys of the JSON file (kept for later cost-model fields).
    """

    name: str
    device_memory_gb: float
    link: str
    link_gbps: float
    link_theoretical_gbps: float | None = None
    link_efficiency: float | None = None
    description: str = ""
    sources: dict = field(default_factory=dict)
    unsourced: tuple = ()
    note: str = ""
    extra: dict = field(default_factory=dict)

    @property
    def link_bytes_per_s(self) -> float:
        """Effective host->device bandwidth in bytes per second."""
        return self.link_gbps * 1e9


@dataclass(frozen=True)
class ModelProfile:
    """One MoE model's offloading geometry (SeqMoE Table 1) and its measured FullLoad speeds (SeqMoE fig. 6).

    Attributes:
        name: profile name (file stem), e.g. ``"qwen3-30b-a3b-fp8"``.
        num_moe_layers: L, MoE layers (layers whose routed experts are offloaded).
        num_experts: routed experts per MoE layer (shared experts excluded: they stay on the device).
        top_k: experts each token selects per MoE layer.
        expert_bytes: bytes of one routed expert as stored (payload + quantisation scales + biases): the size of
            one host->device copy.
        full_load_tok_s: ``{hardware_name: decode tokens/s with every weight on the device}``, batch size 1
            (SeqMoE fig. 6 first row, decode length 128-1024). May be empty (then the time model needs an override).
        full_load_tok_s_long_decode: same for decode length 4096-8192 (fig. 6 second row), where known.
        paper_overlap_experts_per_layer: ``{hardware_name: experts whose transfer one layer's compute overlaps}``
            as stated by a paper (SeqMoE §2.2), recorded for calibration checks only.
        hidden_size, moe_intermediate_size, expert_dtype, model_type, description: descriptive fields.
        sources, unsourced, note: provenance, as for HardwareProfile.
        extra: any other keys of the JSON file.
    """

    name: str
    num_moe_layers: int
    num_experts: int
    top_k: int
    expert_bytes: int
    full_load_tok_s: dict = field(default_factory=dict)
    full_load_tok_s_long_decode: dict = field(default_factory=dict)
    paper_overlap_experts_per_layer: dict = field(default_factory=dict)
    hidden_size: int | None = None
    moe_intermediate_size: int | None = None
    expert_dtype: str = ""
    model_type: str = ""
    description: str = ""
    sources: dict = field(default_factory=dict)
    unsourced: tuple = ()
    note: str = ""
    extra: dict = field(default_factory=dict)

    @property
    def accesses_per_step(self) -> int:
        """Expert accesses of one single-token decode step: ``num_moe_layers * top_k``."""
        return self.num_moe_layers * self.top_k

    @property
    def total_expert_bytes(self) -> int:
        """Bytes of all routed experts of the model: ``num_moe_layers * num_experts * expert_bytes``."""
        return self.num_moe_layers * self.num_experts * self.expert_bytes


# ------------------------------------------------------------------------------------------------ locations


def cache_dir() -> Path:
    """The user cache: ``$MOE_OFFLOAD_CACHE`` if set, else ``~/.cache/moe-offload``."""
    from ..common.cache import default_cache_dir

    return default_cache_dir()


def this_machine_path() -> Path:
    """Where :func:`measure_link` writes, and ``load_hardware("this-machine")`` reads, the measured profile."""
    return cache_dir() / "hardware" / f"{THIS_MACHINE}.json"


def _data_dir(kind: str):
    return resources.files("moe_offload").joinpath("data", "profiles", kind)


def _shipped(kind: str) -> list[str]:
    d = _data_dir(kind)
    if not d.is_dir():
        return []
    return sorted(p.name[:-5] for p in d.iterdir() if p.name.endswith(".json"))


def list_hardware() -> list[str]:
    """Names accepted by :func:`load_hardware`: the shipped profiles plus ``"this-machine"`` (measured)."""
    return _shipped("hardware") + [THIS_MACHINE]


def list_models() -> list[str]:
    """Names accepted by :func:`load_model_profile` (the shipped model profiles)."""
    return _shipped("models")


def _read_json(path, what: str) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise MoeOffloadError(f"cannot read {what} profile {path}: {e}") from None
    if not isinstance(data, dict):
        raise MoeOffloadError(f"{what} profile {path} is not a JSON object")
    return data


def _split(data: dict, cls, required: tuple, path) -> dict:
    missing = [k for k in required if k not in data]
    if missing:
        raise MoeOffloadError(f"profile {path} lacks fields {missing}")
    known = set(cls.__dataclass_fields__) - {"extra"}
    kw = {k: v for k, v in data.items() if k in known}
    kw["extra"] = {k: v for k, v in data.items() if k not in known}
    if "unsourced" in kw:
        kw["unsourced"] = tuple(kw["unsourced"])
    return kw


# ------------------------------------------------------------------------------------------------ loading


def load_hardware(name: str) -> HardwareProfile:
    """Load a hardware profile by name (see :func:`list_hardware`).

    ``"this-machine"`` reads the file :func:`measure_link` wrote into the user cache.

    Raises:
        MoeOffloadError: unknown name (the message lists the known ones), a missing this-machine measurement
            ("run `moe-offload bench link` first"), or an unreadable / incomplete file.
    """
    if name == THIS_MACHINE:
        path = this_machine_path()
        if not path.is_file():
            raise MoeOffloadError(f"no measured profile for this machine at {path}: run `moe-offload bench link` first")
        data = _read_json(path, "hardware")
    else:
        known = _shipped("hardware")
        if name not in known:
            raise MoeOffloadError(f"unknown hardware profile {name!r}; known: {', '.join(known + [THIS_MACHINE])}")
        path = _data_dir("hardware").joinpath(f"{name}.json")
        data = _read_json(path, "hardware")
    kw = _split(data, HardwareProfile, _HW_FIELDS, path)
    kw["device_memory_gb"] = float(kw["device_memory_gb"])
    kw["link_gbps"] = float(kw["link_gbps"])
    if kw["link_gbps"] <= 0:
        raise MoeOffloadError(f"hardware profile {path}: link_gbps must be > 0, got {kw['link_gbps']}")
    return HardwareProfile(**kw)


def load_model_profile(name: str) -> ModelProfile:
    """Load a model profile by name (see :func:`list_models`).

    Raises:
        MoeOffloadError: unknown name (the message lists the known ones) or an unreadable / incomplete file.
    """
    known = _shipped("models")
    if name not in known:
        raise MoeOffloadError(f"unknown model profile {name!r}; known: {', '.join(known)}")
    path = _data_dir("models").joinpath(f"{name}.json")
    kw = _split(_read_json(path, "model"), ModelProfile, _MODEL_FIELDS, path)
    for k in ("num_moe_layers", "num_experts", "top_k", "expert_bytes"):
        kw[k] = int(kw[k])
    return ModelProfile(**kw)


def model_profile_for(num_moe_layers: int, num_experts: int, top_k: int, model_type: str | None = None) -> str | None:
    """The shipped model profile with this routing geometry (and, when given, this ``model_type``), or None when
    there is not exactly one."""
    found = []
    for name in list_models():
        mp = load_model_profile(name)
        if (mp.num_moe_layers, mp.num_experts, mp.top_k) != (num_moe_layers, num_experts, top_k):
            continue
        if model_type and mp.model_type and mp.model_type != model_type:
            continue
        found.append(name)
    return found[0] if len(found) == 1 else None


def default_hardware(model: ModelProfile) -> tuple[str, str]:
    """The hardware profile to use with ``model`` when none is named, and why: a platform the model profile has a
    measured FullLoad speed on (rtx4090 first), else the measured ``this-machine`` profile if ``bench link`` wrote
    one, else rtx4090."""
    if model.full_load_tok_s:
        name = "rtx4090" if "rtx4090" in model.full_load_tok_s else sorted(model.full_load_tok_s)[0]
        return name, f"{model.name} has a measured FullLoad speed on it"
    if this_machine_path().is_file():
        return THIS_MACHINE, f"{model.name} runs on this machine; measured by `moe-offload bench link`"
    return "rtx4090", "default; `moe-offload bench link` would measure this machine"


# ------------------------------------------------------------------------------------------------ measuring


def _median_time(fn, repeats: int, sync=None) -> float:
    fn()  # warm-up
    if sync:
        sync()
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        if sync:
            sync()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def measure_compute(device, hidden: int = 2048, intermediate: int = 512, tokens: int = 32,
                    stream_mb: int = 64, repeats: int = 7) -> dict:
    """Measure the TIDE cost model's compute rates (``core.costs.HW_KEYS``) on this machine, at LLaDA2.0-mini's
    expert shape by default (``[tokens, hidden] x [hidden, intermediate]`` bf16 GEMMs).

    Host (always the CPU, where a host fallback runs): ``host_stream_gbps`` (GB/s of a sum over a ``stream_mb`` MiB
    bf16 tensor: streaming an expert's weights from host memory), ``host_bf16_gflops`` (GFLOP/s of the GEMM above)
    and ``host_call_overhead_us`` (microseconds of a 1x1x1 matmul call). Device (``device``; on the CPU the same
    numbers): ``device_mem_bw_gbps``, ``device_bf16_tflops``, ``layer_overhead_us`` (a 1x1x1 matmul, i.e. one
    launch), with efficiencies 1.0 since the rates are measured at the expert's own shape.

    Returns:
        ``{"values": {key: number}, "methods": {key: how}}`` (medians of ``repeats``).
    """
    import torch

    dev = torch.device(device)
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else None
    bf = torch.bfloat16

    def rates(d, sync_fn):
        buf = torch.ones((stream_mb << 20) // 2, dtype=bf, device=d)
        stream_s = _median_time(lambda: buf.sum(), repeats, sync_fn)
        x = torch.randn(tokens, hidden, device=d).to(bf)
        w = torch.randn(hidden, intermediate, device=d).to(bf)
        gemm_s = _median_time(lambda: x @ w, repeats, sync_fn)
        one = torch.ones(1, 1, dtype=bf, device=d)
        call_s = _median_time(lambda: one @ one, repeats, sync_fn)
        return buf.numel() * 2 / stream_s / 1e9, 2 * tokens * hidden * intermediate / gemm_s, call_s * 1e6

    h_gbps, h_flops, h_call = rates(torch.device("cpu"), None)
    d_gbps, d_flops, d_call = (h_gbps, h_flops, h_call) if dev.type == "cpu" else rates(dev, sync)
    shape = f"bf16 [{tokens}, {hidden}] x [{hidden}, {intermediate}]"
    values = {"host_stream_gbps": round(h_gbps, 3), "host_bf16_gflops": round(h_flops / 1e9, 3),
              "host_call_overhead_us": round(h_call, 3), "device_mem_bw_gbps": round(d_gbps, 3),
              "device_bf16_tflops": round(d_flops / 1e12, 6), "device_mem_efficiency": 1.0,
              "device_compute_efficiency": 1.0, "layer_overhead_us": round(d_call, 3)}
    methods = {"host_stream_gbps": f"sum over a {stream_mb} MiB bf16 host tensor",
               "host_bf16_gflops": f"host GEMM {shape}", "host_call_overhead_us": "host 1x1x1 bf16 matmul call",
               "device_mem_bw_gbps": f"sum over a {stream_mb} MiB bf16 tensor on {dev}",
               "device_bf16_tflops": f"GEMM {shape} on {dev}", "device_mem_efficiency": "rate measured directly",
               "device_compute_efficiency": "rate measured directly",
               "layer_overhead_us": f"1x1x1 bf16 matmul call on {dev}"}
    return {"values": values, "methods": methods}


def measure_link(device=None, size_mb: int = 256, repeats: int = 5) -> dict:
    """Measure this machine's host->device copy bandwidth and compute rates (``measure_compute``: host fallback and
    device compute, the TIDE cost model's keys) and write the ``this-machine`` hardware profile.

    On CUDA: a pinned host uint8 tensor of ``size_mb`` MiB copied to the device (``non_blocking``), timed with CUDA
    events after one warm-up copy. On the CPU: a copy between two host tensors of that size, timed with
    ``time.perf_counter`` — what the CPU "device" tier pays to move an expert from the host store into a slot.

    Args:
        device: ``None`` (CUDA if available, else CPU), ``"cpu"``, ``"cuda"`` or ``"cuda:N"`` (or a torch.device).
        size_mb: bytes per copy, in MiB (2^20 bytes).
        repeats: timed copies; the profile's ``link_gbps`` is their median (GB/s = 10^9 bytes/s).

    Returns:
        The profile dict written to ``<cache>/hardware/this-machine.json`` (``name``, ``device``, ``device_name``,
        ``device_memory_gb``, ``link``, ``link_gbps``, ``measured`` with the samples, ``sources``).

    Raises:
        MoeOffloadError: bad arguments or a CUDA device that is not available.
    """
    import torch

    if size_mb < 1 or repeats < 1:
        raise MoeOffloadError(f"measure_link needs size_mb >= 1 and repeats >= 1, got {size_mb}, {repeats}")
    dev = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    nbytes = int(size_mb) << 20
    if dev.type == "cuda":
        samples, device_name, mem_gb, link, method = _cuda_copy_rates(dev, nbytes, repeats)
    elif dev.type == "cpu":
        samples, device_name, mem_gb, link, method = _cpu_copy_rates(nbytes, repeats)
    else:
        raise MoeOffloadError(f"measure_link supports cpu and cuda devices, not {dev}")
    when = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    profile = _link_profile(dev, device_name, mem_gb, link, method, samples, size_mb, repeats, when,
                            measure_compute(dev))
    path = this_machine_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".partial")
    tmp.write_text(json.dumps(profile, indent=2) + "\n")
    tmp.replace(path)
    return profile


def _cuda_copy_rates(dev, nbytes: int, repeats: int) -> tuple[list[float], str, float, str, str]:
    """``measure_link`` on CUDA: ``(GB/s of each timed copy, device name, device memory GB, link, method)``."""
    import torch

    if not torch.cuda.is_available():
        raise MoeOffloadError(f"device {dev} requested but CUDA is not available")
    samples = []
    with torch.cuda.device(dev):
        src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        src.fill_(1)
        dst = torch.empty(nbytes, dtype=torch.uint8, device=dev)
        dst.copy_(src, non_blocking=True)  # warm-up
        torch.cuda.synchronize(dev)
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src, non_blocking=True)
            end.record()
            end.synchronize()
            samples.append(nbytes / (start.elapsed_time(end) / 1e3) / 1e9)
    props = torch.cuda.get_device_properties(dev)
    return (samples, props.name, props.total_memory / 1e9, "host->device (pinned, CUDA copy engine)",
            "pinned host -> device copy_, CUDA events")


def _cpu_copy_rates(nbytes: int, repeats: int) -> tuple[list[float], str, float, str, str]:
    """``measure_link`` on the CPU: ``(GB/s of each timed copy, processor name, physical memory GB, link,
    method)``."""
    import torch

    samples = []
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty(nbytes, dtype=torch.uint8)
    dst.copy_(src)  # warm-up (faults the pages in)
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        samples.append(nbytes / (time.perf_counter() - t0) / 1e9)
    device_name = platform.processor() or platform.machine()
    try:
        mem_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9
    except (ValueError, OSError, AttributeError):
        mem_gb = 0.0
    return samples, device_name, mem_gb, "host memory copy (CPU device tier)", \
        "host tensor -> host tensor copy_, perf_counter"


def _link_profile(dev, device_name: str, mem_gb: float, link: str, method: str, samples: list[float], size_mb: int,
                  repeats: int, when: str, compute: dict) -> dict:
    """The ``this-machine`` hardware profile of ``measure_link``'s measurements (``compute``:
    ``measure_compute``'s)."""
    import torch

    profile = {
        "name": THIS_MACHINE,
        "description": f"measured on {platform.node()} ({device_name})",
        "device": str(dev),
        "device_name": device_name,
        "device_memory_gb": round(mem_gb, 3),
        "link": link,
        "link_gbps": round(statistics.median(samples), 3),
        "measured": {"method": method, "size_mb": int(size_mb), "repeats": int(repeats),
                     "samples_gbps": [round(s, 3) for s in samples], "time": when,
                     "torch": torch.__version__},
        "sources": {"link_gbps": f"measured by profiles.measure_link at {when} (median of {repeats} copies of "
                                 f"{size_mb} MiB)",
                    "device_memory_gb": "torch.cuda.get_device_properties" if dev.type == "cuda"
                    else "os.sysconf physical memory"},
        "unsourced": [],
        "note": "Measured, not from a paper. On the CPU the 'device' is host memory and the link is a memcpy.",
    }
    for key, value in compute["values"].items():
        profile[key] = value
        profile["sources"][key] = f"measured by profiles.measure_compute at {when}: {compute['methods'][key]}"
    for key, value in compute["values"].items():
        profile[key] = value
        profile["sources"][key] = f"measured by profiles.measure_compute at {when}: {compute['methods'][key]}"
    return profile
