"""Held-out perplexity of the testbed and of its dense source (recorded in ``testbed.json``; ``docs/testbed.md``).

The evaluation is optional: a first use of a built-in testbed skips it (it would add about a minute and a half on
2 cores for a number the user did not ask for); ``moe-offload testbed build`` runs it, also on an already built
testbed that has none yet.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from moe_offload.testbed import sharegpt

EVAL_SEQ_LEN = 512
#: held-out text used for the perplexity recorded in testbed.json (characters, tokens)
EVAL_CHARS = 200_000
EVAL_TOKENS = 16_384


@torch.no_grad()
def perplexity(
    model, tokenizer, texts: Sequence[str], max_tokens: int = EVAL_TOKENS, seq_len: int = EVAL_SEQ_LEN,
    on_tokens: Callable[[int], None] | None = None,
) -> float:
    """Token-level perplexity of a causal LM on ``texts``.

    Each text is tokenised on its own (no special tokens) and cut into non-overlapping windows of
    at most ``seq_len`` tokens; within a window every token but the first is predicted from the
    previous ones. Windows are taken in order until ``max_tokens`` predicted tokens are reached.

    Args:
        model: any transformers causal LM (float32, CPU).
        texts: list of strings.
        max_tokens: cap on the number of predicted tokens.
        on_tokens: called with the number of tokens each window predicted (a progress bar).

    Returns:
        ``exp(mean negative log-likelihood)`` in nats per token (a float >= 1).
    """
    model.eval()
    nll = 0.0
    count = 0
    for text in texts:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        for s in range(0, len(ids), seq_len):
            window = ids[s : s + seq_len]
            window = window[: max_tokens - count + 1]
            if len(window) < 2:
                continue
            inp = torch.tensor([window], dtype=torch.long)
            logits = model(input_ids=inp, use_cache=False).logits[0, :-1].float()
            nll += F.cross_entropy(logits, inp[0, 1:], reduction="sum").item()
            count += len(window) - 1
            if on_tokens is not None:
                on_tokens(len(window) - 1)
            if count >= max_tokens:
                return math.exp(nll / count)
    if count == 0:
        raise ValueError("no tokens to evaluate")
    return math.exp(nll / count)


def heldout_texts() -> list[str]:
    """The held-out evaluation texts: gpt turns of ShareGPT conversations from ``HELDOUT_OFFSET`` on."""
    return sharegpt.heldout_texts(EVAL_CHARS, offset=sharegpt.HELDOUT_OFFSET)


def heldout_info(eval_tokens: int) -> dict:
    """The ``heldout`` entry of ``testbed.json``: how the recorded perplexities were measured."""
    return {"texts": "sharegpt.heldout_texts(%d, offset=%d)" % (EVAL_CHARS, sharegpt.HELDOUT_OFFSET),
            "max_tokens": eval_tokens, "seq_len": EVAL_SEQ_LEN}


def evaluate_pair(dense, moe, tokenizer, eval_tokens: int = EVAL_TOKENS,
                  on_tokens: Callable[[int], None] | None = None) -> dict:
    """Held-out perplexity of the dense source and of the MoE checkpoint on the same ``eval_tokens`` tokens.

    Returns:
        ``{"dense": float, "moe": float}`` (``on_tokens`` sees ``2 * eval_tokens`` tokens in all).
    """
    texts = heldout_texts()
    return {"dense": perplexity(dense, tokenizer, texts, max_tokens=eval_tokens, on_tokens=on_tokens),
            "moe": perplexity(moe, tokenizer, texts, max_tokens=eval_tokens, on_tokens=on_tokens)}
