#!/usr/bin/env bash
# GPU check: lossless runs on CUDA for every policy (lru, lfu, seqmoe*, reactive, tide) and every checkpoint format
# (bf16/fp32, sharded, FP8 Qwen3 and DeepSeek-V3 layouts, MXFP4) and the disk tier (--host-store disk: lru, and xl+gate
# with its prefetches on the copy worker's side stream), bench decode (FullLoad, residency 1.0/0.45/0.25) and bench
# link, written to one markdown file (default gpu-check.md). Under 8 minutes on one GPU.
#   scripts/gpu-check.sh [--out FILE]            on a machine with CUDA (after MOE_OFFLOAD_TORCH=torch scripts/setup.sh,
#                                                or with torch, transformers and this package importable)
#   scripts/gpu-check.sh --dry-run [--out FILE]  the same checks, smaller, on the CPU (tests the script)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=python3
[ -x .venv/bin/python ] && PY=.venv/bin/python
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" TRANSFORMERS_VERBOSITY=error PYTHONUNBUFFERED=1
exec "$PY" -m moe_offload.cli bench gpu-check "$@"
