#!/usr/bin/env python3
"""torch's precompile of the decode step, saved by one process and loaded by another (issue 46, "tried"): whether
the dynamo tracing of a warm compile can be skipped.

    python scripts/precompile_try.py save [MODEL]    # compile with .aot_compile, save to /tmp
    python scripts/precompile_try.py load [MODEL]    # in a new process: load, then decode with it

Saving needs the guards torch cannot serialise filtered out, tracing under ``no_grad`` and an initialised static
cache (a prefill first). The script prints the outcome or the error that ended it.
"""

import sys
import time

import torch
from torch._dynamo.guards import CheckFunctionManager

from moe_offload.generation.generate import encode_prompt
from moe_offload.graph.decode import GraphDecoder
from moe_offload.models.loader import load_full
from moe_offload.testbed.resolve import resolve_model
from moe_offload.testbed.sharegpt import human_turns

mode = sys.argv[1] if len(sys.argv) > 1 else "save"
model = sys.argv[2] if len(sys.argv) > 2 else "testbed"
torch.set_num_threads(2)
lm = load_full(resolve_model(model, progress=False))
dec = GraphDecoder(lm)
ids = encode_prompt(lm.tokenizer, human_turns(1, offset=600)[0])
path = f"/tmp/moe-offload-precompiled-{model}.bin"


def step(m, input_ids, position_ids, cache):
    return m(input_ids=input_ids, position_ids=position_ids, cache=cache, use_cache=True).logits[:, -1]


def serialisable(entries):
    keep = torch.compiler.skip_guard_on_all_nn_modules_unsafe(entries)
    return [k and not (g.is_global or g.guard_type in CheckFunctionManager.UNSUPPORTED_SERIALIZATION_GUARD_TYPES)
            for k, g in zip(keep, entries)]


cache = dec._static_cache(len(ids) + 40)
with torch.no_grad():
    lm.model(input_ids=torch.tensor([ids]), cache=cache, use_cache=True)  # initialises the static cache's layers
t0 = time.perf_counter()
try:
    if mode == "save":
        compiled = torch.compile(step, fullgraph=True, options={"guard_filter_fn": serialisable})
        example = (lm.model, torch.zeros(1, 1, dtype=torch.long), torch.tensor([[len(ids)]]), cache)
        with torch.no_grad():
            fn = compiled.aot_compile((example, {}))
        fn.save_compiled_function(path)
        print(f"compiled and saved to {path} in {time.perf_counter() - t0:.1f} s")
    else:
        with open(path, "rb") as fh:
            fn = torch.compiler.load_compiled_function(fh)
        print(f"loaded in {time.perf_counter() - t0:.1f} s")
        cache.reset()
        dec.step = lambda a, b, c: fn(lm.model, a, b, c)
        new, _, d = dec.generate_ids(ids, 33)
        print(f"decoded {len(new)} tokens, {(len(new) - 1) / d:.2f} tok/s")
except Exception as e:  # noqa: BLE001 - the outcome is what the script reports
    print(f"{mode} stopped after {time.perf_counter() - t0:.1f} s: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
