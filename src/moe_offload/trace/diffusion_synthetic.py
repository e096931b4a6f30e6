"""A SYNTHETIC diffusion routing trace (TIDE; no model involved), standing in for real LLaDA2 routing, which cannot be
had here: ``synthetic_diffusion_trace`` (format in ``trace.diffusion``).

Model, per request, per block, per MoE layer:

* global popularity: a Zipf law ``p(rank r) ∝ r**-skew`` over a random permutation of the layer's experts
  (``skew`` small: LLaDA2's router balances load with an expert bias);
* block preference: the block's law is ``p * exp(block_concentration * g)`` with ``g ~ N(0, 1)`` per expert,
  renormalised (a block's content favours some experts);
* each of the block's tokens holds ``top_k`` distinct experts in lanes, drawn from the block's law at step 0.
  From one step to the next a lane keeps its expert with probability ``reuse_masked`` while its token is
  masked, ``reuse_committed`` once it is committed, and ``1 - commit_redraw`` on the step right after its token
  was committed (its input changed from the mask token to a real token); a changed lane draws a new expert from
  the block's law, excluding the token's other experts;
* commits: each step commits ``min(masked, 1 + Poisson(tokens_per_step - 1))`` random masked tokens (at least
  one, as LLaDA2's schedule guarantees); the block ends at the step that commits its last token.

Calibration (what the TIDE text available here reports, and what is assumed): the TIDE text states only
qualitatively that "within a short window (say, 5 consecutive diffusion steps), the same experts fire
repeatedly" and that consecutive steps show "high correlation"; it gives no overlap numbers (nor do the
authors' code and notebook as far as they could be read here). The defaults were chosen so that, by
``stability_profile`` on the default trace (4 requests x 8 blocks, seed 0): consecutive steps' active sets
overlap strongly (Jaccard 0.88; 126 of 256 experts active per layer and step), and a half-budget set (128)
chosen at one step covers 99% of that step's token-experts, 96% one step later, 87% five steps later and
83% eight steps later (25% budget: 76%, 73%, 64%, 61%). ``tokens_per_step`` 2.5 (about 13 steps per
32-token block under LLaDA2's threshold 0.95) is an assumption. None of these numbers is measured on LLaDA2;
results on this trace describe the generator.
"""

from __future__ import annotations

import numpy as np

from ..errors import MoeOffloadError
from .diffusion import DiffusionTrace


def synthetic_diffusion_trace(num_moe_layers: int = 19, num_experts: int = 256, top_k: int = 8,
                              requests: int = 4, blocks: int = 8, block_length: int = 32, skew: float = 0.3,
                              block_concentration: float = 1.0, reuse_masked: float = 0.85,
                              reuse_committed: float = 0.97, commit_redraw: float = 0.5,
                              tokens_per_step: float = 2.5, seed: int = 0) -> DiffusionTrace:
    """Generate a SYNTHETIC diffusion routing trace (no model involved; its header says ``synthetic: true``).

    No real LLaDA2 routing can be obtained here, so this stands in for it. Default geometry: LLaDA2.0-mini
    (19 MoE layers x 256 experts, top-8, blocks of 32 tokens; one forward per step over the block's 32 tokens, as a
    runtime with a prefix KV cache runs it).

    The model and its calibration: the module docstring.

    Args:
        num_moe_layers, num_experts, top_k: geometry (``1 <= top_k <= num_experts``).
        requests, blocks: requests and blocks per request (>= 1).
        block_length: tokens per block (>= 1).
        skew: Zipf exponent of global popularity (>= 0).
        block_concentration: log-normal sigma of the per-block preference (>= 0).
        reuse_masked, reuse_committed, commit_redraw: lane persistence probabilities, in [0, 1].
        tokens_per_step: mean tokens committed per step (>= 1).
        seed: numpy PCG64 seed; equal arguments give equal traces.

    Returns:
        A validated DiffusionTrace (``committed`` holds each step's commits; ``tokens`` = ``block_length``).

    Raises:
        MoeOffloadError: an argument out of range.
    """
    L, E, k, T = int(num_moe_layers), int(num_experts), int(top_k), int(block_length)
    _check_args(L, E, k, T, requests, blocks, skew, block_concentration, reuse_masked, reuse_committed,
                commit_redraw, tokens_per_step)
    rng = np.random.Generator(np.random.PCG64(seed))
    base = 1.0 / np.arange(1, E + 1, dtype=np.float64) ** float(skew)
    glob = np.stack([base[rng.permutation(E)] for _ in range(L)])  # [L, E], expert -> weight
    glob /= glob.sum(axis=1, keepdims=True)
    rows_counts, rows_req, rows_blk, rows_step, rows_com = [], [], [], [], []
    for r in range(requests):
        for b in range(blocks):
            logp = np.log(glob) + block_concentration * rng.standard_normal((L, E))  # [L, E]
            for s, (cnt, n_c) in enumerate(_block_steps(rng, logp, T, k, reuse_masked, reuse_committed,
                                                        commit_redraw, tokens_per_step)):
                rows_counts.append(cnt)
                rows_req.append(r)
                rows_blk.append(b)
                rows_step.append(s)
                rows_com.append(n_c)
    gen = {"skew": skew, "block_concentration": block_concentration, "reuse_masked": reuse_masked,
           "reuse_committed": reuse_committed, "commit_redraw": commit_redraw, "tokens_per_step": tokens_per_step,
           "requests": requests, "blocks": blocks, "seed": seed}
    return DiffusionTrace.from_steps(
        np.stack(rows_counts), rows_blk, rows_step, rows_req, np.full(len(rows_req), T), rows_com, top_k=k,
        model_id=f"synthetic-diffusion-{L}x{E}x{k}", model_type="synthetic", block_length=T, synthetic=True,
        source="moe_offload.trace.diffusion_synthetic.synthetic_diffusion_trace(" +
               ", ".join(f"{a}={v}" for a, v in gen.items()) + ")", generator=gen)


def _check_args(L: int, E: int, k: int, T: int, requests: int, blocks: int, skew: float, block_concentration: float,
                reuse_masked: float, reuse_committed: float, commit_redraw: float, tokens_per_step: float) -> None:
    """Raises MoeOffloadError for ``synthetic_diffusion_trace`` arguments out of range."""
    if L < 1 or E < 1 or not 1 <= k <= E or T < 1 or requests < 1 or blocks < 1:
        raise MoeOffloadError(f"synthetic diffusion trace needs layers, experts, requests, blocks, block_length >= 1 "
                              f"and 1 <= top_k <= experts, got {L}x{E}x{k}, {requests} requests, {blocks} blocks, "
                              f"block_length {T}")
    if T * k > np.iinfo(np.uint16).max:
        raise MoeOffloadError("block_length x top_k must fit uint16 counts")
    for name, v in (("reuse_masked", reuse_masked), ("reuse_committed", reuse_committed),
                    ("commit_redraw", commit_redraw)):
        if not 0.0 <= v <= 1.0:
            raise MoeOffloadError(f"{name} must be in [0, 1], got {v}")
    if skew < 0 or block_concentration < 0 or not tokens_per_step >= 1:
        raise MoeOffloadError("skew and block_concentration must be >= 0 and tokens_per_step >= 1")


def _block_steps(rng: np.random.Generator, logp: np.ndarray, T: int, k: int, reuse_masked: float,
                 reuse_committed: float, commit_redraw: float, tokens_per_step: float):
    """The diffusion steps of one block of ``T`` tokens under the block's log-law ``logp`` ``[L, E]`` (the model of
    ``synthetic_diffusion_trace``'s docstring), drawn from ``rng``: yields, per step, ``(counts, committed)`` with
    ``counts`` int64 ``[L, E]`` (the block's tokens per expert at that step) and the tokens the step commits."""
    L, E = logp.shape
    lidx = np.arange(L)[:, None]
    # step 0: top_k distinct experts per token by the Gumbel-top-k trick
    keys = logp[:, None, :] + rng.gumbel(size=(L, T, E))
    lanes = np.argpartition(-keys, k - 1, axis=2)[:, :, :k]  # [L, T, k]
    masked = np.ones(T, dtype=bool)
    just = np.zeros(T, dtype=bool)
    s = 0
    while True:
        if s > 0:
            keep_p = np.where(just, 1.0 - commit_redraw, np.where(masked, reuse_masked, reuse_committed))
            redraw = rng.random((L, T, k)) >= keep_p[None, :, None]
            for j in range(k):
                li, ti = np.nonzero(redraw[:, :, j])
                if len(li) == 0:
                    continue
                kk = logp[li] + rng.gumbel(size=(len(li), E))
                kk[np.arange(len(li))[:, None], lanes[li, ti]] = -np.inf  # exclude the token's experts
                lanes[li, ti, j] = kk.argmax(axis=1)
        cnt = np.zeros((L, E), dtype=np.int64)
        np.add.at(cnt, (np.broadcast_to(lidx[:, :, None], lanes.shape), lanes), 1)
        idx = np.flatnonzero(masked)
        n_c = min(len(idx), 1 + int(rng.poisson(tokens_per_step - 1.0)))
        pick = rng.choice(idx, size=n_c, replace=False)
        just[:] = False
        just[pick] = True
        masked[pick] = False
        yield cnt, n_c
        s += 1
        if not masked.any():
            break
