#!/usr/bin/env python3
"""Eager FullLoad's decode step with RMSNorm on the native kernel against torch's operators (issue 46,
runtime/fast_norm.py), in one process.

    python scripts/rms_norm_ab.py [MODEL] [THREADS]

Loads MODEL (default testbed-sparse-wide) as FullLoad, then alternates the RMSNorm modules between the kernel's class
and their own four times each (ABBA order); each time the decode step is the time of 49 new tokens minus that of 17
(the prefill cancels) over 32 steps, with a short prompt. Prints every run and the best of each, in ms per step, and
their ratio.
"""

import sys
import time

import torch

from moe_offload.generation.generate import encode_prompt, generate_ids
from moe_offload.models.loader import load_full
from moe_offload.testbed.resolve import resolve_model

model = sys.argv[1] if len(sys.argv) > 1 else "testbed-sparse-wide"
torch.set_num_threads(int(sys.argv[2]) if len(sys.argv) > 2 else torch.get_num_threads())
lm = load_full(resolve_model(model, progress=False))
ids = encode_prompt(lm.tokenizer, "Explain how a KV cache speeds up decoding in transformers.")
mods = [m for m in lm.model.modules() if hasattr(m, "_moe_kernel") and hasattr(m, "variance_epsilon")]
if not mods:
    sys.exit("no RMSNorm runs the kernel here (the native kernels are not built, or the model's norm is not standard)")
fast_cls = type(mods[0])
classes = {"kernel": fast_cls, "torch": fast_cls.__mro__[1]}


def step_ms() -> float:
    t = time.perf_counter()
    generate_ids(lm, ids, 49)
    long = time.perf_counter() - t
    t = time.perf_counter()
    generate_ids(lm, ids, 17)
    return (long - (time.perf_counter() - t)) / 32 * 1e3


step_ms()  # warm-up
runs = {"kernel": [], "torch": []}
for rep in range(4):
    for name in ("kernel", "torch") if rep % 2 == 0 else ("torch", "kernel"):
        for m in mods:
            m.__class__ = classes[name]
        runs[name].append(step_ms())
for name, v in runs.items():
    print(f"{model} {torch.get_num_threads()} threads, RMSNorm on {name:6s}: " + " ".join(f"{x:.2f}" for x in v)
          + f"  best {min(v):.2f} ms per step")
print(f"kernel / torch: {min(runs['kernel']) / min(runs['torch']):.3f}")
