#!/usr/bin/env python3
"""Where a decode step's time goes (issue 46): per module and per operator, over the decode steps of one request on
a built-in or local model, FullLoad or offloaded at residency 1.0, eager.

    python scripts/profile_step.py [MODEL] [full|offloaded] [THREADS] [--torch] [--sharegpt]

MODEL defaults to testbed-sparse; ``--torch`` runs without the native kernels (MOE_OFFLOAD_KERNELS=torch);
``--sharegpt`` uses the ShareGPT turn ``bench peers`` uses (518 tokens on the testbed's tokenizer) instead of a
short prompt. Prints the decode speed of a 33-token run; then milliseconds per decode step by module type (wall
time of each module's forward, nested modules included in their parents; the prefill subtracted); then torch's
operators by self CPU time per decode step (the native kernels are not torch operators in eager mode: their time is
in the module table only). The hooks and the profiler add their own overhead: compare rows, not totals, with the
unprofiled speed.
"""

import collections
import os
import sys
import time

if "--torch" in sys.argv:
    os.environ["MOE_OFFLOAD_KERNELS"] = "torch"
import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from moe_offload.generation.generate import encode_prompt, generate_ids  # noqa: E402
from moe_offload.models.loader import load_full, load_offloaded  # noqa: E402
from moe_offload.testbed.resolve import resolve_model  # noqa: E402
from moe_offload.testbed.sharegpt import human_turns  # noqa: E402

NEW = 33
args = [a for a in sys.argv[1:] if not a.startswith("--")]
model = args[0] if args else "testbed-sparse"
mode = args[1] if len(args) > 1 else "full"
torch.set_num_threads(int(args[2]) if len(args) > 2 else torch.get_num_threads())
path = resolve_model(model, progress=False)
lm = load_full(path) if mode == "full" else load_offloaded(path, residency=1.0, policy="lru", progress=False)
prompt = human_turns(1, offset=600)[0] if "--sharegpt" in sys.argv else \
    "Explain how a KV cache speeds up decoding in transformers."
ids = encode_prompt(lm.tokenizer, prompt)
generate_ids(lm, ids, 8)
new, ttft, decode_s = generate_ids(lm, ids, NEW)
steps = len(new) - 1
print(f"{model} {mode}, {torch.get_num_threads()} threads, {len(ids)}-token prompt: {steps / decode_s:.2f} decode "
      f"tok/s ({decode_s / steps * 1e3:.1f} ms per step)")

spent, calls, started = collections.Counter(), collections.Counter(), {}


def timed(m):
    name = "lm_head" if m is getattr(lm.model, "lm_head", None) else type(m).__name__
    if "Linear" in name:
        name += " " + "x".join(str(d) for d in m.weight.shape)
    m.register_forward_pre_hook(lambda mod, a: started.__setitem__(id(mod), time.perf_counter()))

    def done(mod, a, o):
        spent[name] += time.perf_counter() - started.pop(id(mod))
        calls[name] += 1
    m.register_forward_hook(done)


for m in lm.model.modules():
    if m is lm.model or m is getattr(lm.model, "lm_head", None) or any(
            k in type(m).__name__ for k in ("DecoderLayer", "Attention", "RMSNorm", "Experts", "Router", "Gate",
                                             "SparseMoe", "MoE", "Moe", "Linear", "Rotary")):
        timed(m)
generate_ids(lm, ids, 1)  # the prefill alone, subtracted below
prefill, prefill_calls = dict(spent), dict(calls)
spent.clear()
calls.clear()
generate_ids(lm, ids, NEW)
print(f"\n{'module':32s} {'ms/step':>8s} {'calls/step':>10s}")
for name, s in sorted(spent.items(), key=lambda kv: -kv[1]):
    print(f"{name:32s} {(s - prefill.get(name, 0)) / steps * 1e3:8.2f} "
          f"{(calls[name] - prefill_calls.get(name, 0)) / steps:10.0f}")

with profile(activities=[ProfilerActivity.CPU]) as one:
    generate_ids(lm, ids, 1)
with profile(activities=[ProfilerActivity.CPU]) as p:
    generate_ids(lm, ids, NEW)
base = {e.key: (e.self_cpu_time_total, e.count) for e in one.key_averages()}
rows = sorted(((e.key, (e.self_cpu_time_total - base.get(e.key, (0, 0))[0]) / steps,
                (e.count - base.get(e.key, (0, 0))[1]) / steps) for e in p.key_averages()), key=lambda r: -r[1])
print(f"\n{'torch operator (self CPU)':50s} {'ms/step':>8s} {'calls/step':>10s}")
for key, us, n in rows[:15]:
    print(f"{key[:50]:50s} {us / 1e3:8.3f} {n:10.0f}")
