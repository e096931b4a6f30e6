#!/usr/bin/env python3
"""Where a compiled FullLoad decode step goes (issue 46): torch's profiler over ``GraphDecoder.generate_ids``.

    python scripts/profile_compiled_step.py [MODEL] [THREADS] [--cpp-wrapper]

MODEL defaults to testbed-sparse-wide, THREADS to 1; the ShareGPT turn ``bench peers`` uses as the prompt. Prints
the unprofiled decode speed, then milliseconds and calls per decode step by operator (self CPU time; a profile of
a 1-token request subtracted from a 33-token one, so the prefill cancels). The native kernels show as
``moe_offload_native::*``; inductor's own code as the compiled graph's self time. The profiler adds its own overhead:
compare rows, not the total, with the unprofiled speed. ``--cpp-wrapper`` compiles with inductor's C++ wrapper
(``torch._inductor.config.cpp_wrapper``) instead of its Python one.
"""

import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from moe_offload.generation.generate import encode_prompt
from moe_offload.graph.decode import GraphDecoder
from moe_offload.models.loader import load_full
from moe_offload.testbed.resolve import resolve_model
from moe_offload.testbed.sharegpt import human_turns

if "--cpp-wrapper" in sys.argv:
    torch._inductor.config.cpp_wrapper = True
args = [a for a in sys.argv[1:] if not a.startswith("--")]
model = args[0] if args else "testbed-sparse-wide"
torch.set_num_threads(int(args[1]) if len(args) > 1 else 1)
lm = load_full(resolve_model(model, progress=False))
dec = GraphDecoder(lm)
ids = encode_prompt(lm.tokenizer, human_turns(1, offset=600)[0])
t0 = time.perf_counter()
dec.generate_ids(ids, 8)
print(f"{model}, {torch.get_num_threads()} threads: compile and a first request {time.perf_counter() - t0:.1f} s")
new, _, d = dec.generate_ids(ids, 33)
print(f"unprofiled: {(len(new) - 1) / d:.2f} decode tok/s, {d / (len(new) - 1) * 1e3:.2f} ms per step")


def profiled(n):
    with profile(activities=[ProfilerActivity.CPU]) as p:
        dec.generate_ids(ids, n)
    return {e.key: (e.self_cpu_time_total, e.count) for e in p.key_averages()}


long, short = profiled(33), profiled(1)
rows = sorted((((t - short.get(k, (0, 0))[0]) / 32, (c - short.get(k, (0, 0))[1]) / 32, k)
               for k, (t, c) in long.items()), reverse=True)
print(f"profiled: {sum(r[0] for r in rows) / 1e3:.2f} ms of self CPU time per decode step")
for t, c, k in rows[:15]:
    print(f"{t / 1e3:8.3f} ms {c:7.1f} calls  {k[:90]}")
