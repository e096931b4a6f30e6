"""Continuous batching: several sequences decode together through one slot pool (issue 18).

``BatchDecoder`` keeps a decode batch of at most ``max_batch`` sequences:

- ``admit(seq)`` prefills one sequence alone (batch 1: the very forward pass and token choice of
  ``generate.generate_ids``, so its first token is the one it gets alone) and adds its KV cache as a new row of
  the batch cache (``runtime.batch_cache.BatchCache``: rows left-padded to one length); ``admit_many(seqs)``
  prefills several waiting sequences in one forward pass (left-padded prompts; ``prefill_group`` bounds its
  padded tokens), so a burst of new requests gets its first tokens sooner;
- ``step()`` runs one decode forward pass over every row (``input_ids [B, 1]``, each row's own position, a
  padding mask when rows differ in length): each MoE layer sees the ``B`` tokens of the batch, so the engine plans
  the union of their experts through the one slot table (rounds when the union exceeds the pool) and runs one
  grouped GEMM per projection over all of them; every row then picks its token with its own settings and
  generator (``sampling.pick``: greedy, or temperature + top-k + top-p with its own seed);
- ``drop(seqs)`` removes finished or cancelled sequences between steps (their KV rows are freed); the others go on.

The caller (``serve.batch_worker``, ``generate_batch_ids``) decides when to admit: prefills are admitted between
decode steps. ``BatchStats`` counts decode steps, tokens, distinct experts per MoE layer and hits/misses per batch
size. Why not transformers' ``ContinuousBatchingManager``: docs/architecture.md, "Continuous batching".
"""

from __future__ import annotations

import collections
import inspect
from dataclasses import dataclass, field

import torch

from .generate import eos_ids, token_budget
from .sampling import pick
from ..models.loader import LoadedModel
from ..runtime.batch_cache import BatchCache, unsupported_reason
from ..common.seeds import make_generator


@dataclass
class Sequence:
    """One request in the batch: its prompt, settings and the tokens generated so far.

    Attributes:
        request: request number (the engine's ``begin_step(request, 0)`` at its prefill).
        prompt_ids: the encoded prompt. max_new_tokens: most tokens to generate.
        temperature / top_p / seed / top_k: sampling (temperature 0: greedy; top_k 0: off); see ``sampling.pick``.
        new: generated ids (the last one is not yet in the KV cache). logits: with ``keep_logits``, the float32
        ``[V]`` logits each token was chosen from. budget: set at admission, ``max_new_tokens`` cut to the model's
        position limit (``generate.token_budget``).
    """

    request: int
    prompt_ids: list[int]
    max_new_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    top_k: int = 0
    new: list[int] = field(default_factory=list)
    logits: list = field(default_factory=list)
    gen: object = None
    budget: int | None = None


@dataclass
class BatchStats:
    """Per batch size B (sequences in a decode step): ``steps[B]`` decode steps, ``tokens[B]`` tokens they made,
    ``distinct[B]`` distinct experts summed over their MoE layer executions, ``layer_calls[B]`` those executions,
    ``hits[B]`` / ``misses[B]`` the engine's counters over them; ``prefills`` sequences prefilled,
    ``prefill_passes[P]`` prefill forward passes of P sequences."""

    steps: collections.Counter = field(default_factory=collections.Counter)
    tokens: collections.Counter = field(default_factory=collections.Counter)
    distinct: collections.Counter = field(default_factory=collections.Counter)
    layer_calls: collections.Counter = field(default_factory=collections.Counter)
    hits: collections.Counter = field(default_factory=collections.Counter)
    misses: collections.Counter = field(default_factory=collections.Counter)
    prefills: int = 0
    prefill_passes: collections.Counter = field(default_factory=collections.Counter)

    def as_dict(self) -> dict:
        """Per batch size (as string keys, ascending): steps, tokens, distinct experts per layer per step (mean),
        decode hit rate; for ``/v1/stats``."""
        out = {}
        for b in sorted(self.steps):
            seen = self.hits[b] + self.misses[b]
            out[str(b)] = {"steps": self.steps[b], "tokens": self.tokens[b],
                           "distinct_experts_per_layer": self.distinct[b] / max(1, self.layer_calls[b]),
                           "hit_rate": self.hits[b] / seen if seen else None}
        return out


class BatchDecoder:
    """A continuous decode batch over one offloaded (or fully loaded) model; see the module docstring.

    Args:
        lm: the loaded model (autoregressive; its cache must be a ``DynamicCache`` of full-attention layers).
        max_batch: most sequences decoding at once (>= 1).
        keep_logits: keep every chosen token's logits on its ``Sequence`` (tests of near-tie flips).
    Raises:
        ValueError: ``max_batch < 1``.
    """

    def __init__(self, lm: LoadedModel, max_batch: int, keep_logits: bool = False):
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self.lm = lm
        self.max_batch = max_batch
        self.keep_logits = keep_logits
        self.eos = eos_ids(lm)
        params = inspect.signature(lm.model.forward).parameters
        self.cache_kw = "cache" if "cache" in params else "past_key_values"
        self.keep_last = "logits_to_keep" in params
        self.kv = BatchCache()
        # a per-sequence predictor feed (predictor.batch_feed.BatchForecastFeed) among the engine's observers
        observers = lm.engine.observers if lm.engine is not None else ()
        self.feed = next((o for o in observers if hasattr(o, "begin_pass")), None)
        self.seqs: list[Sequence] = []
        self.stats = BatchStats()
        self.decode_steps = 0

    @property
    def free(self) -> int:
        """Rows that can still be admitted."""
        return self.max_batch - len(self.seqs)

    def done(self, seq: Sequence) -> bool:
        """``seq`` made its last token (EOS, ``max_new_tokens`` or the model's position limit)."""
        budget = seq.max_new_tokens if seq.budget is None else seq.budget
        return bool(seq.new) and (seq.new[-1] in self.eos or len(seq.new) >= budget)

    def _choose(self, seq: Sequence, logits: torch.Tensor) -> int:
        """Token of ``seq`` from its ``logits [1, V]`` with its own settings and generator."""
        tok = int(pick(logits, seq.temperature, seq.top_p, seq.gen, seq.top_k))
        if self.keep_logits:
            seq.logits.append(logits[0].float().cpu())
        seq.new.append(tok)
        return tok

    def admit(self, seq: Sequence) -> int:
        """Prefill ``seq`` alone (``generate``'s very prefill) and add it to the batch; returns its first token.

        Raises:
            ValueError: the batch is full, or the model's cache cannot be batched (``unsupported_reason``).
        """
        return self.admit_many([seq])[0]

    @torch.no_grad()
    def admit_many(self, seqs: list[Sequence]) -> list[int]:
        """Prefill ``seqs`` in one forward pass and add them to the batch; returns their first tokens (in order).

        One sequence runs ``generate``'s prefill exactly. Several are left-padded to the longest prompt
        (``input_ids [P, L]`` int64, a ``[P, L]`` padding mask, each row's own ``position_ids``; only the last
        position's logits are computed when the model takes ``logits_to_keep``); their padding columns of the KV
        cache are zeroed before the rows join the batch cache. Each MoE layer sees the ``P x L`` tokens at once:
        the union of their experts, one grouped GEMM per projection. The caller bounds ``P x L`` (activations grow
        with it; ``serve.batch_worker`` keeps it within the memory plan's prefill).

        Raises:
            ValueError: ``seqs`` is empty or does not fit the free rows, or the model's cache cannot be batched.
            MoeOffloadError: a prompt leaves no room for a new token within the model's position limit (nothing is
                admitted).
        """
        if not seqs or len(seqs) > self.free:
            raise ValueError(f"cannot admit {len(seqs)} sequences into {self.free} free rows "
                             f"(max batch {self.max_batch})")
        lm, eng = self.lm, self.lm.engine
        budgets = [token_budget(lm, len(s.prompt_ids), s.max_new_tokens) for s in seqs]
        for s, b in zip(seqs, budgets):
            s.budget = b
        for s in seqs:
            s.gen = make_generator(s.seed)
        if eng is not None:
            eng.begin_step(seqs[0].request, 0)
        ids, kw, pads = self._prefill_inputs(seqs)
        if self.feed is not None:
            width = ids.shape[1]
            self.feed.begin_pass([(s.request, 0, b * width + p, width - p) for b, (s, p) in enumerate(zip(seqs, pads))])
        out = lm.model(input_ids=ids, use_cache=True, **kw)
        logits = out.logits[:, -1]
        cache = out.get(self.cache_kw)
        del out
        toks = [self._choose(s, logits[i:i + 1]) for i, s in enumerate(seqs)]
        if any(pads):
            for layer in cache.layers:
                for b, p in enumerate(pads):
                    layer.keys[b, :, :p] = 0
                    layer.values[b, :, :p] = 0
        self.kv.merge(cache, pads)
        self.seqs += seqs
        self.stats.prefills += len(seqs)
        self.stats.prefill_passes[len(seqs)] += 1
        return toks

    def _prefill_inputs(self, seqs: list[Sequence]) -> tuple[torch.Tensor, dict, list[int]]:
        """``(input_ids [P, L], forward kwargs, left pads)`` of a prefill of ``seqs`` (see ``admit_many``)."""
        dev = self.lm.device
        if len(seqs) == 1:
            return torch.tensor([seqs[0].prompt_ids], dtype=torch.long, device=dev), {}, [0]
        width = max(len(s.prompt_ids) for s in seqs)
        pads = [width - len(s.prompt_ids) for s in seqs]
        ids = torch.tensor([[s.prompt_ids[0]] * p + s.prompt_ids for s, p in zip(seqs, pads)], dtype=torch.long,
                           device=dev)
        mask = (torch.arange(width, device=dev).unsqueeze(0) >= torch.tensor(pads, device=dev).unsqueeze(1)).long()
        kw = {"attention_mask": mask, "position_ids": (mask.cumsum(-1) - 1).clamp(min=0)}
        if self.keep_last:
            kw["logits_to_keep"] = 1
        return ids, kw, pads

    @torch.no_grad()
    def step(self) -> list[tuple[Sequence, int]]:
        """One decode step of every sequence in the batch; returns ``(sequence, new token)`` pairs in row order
        (empty when the batch is empty). Finished sequences stay until ``drop``."""
        if not self.seqs:
            return []
        lm, eng, dev = self.lm, self.lm.engine, self.lm.device
        b = len(self.seqs)
        self.decode_steps += 1
        before = (eng.stats.hits, eng.stats.misses, eng.stats.layer_calls) if eng is not None else None
        if eng is not None:
            eng.begin_step(self.seqs[0].request, self.decode_steps)
        ids = torch.tensor([[s.new[-1]] for s in self.seqs], dtype=torch.long, device=dev)
        if self.feed is not None:
            self.feed.begin_pass([(s.request, len(s.new), b, 1) for b, s in enumerate(self.seqs)])
        kw = {self.cache_kw: self.kv.cache}
        mask = self.kv.attention_mask(dev)
        if mask is not None:
            kw |= {"attention_mask": mask, "position_ids": self.kv.positions(dev)}
        out = lm.model(input_ids=ids, use_cache=True, **kw)
        self.kv.cache = out.get(self.cache_kw)
        logits = out.logits[:, -1]
        del out
        made = [(s, self._choose(s, logits[i:i + 1])) for i, s in enumerate(self.seqs)]
        st = self.stats
        st.steps[b] += 1
        st.tokens[b] += b
        if before is not None:
            h, m, c = eng.stats.hits - before[0], eng.stats.misses - before[1], eng.stats.layer_calls - before[2]
            st.hits[b] += h
            st.misses[b] += m
            st.distinct[b] += h + m
            st.layer_calls[b] += c
        return made

    def drop(self, seqs) -> None:
        """Remove ``seqs`` from the batch (finished, cancelled); their KV rows are freed at once."""
        gone = {id(s) for s in seqs}
        keep = [i for i, s in enumerate(self.seqs) if id(s) not in gone]
        if len(keep) == len(self.seqs):
            return
        self.kv.select(keep)
        if self.feed is not None:
            self.feed.forget([s.request for s in self.seqs if id(s) in gone])
        self.seqs = [self.seqs[i] for i in keep]
        if not self.seqs and self.lm.engine is not None:
            self.lm.engine.end_step()


def batch_reason(lm: LoadedModel) -> str | None:
    """Why ``lm`` cannot decode in a batch (a diffusion model; a cache that is not full-attention
    ``DynamicCache`` layers, checked on a two-token prefill), or None when it can."""
    if lm.arch.diffusion:
        return "block-diffusion models are served batch 1 (each request's diffusion steps run alone)"
    from transformers.cache_utils import DynamicCache

    try:
        cache = DynamicCache(config=lm.model.config)
    except Exception as e:  # noqa: BLE001 - a config DynamicCache cannot describe
        return f"its cache cannot be built from the config ({e.__class__.__name__})"
    why = unsupported_reason(cache)
    return None if why is None else f"{lm.arch.name}: {why}"


def prefill_group(lengths: list[int], free: int, max_tokens: int | None) -> int:
    """How many of the waiting prompts (FIFO; ``lengths`` their token counts, oldest first) one prefill pass takes:
    the longest prefix of at most ``free`` prompts whose padded size (count x longest) is at most ``max_tokens``;
    at least one when any waits and a row is free (a prompt longer than ``max_tokens`` goes alone). ``max_tokens``
    None: one prompt per pass."""
    n, width = 0, 0
    for length in lengths[:free]:
        width = max(width, length)
        if n and (max_tokens is None or (n + 1) * width > max_tokens):
            break
        n += 1
    return n


def generate_batch_ids(lm: LoadedModel, prompts: list[list[int]], max_new_tokens: int, max_batch: int, *,
                       admit_per_step: int | None = None, prefill_tokens: int | None = None,
                       keep_logits: bool = False) -> list[Sequence]:
    """Greedy continuous batching over ``prompts`` in FIFO order: before each decode step, admit waiting prompts
    into free rows (at most ``admit_per_step`` per step; None: as many as fit), several per prefill pass up to
    ``prefill_tokens`` padded tokens (``prefill_group``; None: each alone); finished sequences leave after the
    step that made their last token. Deterministic: the same prompts and settings give the same batch composition
    at every step (tests compare residencies on it).

    Returns:
        the ``Sequence`` of each prompt, in prompt order (``new``: generated ids, EOS included; at most its
        ``budget``: ``max_new_tokens`` cut to the model's position limit).
    Raises:
        MoeOffloadError: a prompt leaves no room for a new token within the model's position limit.
    """
    for p in prompts:  # every prompt fits the position limit, before any work
        token_budget(lm, len(p), max_new_tokens)
    dec = BatchDecoder(lm, max_batch, keep_logits=keep_logits)
    seqs = [Sequence(i, list(p), max_new_tokens) for i, p in enumerate(prompts)]
    waiting = collections.deque(seqs)
    while waiting or dec.seqs:
        room = dec.free if admit_per_step is None else min(dec.free, admit_per_step)
        while waiting and room:
            n = prefill_group([len(s.prompt_ids) for s in waiting], room, prefill_tokens)
            dec.admit_many([waiting.popleft() for _ in range(n)])
            room -= n
        dec.drop([s for s in dec.seqs if dec.done(s)])
        dec.step()
        dec.drop([s for s in dec.seqs if dec.done(s)])
    return seqs
