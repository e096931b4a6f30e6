#!/usr/bin/env bash
# One decode case run alternately on an earlier commit (A) and on this checkout (B), N rounds, in one session on one
# machine: decode tok/s, ms per step, the main thread's predictor + management CPU (runtime.cpu_account), the stall,
# the hit rate, the prefetched MB per step used / wasted and the prefetch reads' CPU per step (all threads). The
# earlier commit is checked out into a temporary git worktree and imported ahead of this checkout (PYTHONPATH); its
# native kernels build on first use if their
# sources differ (about 3 min).
#
#   scripts/checkout_ab.sh BASE_REV [POLICY] [ROUNDS] [RESIDENCY]   # default xl+gate 2 0.25
#
# The case: testbed-sparse-wide from disk (its pack), one unseen ShareGPT prompt x 64 tokens, 2 threads.
set -euo pipefail
cd "$(dirname "$0")/.."
base=${1:?usage: scripts/checkout_ab.sh BASE_REV [POLICY] [ROUNDS] [RESIDENCY]}
policy=${2:-xl+gate}; rounds=${3:-2}; residency=${4:-0.25}
tree=$(mktemp -d)
git worktree add --detach "$tree" "$base" >/dev/null
trap 'git worktree remove --force "$tree"' EXIT
for i in $(seq 1 "$rounds"); do
  for side in A B; do
    src=$([ "$side" = A ] && echo "$tree/src" || echo "$PWD/src")
    out=$(PYTHONPATH="$src" .venv/bin/python -m moe_offload.cli generate --model testbed-sparse-wide \
          --residency "$residency" --policy "$policy" --host-store disk --sharegpt 1 --sharegpt-offset 600 \
          --max-new-tokens 64 --threads 2 --json 2>/dev/null)
    OUT=$out SIDE=$side POLICY=$policy .venv/bin/python - <<'PY'
import json, os
s = json.loads(os.environ["OUT"])["stats"]
acc = s["cpu_account"]
m, b = acc["ms_per_step"]["main"], acc["bytes_per_step"]
step = 1000 / s["decode_tokens_per_s"]
pm = m.get("predictor", {}).get("cpu", 0.0) + m.get("management", {}).get("cpu", 0.0)  # lru times no predictor
used, wasted = b["prefetched_used"] / 1e6, b["prefetched_wasted"] / 1e6
pre = sum(r.get("prefetch_reads", {}).get("cpu", 0.0) for r in acc["ms_per_step"].values())
print(f"{os.environ['SIDE']} {os.environ['POLICY']}: {s['decode_tokens_per_s']:.2f} tok/s, {step:.1f} ms per step, "
      f"predictor + management {pm:.2f} ms ({pm / step:.1%}), stall {m['stall']['wall']:.1f} ms, "
      f"hit rate {s['hit_rate']:.4f}, prefetched MB used / wasted {used:.2f} / {wasted:.2f}, "
      f"prefetch reads' CPU {pre:.1f} ms")
PY
  done
done
