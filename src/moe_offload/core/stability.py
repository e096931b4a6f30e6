"""TIDE's stability estimate: how many misses a layer expects ``d`` diffusion steps after a refresh, and what they
cost on the host (DESIGN.md §5; the interval optimiser's input, ``core.interval``).
"""

from __future__ import annotations

import numpy as np

from ..errors import MoeOffloadError
from .costs import TideCosts
from .refresh_plan import select_top


class StabilityEstimator:
    """Expected misses at distance ``d`` after a refresh, for one MoE layer (TIDE's stability, DESIGN.md §5).

    Quantity: a refresh at reference step ``r`` keeps ``S_r`` = the ``budget`` experts with the highest
    ``ActivationTracker.score`` after step ``r`` (:func:`select_top`); ``d`` steps later the step's token-experts
    whose expert is not in ``S_r`` are misses. The estimator measures, from the recent blocks, the miss fraction
    ``mu(d)`` = missed token-experts / token-experts and the missed experts ``nu(d)`` (active experts outside the
    set), and the turnover ``|S_s minus S_r|`` of the selection (the experts a refresh loads), for
    ``d = 0..max_distance``.
    It measures them at *every* step of a block as a potential refresh point
    (every pair of steps ``(r, r + d)`` of the block), not only at the refreshes the planner took, so distances
    beyond the intervals chosen so far are observed too (no exploration bias).

    Recency: at each new block, the accumulated sums are multiplied by ``decay``.

    Tokens per step: the intervals the optimiser prices cover steps after a block's first (``TidePlanner`` decides
    at steps >= 1), and a block's first step may route more tokens than the others — with the block-prefix KV cache
    (``generation.diffusion_forward``) it also computes the block committed just before (the prompt's complete blocks in
    a request's first step). So ``token_experts_per_step`` and ``active_per_step`` are means over the later steps
    of the blocks (``observe(..., first=True)`` marks a block's first step), over all steps until a later one is
    seen; the miss fractions are measured at every step.

    Prior (before data, and blended with few observations, weight ``prior_weight`` steps): ``mu(d) = (1 - B/E) *
    (1 - rho**d)`` — no miss at the reference step, tending to the miss fraction of an arbitrary set of ``B`` of
    ``E`` experts under uniform routing — with ``rho = prior_rho`` (0.8: a set still covers most of the routing 5
    steps later, TIDE's "say, 5 consecutive diffusion steps"; an assumption); ``nu(d) = mu(d) * active`` with the
    observed mean active experts per step (before any step: the expected distinct experts of 32 tokens x top-8
    under uniform routing). Estimates are made non-decreasing in ``d`` (misses grow with distance).

    Args:
        num_experts, budget: E and B (``1 <= B <= E``).
        max_distance: largest distance tracked (>= 1).
        decay: per-block decay of the accumulated evidence (0..1].
        prior_rho, prior_weight: the prior (see above).
        top_k: experts per token (for the prior's active-expert guess).

    Raises:
        MoeOffloadError: arguments out of range.
    """

    def __init__(self, num_experts: int, budget: int, max_distance: int = 16, decay: float = 0.7,
                 prior_rho: float = 0.8, prior_weight: float = 1.0, top_k: int = 8):
        if not 1 <= budget <= num_experts:
            raise MoeOffloadError(f"budget must be in [1, {num_experts}], got {budget}")
        if max_distance < 1 or not 0 < decay <= 1 or not 0 <= prior_rho < 1 or prior_weight < 0:
            raise MoeOffloadError("max_distance >= 1, 0 < decay <= 1, 0 <= prior_rho < 1, prior_weight >= 0")
        self.E, self.B, self.D = int(num_experts), int(budget), int(max_distance)
        self.decay, self.prior_rho, self.prior_weight = float(decay), float(prior_rho), float(prior_weight)
        n = self.D + 1
        self._miss_tok = np.zeros(n)
        self._tok = np.zeros(n)
        self._miss_exp = np.zeros(n)
        self._pairs = np.zeros(n)
        self._turn = np.zeros(n)
        self._masks: list[np.ndarray] = []
        self._sum_tok = np.zeros(2)   # [all steps, steps after a block's first]
        self._sum_act = np.zeros(2)
        self._nsteps = np.zeros(2)
        self._act0 = num_experts * (1.0 - (1.0 - 1.0 / num_experts) ** (32 * top_k))

    def begin_block(self) -> None:
        """A new block: forget the in-block reference sets; decay the accumulated evidence."""
        self._masks = []
        for a in (self._miss_tok, self._tok, self._miss_exp, self._pairs, self._turn):
            a *= self.decay
        for a in (self._sum_tok, self._sum_act, self._nsteps):
            a *= self.decay

    def observe(self, counts: np.ndarray, score: np.ndarray, first: bool = False) -> None:
        """Record step ``s``'s counts (int ``[E]``) against the sets of the block's earlier steps, then record this
        step's own set (from ``score`` ``[E]``, the tracker's score after observing step ``s``); ``first``: ``s`` is
        the block's first step (not counted in the per-step means, see the class docstring)."""
        c = np.asarray(counts, dtype=np.float64)
        act = (c > 0).astype(np.float64)
        tot = c.sum()
        mask = np.zeros(self.E, dtype=bool)
        mask[select_top(score, self.B)] = True
        refs = self._masks[-self.D:] if self._masks else []
        if refs:
            out = ~np.stack(refs)  # [r, E], experts outside each earlier set; last row is distance 1
            mt = out @ c
            me = out @ act
            tn = out @ mask.astype(np.float64)
            d = np.arange(len(refs), 0, -1)
            np.add.at(self._turn, d, tn)
            np.add.at(self._miss_tok, d, mt)
            np.add.at(self._miss_exp, d, me)
            np.add.at(self._tok, d, tot)
            np.add.at(self._pairs, d, 1.0)
        self._miss_tok[0] += c[~mask].sum()
        self._miss_exp[0] += act[~mask].sum()
        self._tok[0] += tot
        self._pairs[0] += 1.0
        self._masks.append(mask)
        which = [0] if first else [0, 1]
        self._sum_tok[which] += tot
        self._sum_act[which] += act.sum()
        self._nsteps[which] += 1.0

    def _mean(self, sums: np.ndarray) -> float | None:
        i = 1 if self._nsteps[1] > 0 else 0
        return float(sums[i] / self._nsteps[i]) if self._nsteps[i] > 0 else None

    @property
    def token_experts_per_step(self) -> float | None:
        """Mean token-experts per step after a block's first (recency-weighted; class docstring); None before any
        step."""
        return self._mean(self._sum_tok)

    @property
    def active_per_step(self) -> float:
        """Mean active experts per step after a block's first (recency-weighted; the prior's guess before any
        step)."""
        m = self._mean(self._sum_act)
        return self._act0 if m is None else m

    def prior_mu(self) -> np.ndarray:
        """The prior miss fraction ``[D + 1]`` (see the class docstring)."""
        d = np.arange(self.D + 1)
        return (1.0 - self.B / self.E) * (1.0 - self.prior_rho ** d)

    def curves(self) -> tuple[np.ndarray, np.ndarray]:
        """``(mu, nu)``, float64 ``[D + 1]``: expected miss fraction of token-experts and expected missed experts
        at distance ``d = 0..D`` from the reference step (non-decreasing in ``d``)."""
        tk = self.token_experts_per_step or 1.0
        w = self.prior_weight
        pm = self.prior_mu()
        pn = pm * self.active_per_step
        den = self._tok + w * tk
        mu = np.divide(self._miss_tok + w * tk * pm, den, out=pm.copy(), where=den > 0)
        den = self._pairs + w
        nu = np.divide(self._miss_exp + w * pn, den, out=pn.copy(), where=den > 0)
        return np.maximum.accumulate(mu), np.maximum.accumulate(nu)

    def turnover(self) -> np.ndarray:
        """Expected experts a refresh loads, float64 ``[D + 1]``: ``|S_s minus S_r|`` for sets selected ``d = s - r``
        steps apart (0 at ``d = 0``; non-decreasing). Prior (no pair observed): the prior miss fraction times the
        budget."""
        w = self.prior_weight
        pt = self.prior_mu() * self.B
        den = self._pairs + w
        t = np.divide(self._turn + w * pt, den, out=pt.copy(), where=den > 0)
        t[0] = 0.0
        return np.maximum.accumulate(t)

    def expected_miss_s(self, costs: TideCosts) -> np.ndarray:
        """Expected host-fallback seconds per step at distance ``d = 0..D``:
        ``mu(d) * token_experts_per_step * fallback_token_s + nu(d) * fallback_expert_s``."""
        mu, nu = self.curves()
        tk = self.token_experts_per_step or 0.0
        return mu * tk * costs.fallback_token_s + nu * costs.fallback_expert_s
