#!/usr/bin/env python3
"""The disk tier's prefetch request size against the decode step (issue 47, session 51): `lru`, then `xl+gate` with
the prefetch reads in requests of each CHUNK_MIB (a multiple of 4 KiB), in turn (reversed in even rounds), ROUNDS
times; each run a fresh `generate --json` process (`DiskStore`'s `prefetch_chunk` set for it) on the three ShareGPT
prompts from offset 600 x 64 tokens with the experts read from disk. Prints one row per run and the medians over
rounds of each configuration's tok/s over `lru`'s in the same round.

    python scripts/prefetch_chunk_ab.py [MODEL] [RESIDENCY] [ROUNDS] [CHUNK_MIB ...]
    # default: testbed-sparse-wide 0.25 3 1 4

Each request costs the reading thread CPU on the compute's two cores whatever its size; fewer, larger requests leave
the compute more of them (docs/benchmarks.md, session 51; docs/results/prefetch-chunk-s51.txt).
"""

import json
import statistics
import subprocess
import sys

RUN = """
import inspect, sys
from moe_offload.runtime import disk_store
init = disk_store.DiskStore.__init__
assert list(inspect.signature(init).parameters)[-1] == "prefetch_chunk", "DiskStore's last argument moved"
init.__defaults__ = (*init.__defaults__[:-1], int(sys.argv[1]))
from moe_offload.cli.entry import main
sys.exit(main(sys.argv[2:]))
"""

model = sys.argv[1] if len(sys.argv) > 1 else "testbed-sparse-wide"
residency = sys.argv[2] if len(sys.argv) > 2 else "0.25"
rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 3
chunks = [int(float(c) * (1 << 20)) for c in sys.argv[4:]] or [1 << 20, 4 << 20]
if any(c <= 0 or c % 4096 for c in chunks):
    sys.exit("prefetch_chunk_ab.py: each CHUNK_MIB must be a positive multiple of 4 KiB (1/256 MiB)")
args = ["generate", "--model", model, "--residency", residency, "--host-store", "disk", "--sharegpt", "3",
        "--sharegpt-offset", "600", "--max-new-tokens", "64", "--threads", "2", "--json"]
configs = [("lru", chunks[0])] + [("xl+gate", c) for c in chunks]


def measure(policy: str, chunk: int) -> dict:
    done = subprocess.run([sys.executable, "-c", RUN, str(chunk), *args, "--policy", policy],
                          capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"prefetch_chunk_ab.py: generate --policy {policy} failed: {done.stderr.strip()[-500:]}")
    s = json.loads(done.stdout)["stats"]
    ms, acc = s["time_breakdown"]["ms_per_step"], s["cpu_account"]
    return {"tok/s": s["decode_tokens_per_s"], "compute": ms["expert_compute"] + ms["other_compute"],
            "pred+mgmt": ms["predictor"] + ms["management"], "stall": ms["stall"],
            "prefetch CPU": acc["ms_per_step"].get("copy worker", {}).get("prefetch_reads", {}).get("cpu", 0.0),
            "MB used": acc["bytes_per_step"]["prefetched_used"] / 1e6,
            "MB wasted": acc["bytes_per_step"]["prefetched_wasted"] / 1e6,
            "on-demand GB/s": s["disk"]["demand_gbps"]}


ratios: dict[tuple[str, int], list[float]] = {c: [] for c in configs[1:]}
print(f"{model} at residency {residency}, {rounds} rounds (ms per decode step)\n")
print("| round | policy | prefetch request MiB | tok/s | vs lru | compute | predictor + management | stall | "
      "prefetch reads CPU | prefetched MB used / wasted | on-demand GB/s |")
print("|---|---|---:|---:|---:|---:|---:|---:|---:|---|---:|")
for r in range(1, rounds + 1):
    got = {c: measure(*c) for c in (configs if r % 2 else configs[::-1])}
    base = got[configs[0]]["tok/s"]
    for policy, chunk in (configs if r % 2 else configs[::-1]):
        m = got[(policy, chunk)]
        if policy != "lru":
            ratios[(policy, chunk)].append(m["tok/s"] / base)
        size = "-" if policy == "lru" else f"{chunk / (1 << 20):g}"
        print(f"| {r} | {policy} | {size} | {m['tok/s']:.2f} | {m['tok/s'] / base:.3f} | "
              f"{m['compute']:.1f} | {m['pred+mgmt']:.1f} | {m['stall']:.1f} | {m['prefetch CPU']:.1f} | "
              f"{m['MB used']:.0f} / {m['MB wasted']:.0f} | {m['on-demand GB/s']:.2f} |", flush=True)
print()
for (policy, chunk), rs in ratios.items():
    print(f"{policy}, {chunk / (1 << 20):g} MiB requests: median {statistics.median(rs):.3f}x lru "
          f"({', '.join(f'{x:.3f}' for x in rs)})")
