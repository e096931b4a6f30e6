"""Autoregressive generation with prefill/decode phases and offloading stats (batch 1, one request at a time).

The loop is explicit (rather than ``model.generate``) so prefill and decode are timed separately (TTFT, decode
tokens/s) and so later issues can hook per-step decisions (prediction, prefetch) between decode steps.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Callable

import torch

from ..models.gen_limits import eos_token_ids, new_token_budget
from ..models.loader import LoadedModel
from ..runtime.emulated_clock import now
from ..runtime.engine import EngineStats
from .sampling import GREEDY_TEMPERATURE  # noqa: F401 (re-exported: the servers and tests read it here)
from .sampling import pick
from ..common.seeds import make_generator


@dataclass
class Output:
    """One request's result: ``token_ids`` are the generated ids only; times in seconds. ``finish_reason``: "stop"
    (an EOS id ended it) or "length" (``max_new_tokens``, or the model's position limit: then ``position_limit``
    holds that limit, else None)."""

    prompt: str
    text: str
    token_ids: list[int]
    prompt_tokens: int
    ttft_s: float
    decode_s: float
    finish_reason: str = "length"
    position_limit: int | None = None


@dataclass
class RunStats:
    """Totals over a run of requests; ``offload`` holds the engine's counters (hits, misses, bytes loaded...;
    all zero for FullLoad). Times in seconds."""

    offload: EngineStats = field(default_factory=EngineStats)
    prefill_s: float = 0.0
    decode_s: float = 0.0
    decode_tokens: int = 0
    prompt_tokens: int = 0
    requests: int = 0
    ttft_s: list[float] = field(default_factory=list)

    @property
    def decode_tokens_per_s(self) -> float:
        return self.decode_tokens / self.decode_s if self.decode_s > 0 else 0.0

    def add_request(self, prompt_tokens: int, ttft_s: float, decode_s: float, decode_tokens: int) -> None:
        """Count one finished request (seconds; ``decode_tokens`` after the first token / first block)."""
        self.requests += 1
        self.prompt_tokens += prompt_tokens
        self.prefill_s += ttft_s
        self.ttft_s.append(ttft_s)
        self.decode_s += decode_s
        self.decode_tokens += decode_tokens


def encode_prompt(tokenizer, prompt: str) -> list[int]:
    """Token ids of ``prompt``, wrapped in the tokenizer's chat template when it has one."""
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                            tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return list(ids)
    return tokenizer(prompt)["input_ids"]


def eos_ids(lm: LoadedModel) -> frozenset[int]:
    """The ids that end ``lm``'s generations, the one resolution every loop uses (``models.gen_limits``): the
    loader's ``lm.eos_ids``, else resolved from the model's generation config, config and tokenizer."""
    if lm.eos_ids is not None:
        return lm.eos_ids
    return eos_token_ids(getattr(lm.model, "generation_config", None), getattr(lm.model, "config", None),
                         lm.tokenizer)


def token_budget(lm: LoadedModel, prompt_len: int, max_new_tokens: int, block_length: int = 1) -> int:
    """``max_new_tokens`` cut to the room the model's position limit leaves after a ``prompt_len``-token prompt
    (``models.gen_limits.new_token_budget``; ``block_length`` > 1 for block diffusion).

    Raises:
        MoeOffloadError: the prompt leaves no room for a new token."""
    return new_token_budget(lm.max_positions, prompt_len, max_new_tokens, block_length)


def finish_reason(lm: LoadedModel, new: list[int], prompt_len: int, max_new_tokens: int,
                  block_length: int = 1) -> tuple[str, int | None]:
    """Why a generation of ``new`` ids (EOS included) after a ``prompt_len``-token prompt ended:
    ``("stop", None)`` at an EOS id, ``("length", limit)`` when the model's position limit ``limit`` cut it short
    of ``max_new_tokens``, else ``("length", None)``."""
    if new and new[-1] in eos_ids(lm):
        return "stop", None
    budget = token_budget(lm, prompt_len, max_new_tokens, block_length)
    return "length", lm.max_positions if budget < max_new_tokens and len(new) >= budget else None


def sync_device(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def last_position_only(model) -> dict:
    """The keyword arguments that make ``model``'s forward run its LM head on the last position only (a prefill
    needs no other logits: on a 518-token prompt the full head is a [518, V] GEMM); empty when the model's forward
    takes no ``logits_to_keep``."""
    return {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}


def generate_ids(lm: LoadedModel, prompt_ids: list[int], max_new_tokens: int, *, temperature: float = 0.0,
                 top_p: float = 1.0, top_k: int = 0, seed: int | None = None, request: int = 0,
                 on_step: Callable[[int], None] | None = None,
                 on_token: Callable[[int], bool | None] | None = None) -> tuple[list[int], float, float]:
    """Generate up to ``max_new_tokens`` after ``prompt_ids``; stops at an EOS id (included in the output) or at
    the model's position limit (prompt + new tokens <= ``max_position_embeddings``: ``token_budget``).

    Before each forward pass the engine's slot table is told the step (0 = prefill, i = i-th decode step of
    request number ``request``); after it, ``on_step(step)`` is called (e.g. by a trace recorder).
    ``on_token(token_id)`` is called with every new token as soon as it is chosen (e.g. to stream it); when it
    returns True, generation stops after that token (a stop sequence matched, the client went away).
    ``temperature`` / ``top_p`` / ``top_k``: the shared sampler's settings (``moe_offload.generation.sampling``: a temperature
    below ``GREEDY_TEMPERATURE``, 0 included, is greedy; ``top_p`` keeps at least the most probable token; ``top_k``
    0: off, 1: greedy). ``seed``: see ``moe_offload.common.seeds`` (an integer in [0, 2**32 - 1]; None: unseeded).

    Returns:
        ``(new_ids, ttft_s, decode_s)``: generated ids, seconds from start to the first token (prefill), seconds
        for the remaining tokens (decode).

    Raises:
        MoeOffloadError: the prompt leaves no room for a new token within the model's position limit.
        ValueError: a NaN or infinite ``temperature`` or ``top_p``.
    """
    max_new_tokens = token_budget(lm, len(prompt_ids), max_new_tokens)
    dev = lm.device
    params = inspect.signature(lm.model.forward).parameters
    cache_kw = "cache" if "cache" in params else "past_key_values"
    last_only = last_position_only(lm.model)
    gen = make_generator(seed)
    eos = eos_ids(lm)
    engine = lm.engine

    def forward(step: int, **kw):
        if engine is not None:
            engine.begin_step(request, step)
        o = lm.model(use_cache=True, **kw)
        if on_step is not None:
            on_step(step)
        return o

    ids = torch.tensor([prompt_ids], dtype=torch.long, device=dev)
    t0 = now()
    out = forward(0, input_ids=ids, **last_only)
    tok = pick(out.logits[:, -1], temperature, top_p, gen, top_k)
    past = out.get(cache_kw)
    new = [int(tok)]
    sync_device(dev)
    t1 = now()
    stop = on_token is not None and bool(on_token(new[-1]))
    while not stop and len(new) < max_new_tokens and new[-1] not in eos:
        out = forward(len(new), input_ids=tok.view(1, 1), **{cache_kw: past})
        past = out.get(cache_kw)
        tok = pick(out.logits[:, -1], temperature, top_p, gen, top_k)
        new.append(int(tok))
        stop = on_token is not None and bool(on_token(new[-1]))
    sync_device(dev)
    if engine is not None and hasattr(engine, "end_step"):
        engine.end_step()
    return new, t1 - t0, now() - t1


def run_requests(lm: LoadedModel, prompts: list[str], generate_one, *, max_new_tokens: int | None = None,
                 block_length: int = 1, progress: bool = False, recorder=None) -> tuple[list[Output], RunStats]:
    """The request loop every generation mode shares: encode every prompt (chat template) and, given
    ``max_new_tokens``, check each leaves room within the model's position limit (``token_budget``, with
    ``block_length`` > 1 for block diffusion) before any work; reset the engine's counters, then for each prompt in
    turn tell ``recorder`` (if any) the request, call ``generate_one(i, prompt_ids)`` -> ``(new_ids, ttft_s,
    decode_s, decode_tokens)`` and count it; each ``Output`` gets its ``finish_reason`` (``finish_reason``); the
    engine's counters end in ``RunStats.offload``.

    Returns ``(outputs, run_stats)``.

    Raises:
        MoeOffloadError: a prompt leaves no room for a new token within the model's position limit."""
    from tqdm.auto import tqdm

    encoded = [encode_prompt(lm.tokenizer, p) for p in prompts]
    if max_new_tokens is not None:
        for pids in encoded:
            token_budget(lm, len(pids), max_new_tokens, block_length)
    stats = RunStats()
    outputs = []
    eng = lm.engine
    if eng is not None:
        eng.reset_stats()
    for i, (prompt, pids) in enumerate(tqdm(list(zip(prompts, encoded)), desc="requests", disable=not progress,
                                            leave=False)):
        if recorder is not None:
            recorder.start_request(i, pids)
        new, ttft, dec, decode_tokens = generate_one(i, pids)
        text = lm.tokenizer.decode(new, skip_special_tokens=True)
        reason = finish_reason(lm, new, len(pids), max_new_tokens, block_length) if max_new_tokens else ("length",
                                                                                                          None)
        outputs.append(Output(prompt, text, new, len(pids), ttft, dec, *reason))
        stats.add_request(len(pids), ttft, dec, decode_tokens)
    if eng is not None:
        stats.offload = eng.stats
    return outputs, stats


def run(lm: LoadedModel, prompts: list[str], max_new_tokens: int, *, temperature: float = 0.0, top_p: float = 1.0,
        top_k: int = 0, seed: int | None = None, progress: bool = False,
        recorder=None) -> tuple[list[Output], RunStats]:
    """Generate for each prompt in turn; return the outputs and the run's totals (engine stats included).

    ``temperature`` / ``top_p`` / ``top_k`` / ``seed``: see ``generate_ids``. ``recorder``: optional
    ``trace.collect.TraceRecorder`` fed every request and step."""

    def one(i, pids):
        new, ttft, dec = generate_ids(lm, pids, max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                                      seed=seed, request=i,
                                      on_step=recorder.end_step if recorder is not None else None)
        return new, ttft, dec, len(new) - 1

    return run_requests(lm, prompts, one, max_new_tokens=max_new_tokens, progress=progress, recorder=recorder)
