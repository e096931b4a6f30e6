"""The one sampler of every generation path (issue 34): ``generate.generate_ids``, graph mode, the batching decoder,
both servers, and the block-diffusion loop, with one set of rules at every edge of its settings:

- ``temperature < GREEDY_TEMPERATURE`` (1e-5; 0, negative, subnormal): greedy ``argmax``; never NaN (a smaller
  positive temperature would scale finite logits past the float32 range, ``inf - inf = nan``);
- ``top_k``: keep the ``top_k`` most probable tokens (0, negative or >= V: all of them; 1: greedy);
- ``top_p``: keep the smallest set of most probable tokens whose probability reaches ``top_p``; the most probable
  token is always kept, so ``top_p`` 0 (or tiny) samples only it and >= 1 keeps all;
- then draw from the kept probabilities with a ``torch.Generator`` (``moe_offload.common.seeds``).

``top_k`` applies before ``top_p`` (on the renormalised top-k probabilities), as in transformers and vLLM.

``pick`` returns the tokens (autoregressive paths); ``choose`` also returns each token's confidence (block
diffusion: the probability that decides which positions a step commits).
"""

from __future__ import annotations

import math

import torch

GREEDY_TEMPERATURE = 1e-5  # a temperature below this is greedy (argmax): dividing logits by it would overflow


def is_greedy(temperature: float, top_p: float, top_k: int = 0) -> bool:
    """Whether these settings choose the argmax without drawing: ``temperature < GREEDY_TEMPERATURE`` or
    ``top_k == 1`` (``top_p`` only takes part in the check).

    Raises:
        ValueError: a NaN or infinite ``temperature`` or ``top_p`` (callers validate them first).
    """
    if not (math.isfinite(temperature) and math.isfinite(top_p)):
        raise ValueError(f"temperature and top_p must be finite, got {temperature} and {top_p}")
    return temperature < GREEDY_TEMPERATURE or top_k == 1


def kept_probs(logits: torch.Tensor, temperature: float, top_p: float, top_k: int = 0) -> torch.Tensor:
    """The distribution a sampled (not greedy: ``is_greedy`` False) choice draws from.

    Args:
        logits: ``[N, V]``, any float dtype; temperature >= ``GREEDY_TEMPERATURE``; top_p, top_k: see the module.
    Returns:
        ``[N, V]`` float32 on ``logits.device``: ``softmax(logits / temperature)``, restricted to the top-k
        (renormalised) and then to the nucleus; the nucleus is not renormalised (``torch.multinomial`` does not need
        it; divide by the row sum for probabilities). Every row keeps at least its most probable token.
    """
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if 0 < top_k < probs.shape[-1]:
        keep = torch.zeros_like(probs, dtype=torch.bool).scatter(-1, probs.topk(top_k, dim=-1).indices, True)
        probs = probs * keep
        probs = probs / probs.sum(dim=-1, keepdim=True)
    if top_p < 1.0:
        sorted_p, idx = probs.sort(dim=-1, descending=True, stable=True)  # ties: the lower id first, as argmax
        keep = sorted_p.cumsum(-1) - sorted_p < top_p
        keep[..., 0] = True
        probs = torch.zeros_like(probs).scatter(-1, idx, sorted_p * keep)
    return probs


def _draw(probs: torch.Tensor, gen: torch.Generator | None, device: torch.device) -> torch.Tensor:
    """One token per row of ``probs [N, V]`` (non-negative, any scale) from ``gen`` (CPU; None: torch's global
    generator) -> ``[N]`` int64 on ``device``."""
    return torch.multinomial(probs.cpu(), 1, generator=gen).view(-1).to(device)


def pick(logits: torch.Tensor, temperature: float, top_p: float, gen: torch.Generator | None,
         top_k: int = 0) -> torch.Tensor:
    """Next token of each row of ``logits [N, V]`` (any float dtype) -> ``[N]`` int64 on ``logits.device``:
    ``argmax`` when ``is_greedy``, else a draw from ``kept_probs`` with ``gen`` (see the module for the rules).

    Raises:
        ValueError: a NaN or infinite ``temperature`` or ``top_p`` (callers validate them first).
    """
    if is_greedy(temperature, top_p, top_k):
        return logits.argmax(dim=-1)
    return _draw(kept_probs(logits, temperature, top_p, top_k), gen, logits.device)


def choose(logits: torch.Tensor, temperature: float, top_p: float, gen: torch.Generator | None,
           top_k: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``pick``'s decision with each token's confidence, for block diffusion.

    Args:
        logits: ``[N, V]``, any float dtype (one row per position).
    Returns:
        ``(tokens [N] int64, confidence [N] float32)``. Greedy (``is_greedy``): the argmax and its probability under
        ``softmax(logits)`` (temperature 1, no top-k / top-p: LLaDA's confidence at temperature 0). Sampled: a draw
        from ``kept_probs`` and its probability under that distribution, renormalised (a nucleus of one token:
        confidence 1).
    Raises:
        ValueError: a NaN or infinite ``temperature`` or ``top_p``.
    """
    if is_greedy(temperature, top_p, top_k):
        conf, tok = torch.softmax(logits.float(), dim=-1).max(dim=-1)
        return tok, conf
    probs = kept_probs(logits, temperature, top_p, top_k)
    tok = _draw(probs, gen, logits.device)
    conf = probs.gather(-1, tok[:, None]).view(-1)
    if top_p < 1.0:  # the nucleus is not renormalised (top-k already is)
        conf = conf / probs.sum(dim=-1)
    return tok, conf
