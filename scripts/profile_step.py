#!/usr/bin/env python3
"""Where a decode step's time goes, operator by operator (issue 46): torch.profiler over the decode steps of one
request on a built-in or local model, FullLoad or offloaded at residency 1.0, eager.

    python scripts/profile_step.py [MODEL] [full|offloaded] [THREADS] [--torch]

MODEL defaults to testbed-sparse; ``--torch`` runs without the native kernels (MOE_OFFLOAD_KERNELS=torch). Prints the
decode speed of a 32-token run and the operators of a 16-token run by self CPU time (the profiler adds its own
overhead; compare rows, not totals, with the unprofiled speed).
"""

import os
import sys

if "--torch" in sys.argv:
    os.environ["MOE_OFFLOAD_KERNELS"] = "torch"
import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from moe_offload.generation.generate import encode_prompt, generate_ids  # noqa: E402
from moe_offload.models.loader import load_full, load_offloaded  # noqa: E402
from moe_offload.testbed.resolve import resolve_model  # noqa: E402

args = [a for a in sys.argv[1:] if a != "--torch"]
model = args[0] if args else "testbed-sparse"
mode = args[1] if len(args) > 1 else "full"
torch.set_num_threads(int(args[2]) if len(args) > 2 else torch.get_num_threads())
path = resolve_model(model, progress=False)
lm = load_full(path) if mode == "full" else load_offloaded(path, residency=1.0, policy="lru", progress=False)
ids = encode_prompt(lm.tokenizer, "Explain how a KV cache speeds up decoding in transformers.")
generate_ids(lm, ids, 8)
new, ttft, decode_s = generate_ids(lm, ids, 33)
print(f"{model} {mode}, {torch.get_num_threads()} threads: {(len(new) - 1) / decode_s:.2f} decode tok/s")
with profile(activities=[ProfilerActivity.CPU]) as p:
    generate_ids(lm, ids, 17)
print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=20, max_name_column_width=48))
