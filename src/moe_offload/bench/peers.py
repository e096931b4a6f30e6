"""``moe-offload bench peers``: our decode step with the whole model in memory against the engines a user compares it
with first, measured side by side in one run (issue 46).

Rows, per thread count: our FullLoad (every weight in memory), our offloaded path at residency 1.0 (every expert in
a slot, the slot pool and its lookup doing their work: the cost of the runtime itself), with ``graph`` the same two
with the decode step compiled (``generate --graph``: graph mode; the cell runs the prompt twice and times the second
request, the first one compiles), transformers' own eager
``generate`` on the same checkpoint (the library we build on, as its users run it: default settings, greedy), and
llama.cpp's ``llama-completion`` on the checkpoint's GGUF (``export gguf``), when given.

Each cell is its own process, started with ``--threads N`` (llama.cpp: ``-t N``) and ``OMP_NUM_THREADS=N``; the
engines run in turn, forward in even repeats and backward in odd ones (A B C C B A ...), so a slow drift of the
machine falls on all of them alike. Decode tokens/s is counted from the first new token to the last, prefill
excluded, as each engine reports it (ours: ``generate --json``; transformers: a streamer's clock; llama.cpp: its
``eval time`` line). The table gives each cell's median over the repeats, the ratios between engines, 2 threads
over 1 per engine, and whether the tokens equal our FullLoad's (llama.cpp prints text only: not compared).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import MoeOffloadError
from .disk import llama_command
from .disk_measure import parse_llama_decode

FULL = "ours: FullLoad"
OFFLOADED = "ours: offloaded, residency 1.0"
FULL_GRAPH = "ours: FullLoad, compiled step"
OFFLOADED_GRAPH = "ours: offloaded, compiled step, residency 1.0"
HF = "transformers generate (eager)"
LLAMA = "llama.cpp"

# transformers' own generate, timed by a streamer: put() is called with the prompt, then with each new token.
_HF_SCRIPT = r"""
import json, sys, time, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.utils import logging
from moe_offload.generation.generate import encode_prompt
logging.set_verbosity_error()
d, prompt, n, threads = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
torch.set_num_threads(threads)
tok = AutoTokenizer.from_pretrained(d)
model = AutoModelForCausalLM.from_pretrained(d, dtype="auto").eval()
ids = torch.tensor([encode_prompt(tok, prompt)])
class Clock:
    def __init__(self): self.times = []
    def put(self, value): self.times.append(time.perf_counter())
    def end(self): pass
clock = Clock()
with torch.inference_mode():
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                         streamer=clock)
new = out[0, ids.shape[1]:].tolist()
t = clock.times[1:]
print(json.dumps({"decode_tokens_per_s": (len(t) - 1) / (t[-1] - t[0]) if len(t) > 1 else 0.0, "token_ids": new}))
"""


@dataclass
class PeerBench:
    """What one ``bench peers`` run compares (module docstring).

    Attributes:
        model_dir: the checkpoint; prompt: the user turn (each engine applies the chat template; llama.cpp is
            given ``llama_prompt``, the templated text).
        max_new_tokens: greedy tokens per cell; threads: the thread counts measured; repeats: runs per cell.
        llama_bin, gguf: llama.cpp's ``llama-completion`` and the checkpoint as GGUF (None: no llama.cpp row).
        transformers: include transformers' generate; graph: include our compiled-step rows; timeout_s: seconds
            a cell may run.
    """

    model_dir: Path
    prompt: str
    max_new_tokens: int = 64
    threads: tuple[int, ...] = (1, 2)
    repeats: int = 2
    llama_bin: Path | None = None
    gguf: Path | None = None
    llama_prompt: str | None = None
    transformers: bool = True
    graph: bool = False
    timeout_s: float = 900.0
    cells: dict = field(default_factory=dict)

    def engines(self) -> list[str]:
        """The rows, in the order of a forward repeat."""
        return ([FULL, OFFLOADED] + ([FULL_GRAPH, OFFLOADED_GRAPH] if self.graph else [])
                + ([HF] if self.transformers else []) + ([LLAMA] if self.llama_bin else []))

    def command(self, engine: str, threads: int) -> list[str]:
        """The process that measures ``engine`` at ``threads``."""
        if engine in (FULL, OFFLOADED, FULL_GRAPH, OFFLOADED_GRAPH):
            graph = engine in (FULL_GRAPH, OFFLOADED_GRAPH)
            cmd = [sys.executable, "-m", "moe_offload.cli", "generate", "--model", str(self.model_dir), "--prompt",
                   self.prompt] + (["--prompt", self.prompt, "--graph"] if graph else []) + [
                   "--max-new-tokens", str(self.max_new_tokens), "--json", "--quiet", "--threads", str(threads)]
            return cmd + (["--full-load"] if engine in (FULL, FULL_GRAPH) else ["--residency", "1.0", "--policy",
                                                                                "lru"])
        if engine == HF:
            return [sys.executable, "-c", _HF_SCRIPT, str(self.model_dir), self.prompt, str(self.max_new_tokens),
                    str(threads)]
        return llama_command(self.llama_bin, self.gguf, self.llama_prompt or self.prompt, self.max_new_tokens,
                             threads)


def _threads(n: int) -> str:
    return f"{n} thread{'s' if n != 1 else ''}"


def _run_cell(bench: PeerBench, engine: str, threads: int) -> tuple[float, list[int] | None]:
    """``(decode tok/s, token ids or None)`` of one cell.

    Raises:
        MoeOffloadError: the process failed or timed out (its last line of stderr is in the message)."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), TRANSFORMERS_VERBOSITY="error")
    try:
        r = subprocess.run(bench.command(engine, threads), capture_output=True, text=True, env=env,
                           timeout=bench.timeout_s)
    except subprocess.TimeoutExpired:
        raise MoeOffloadError(f"{engine} at {_threads(threads)} did not finish in {bench.timeout_s:.0f} s") from None
    last = (r.stderr.strip().splitlines() or [f"exit status {r.returncode}"])[-1]
    if engine == LLAMA:
        got = parse_llama_decode(r.stderr)
        if r.returncode != 0 or got is None:
            raise MoeOffloadError(f"llama.cpp failed at {_threads(threads)}: {last}")
        return got[0], None
    if r.returncode != 0:
        raise MoeOffloadError(f"{engine} failed at {_threads(threads)}: {last}")
    d = json.loads(r.stdout.strip().splitlines()[-1])
    if engine == HF:
        return d["decode_tokens_per_s"], d["token_ids"]
    if engine in (FULL_GRAPH, OFFLOADED_GRAPH):  # the second request: the first one compiled the step
        o = d["outputs"][-1]
        return (len(o["token_ids"]) - 1) / o["decode_s"] if o["decode_s"] > 0 else 0.0, o["token_ids"]
    return d["stats"]["decode_tokens_per_s"], d["outputs"][0]["token_ids"]


def run_peers(bench: PeerBench, say=print) -> dict:
    """Every (threads, engine) cell ``bench.repeats`` times in the module docstring's order.

    Returns:
        ``{"cells": {(engine, threads): [tok/s, ...]}, "tokens": {(engine, threads): ids}}``.
    Raises:
        MoeOffloadError: a cell failed.
    """
    cells: dict = {}
    tokens: dict = {}
    for rep in range(bench.repeats):
        order = [(t, e) for t in bench.threads for e in bench.engines()]
        for threads, engine in (order if rep % 2 == 0 else order[::-1]):
            rate, ids = _run_cell(bench, engine, threads)
            cells.setdefault((engine, threads), []).append(rate)
            if ids is not None:
                tokens[(engine, threads)] = ids
            say(f"  {engine} at {_threads(threads)}: {rate:.2f} tok/s")
    return {"cells": cells, "tokens": tokens}


def _same_tokens(tokens: dict, engine: str, threads: int) -> str:
    """Whether ``engine``'s tokens equal its reference's: the compiled offloaded row against the compiled FullLoad
    (inductor's generated kernels round differently from the eager operators), every other row against FullLoad."""
    ref_engine = FULL_GRAPH if engine == OFFLOADED_GRAPH else FULL
    ids, ref = tokens.get((engine, threads)), tokens.get((ref_engine, threads))
    if engine in (FULL, FULL_GRAPH) or ids is None or ref is None:
        if engine == FULL_GRAPH and ids is not None and tokens.get((FULL, threads)) is not None:
            return "reference (compiled)" + ("; same as eager" if ids == tokens[(FULL, threads)] else "")
        return "reference" if engine in (FULL, FULL_GRAPH) else "-"
    if ids == ref:
        return f"same ({len(ids)})"
    first = next((i for i, (a, b) in enumerate(zip(ids, ref)) if a != b), min(len(ids), len(ref)))
    return f"differ from token {first}"


def markdown(bench: PeerBench, result: dict) -> str:
    """The results table: per thread count and engine, the median tok/s (and every run), our FullLoad over each
    peer (and our compiled FullLoad over each, with ``graph``), the engine's 2-thread (most threads) over 1-thread
    ratio, and the tokens against our FullLoad's."""
    med = {key: statistics.median(v) for key, v in result["cells"].items()}
    lo, hi = min(bench.threads), max(bench.threads)
    refs = [FULL] + ([FULL_GRAPH] if bench.graph else [])
    heads = " | ".join("FullLoad / this" if r == FULL else "compiled FullLoad / this" for r in refs)
    lines = [f"model {bench.model_dir.name}, {bench.max_new_tokens} new tokens, greedy, {bench.repeats} runs per cell "
             "(median; every run in brackets)", "",
             f"| engine | threads | decode tok/s | {heads} | {hi} / {lo} threads | tokens vs FullLoad |",
             "|---|---:|---:|" + "---:|" * len(refs) + "---:|---|"]
    for threads in bench.threads:
        for engine in bench.engines():
            runs = result["cells"][(engine, threads)]
            mine = med[(engine, threads)]
            ratios = " | ".join(f"{med[(r, threads)] / mine:.2f}x" if mine > 0 else "nan" for r in refs)
            scale = (f"{med[(engine, hi)] / med[(engine, lo)]:.2f}x" if hi != lo and med[(engine, lo)] > 0 else "-")
            lines.append(f"| {engine} | {threads} | {mine:.2f} [{', '.join(f'{r:.1f}' for r in runs)}] | "
                         f"{ratios} | {scale} | {_same_tokens(result['tokens'], engine, threads)} |")
    return "\n".join(lines)
