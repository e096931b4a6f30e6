"""The TIDE cost model measured on this machine at load (``generate --policy tide``; ``core.costs.TideCosts``)."""

from __future__ import annotations

import time

import torch

from .pool import SlotPool
from .host_fallback import host_expert_rows
from .experts import slot_pair_outputs
from .store import HostStore
from .transfer import TransferEngine


def _median_seconds(fn, repeats: int = 5) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def calibrate_costs(module: torch.nn.Module, store: HostStore, pool: SlotPool, transfer: TransferEngine,
                    num_moe_layers: int, num_experts: int, top_k: int, host_seconds_per_token_expert: float = 0.0,
                    host_seconds_per_expert: float = 0.0, tokens: int = 32, overlap_host: bool = True):
    """Measure the TIDE cost model on this machine at start-up (``core.costs.TideCosts``, seconds):

    * ``swap_s``: one expert's host->device copy through ``transfer`` (its link emulation when set, else the
      median of 3 real copies into slot 0, before any slot is in use);
    * ``fallback_expert_s`` / ``fallback_token_s``: host compute of one expert for 1 and for ``tokens`` tokens
      from the host store (median of 5), split into a per-call and a per-token-expert part; with an emulated
      host (``host_seconds_per_expert`` / ``host_seconds_per_token_expert``, which ``RefreshEngine`` enforces as a
      minimum duration) each part is the larger of the measured and the emulated one;
    * ``device_expert_s`` / ``device_token_s``: the same on the slot pool;
    * ``overlap_host``: as given, how the engine runs host fallback (``RefreshEngine``'s ``overlap_host``: by
      default beside the device compute, ``runtime.host_fallback``).

    Raises:
        RuntimeError: a calibration copy failed.
    """
    from ..core.costs import TideCosts

    if transfer.seconds_per_expert is not None:
        swap_s = transfer.seconds_per_expert
    else:
        def copy():
            transfer.submit(0, 0)
            got = transfer.wait(0)
            if got is None or not got.ok:
                raise RuntimeError("calibration copy failed")
        swap_s = max(_median_seconds(copy, 3), 1e-9)
    hidden = int(getattr(module.config, "hidden_size"))
    dtype = pool.format.compute_dtype
    host_rows, _, _ = host_expert_rows(store, pool.format, torch.zeros(1, dtype=torch.long),
                                       torch.ones(1, dtype=torch.bool), [0])

    def per_call(source, n, device):
        x = torch.randn(n, hidden, dtype=dtype, device=device)
        rows = torch.zeros(n, dtype=torch.long, device=device)
        w = torch.ones(n, dtype=dtype, device=device)

        def run():
            slot_pair_outputs(module, source, x, rows, w, 1, [0])
            if device.type == "cuda":
                torch.cuda.synchronize(device)
        run()
        return _median_seconds(run)

    with torch.no_grad():
        cpu = torch.device("cpu")
        h1, hn = per_call(host_rows, 1, cpu), per_call(host_rows, tokens, cpu)
        d1, dn = per_call(pool.rows, 1, pool.device), per_call(pool.rows, tokens, pool.device)
    return TideCosts(expert_bytes=store.layout.expert_bytes, swap_s=swap_s,
                     device_expert_s=d1, device_token_s=max(0.0, (dn - d1) / (tokens - 1)),
                     fallback_expert_s=max(h1, host_seconds_per_expert),
                     fallback_token_s=max((hn - h1) / (tokens - 1), host_seconds_per_token_expert, 0.0),
                     num_moe_layers=num_moe_layers, num_experts=num_experts, top_k=top_k,
                     overlap_host=overlap_host,
                     provenance={"all": "measured at start-up (runtime.refresh_engine.calibrate_costs)"})
