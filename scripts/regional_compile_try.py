#!/usr/bin/env python3
"""Compiling each decoder layer on its own instead of the whole decode step (issue 46, "What is not done"): how
long the first request takes, and whether it stays within dynamo's recompile limit.

    python scripts/regional_compile_try.py [MODEL] [THREADS]

Each of the model's decoder layers gets ``nn.Module.compile(fullgraph=True)``; the step around them runs eagerly
over the same static cache as ``GraphDecoder``. transformers' layers pick their cache by a Python int and the cache
position changes every step, so this recompiles per layer and per step; the script prints the first request's time
or the error that ended it.
"""

import sys
import time

import torch

from moe_offload.generation.generate import encode_prompt
from moe_offload.graph.decode import GraphDecoder
from moe_offload.models.loader import load_full
from moe_offload.testbed.resolve import resolve_model
from moe_offload.testbed.sharegpt import human_turns

model = sys.argv[1] if len(sys.argv) > 1 else "testbed-sparse-wide"
torch.set_num_threads(int(sys.argv[2]) if len(sys.argv) > 2 else 2)
lm = load_full(resolve_model(model, progress=False))
torch._dynamo.config.recompile_limit = 64
dec = GraphDecoder(lm, backend="aot_eager")
for layer in lm.model.model.layers:
    layer.compile(fullgraph=True)
dec.step = dec._step  # the step eager, its layers compiled
ids = encode_prompt(lm.tokenizer, human_turns(1, offset=600)[0])
t0 = time.perf_counter()
try:
    dec.generate_ids(ids, 3)
    print(f"first request (3 tokens, compiling) {time.perf_counter() - t0:.1f} s")
    new, _, d = dec.generate_ids(ids, 33)
    print(f"then {(len(new) - 1) / d:.2f} decode tok/s")
except Exception as e:  # noqa: BLE001 - the outcome is what the script reports
    print(f"stopped after {time.perf_counter() - t0:.1f} s: {type(e).__name__}: {str(e).splitlines()[0][:160]}")
