#!/usr/bin/env python3
"""Where the compiled decode step's compile time goes (issue 46): one request through ``GraphDecoder`` on FullLoad,
then torch's own per-phase compile times (``torch._dynamo.utils.compile_times``: dynamo's bytecode tracing, the
backend's lowering and code generation or its cache hits).

    python scripts/compile_phases.py [MODEL] [THREADS]

Run it twice: the first run fills torch's compile cache (cold), the second shows a warm compile.
"""

import sys
import time

import torch

from moe_offload.generation.generate import encode_prompt
from moe_offload.graph.decode import GraphDecoder
from moe_offload.models.loader import load_full
from moe_offload.testbed.resolve import resolve_model
from moe_offload.testbed.sharegpt import human_turns

model = sys.argv[1] if len(sys.argv) > 1 else "testbed"
torch.set_num_threads(int(sys.argv[2]) if len(sys.argv) > 2 else 2)
lm = load_full(resolve_model(model, progress=False))
dec = GraphDecoder(lm)
ids = encode_prompt(lm.tokenizer, human_turns(1, offset=600)[0])
t0 = time.perf_counter()
dec.generate_ids(ids, 3)
print(f"first request (3 tokens, compiling): {time.perf_counter() - t0:.1f} s; the compiling step: {dec.compile_s:.1f} s")
for line in torch._dynamo.utils.compile_times(repr="str").splitlines():
    if not line.startswith("pass."):  # the individual graph passes: many short lines
        print(line)
