"""``moe-offload bench link``: this machine's host->device copy bandwidth and compute rates, measured and written
as the ``this-machine`` hardware profile (``core.profiles``), which ``simulate``, ``bench decode`` and the TIDE cost
model (``core.costs``) read with ``--hardware this-machine``."""

from __future__ import annotations

import os
import platform
import statistics
import time

from ..errors import MoeOffloadError
from ..core.profiles import THIS_MACHINE, merge_this_machine


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
    merge_this_machine(profile)  # the link's section; a disk section (`bench link --disk`) is kept
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
        "sources": {"link_gbps": f"measured by bench.link.measure_link at {when} (median of {repeats} copies of "
                                 f"{size_mb} MiB)",
                    "device_memory_gb": "torch.cuda.get_device_properties" if dev.type == "cuda"
                    else "os.sysconf physical memory"},
        "unsourced": [],
        "note": "Measured, not from a paper. On the CPU the 'device' is host memory and the link is a memcpy.",
    }
    for key, value in compute["values"].items():
        profile[key] = value
        profile["sources"][key] = f"measured by bench.link.measure_compute at {when}: {compute['methods'][key]}"
    for key, value in compute["values"].items():
        profile[key] = value
        profile["sources"][key] = f"measured by bench.link.measure_compute at {when}: {compute['methods'][key]}"
    return profile
