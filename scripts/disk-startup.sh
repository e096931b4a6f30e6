#!/usr/bin/env bash
# Time from start to the first token of `generate` with --host-store mmap and disk, alternating, the checkpoint's
# page cache dropped (posix_fadvise DONTNEED) before every run (issue 35's startup target). Usage:
#   scripts/disk-startup.sh [MODEL] [RUNS]      (default testbed-sparse, 2 runs of each)
set -euo pipefail
cd "$(dirname "$0")/.."
model=${1:-testbed-sparse}
runs=${2:-2}
py=.venv/bin/python
dir=$($py -c "from moe_offload.testbed.resolve import resolve_model; print(resolve_model('$model', progress=False))")
for i in $(seq "$runs"); do
  for store in mmap disk; do
    $py -c "import sys, pathlib; from moe_offload.runtime.page_cache import drop
[drop(f) for f in pathlib.Path(sys.argv[1]).glob('*.safetensors')]" "$dir"
    start=$($py -c "import time; print(time.time())")
    .venv/bin/moe-offload generate --model "$model" --residency 0.25 --policy lru --host-store "$store" \
      --max-new-tokens 1 --prompt "Explain KV caches" --quiet >/dev/null
    $py -c "import time, sys; print(f'{sys.argv[1]:5s} {time.time() - float(sys.argv[2]):.2f} s to the first token')" \
      "$store" "$start"
  done
done
