"""Synthetic routing traces, for scale tests of the simulator only (DESIGN.md §6, §7).

Nothing here comes from a model: a synthetic trace has the geometry of a real one (e.g. Qwen3-30B-A3B's 48 x 128 x
top-8) and two knobs, per-layer popularity skew and step-to-step reuse, so the replay's speed and the policies'
qualitative behaviour can be exercised at sizes no recorded trace here reaches. Its header says ``synthetic: true``
and every report made from it must say so.

Generative model, per MoE layer independently (vectorised with numpy over all token positions):

* popularity: a random permutation of the layer's experts ranked by a Zipf law, ``p(rank r) ∝ 1 / r**skew``
  (``skew = 0`` is uniform);
* each token position selects ``top_k`` distinct experts held in ``top_k`` "lanes". At each position every lane
  keeps its expert with probability ``reuse`` (the first position of a request redraws all lanes) and otherwise
  draws a fresh expert from the popularity law, redrawn (from the law restricted to the allowed experts) until it
  differs from every expert of the previous position and from the other lanes' current experts. So each expert of
  position t-1 is still selected at t with probability exactly ``reuse`` (when ``num_experts >= 2 * top_k``;
  otherwise there are not enough experts to exclude the previous set, fresh draws only avoid the other lanes, and
  reuse is a lower bound).

Because a selected expert stays with probability exactly ``reuse`` however popular it is, the experts' marginal
selection frequencies are flatter than the Zipf law of the fresh draws (``skew`` orders popularity; it is not the
exponent of the observed frequencies).

Prompt tokens (step 0) follow the same process as decode tokens (consecutive prompt positions are correlated the
same way); the first position of each request starts afresh.
"""

from __future__ import annotations

import numpy as np

from ..errors import MoeOffloadError
from .format import FORMAT, VERSION, Trace

_MAX_PASSES = 10_000


def synthetic_trace(num_moe_layers: int = 48, num_experts: int = 128, top_k: int = 8, steps: int = 1000,
                    requests: int = 1, prompt_tokens: int = 16, skew: float = 1.0, reuse: float = 0.5,
                    seed: int = 0) -> Trace:
    """Generate a synthetic routing trace (see the module docstring for the model).

    Args:
        num_moe_layers, num_experts, top_k: geometry L, E, k (1 <= k <= E).
        steps: decode steps per request (>= 0).
        requests: number of requests (>= 1).
        prompt_tokens: prompt length of each request (>= 1): the rows of its prefill step (step 0).
        skew: Zipf exponent of each layer's expert popularity (>= 0).
        reuse: probability that an expert selected at token position t-1 is selected again at t, in [0, 1].
        seed: seed of numpy's PCG64 generator; equal arguments give equal traces.

    Returns:
        A ``Trace`` with ``N = requests * (prompt_tokens + steps)`` rows: ``expert_ids`` int16 ``[N, L, k]``
        (distinct within a row and layer, unsorted), ``expert_weights`` float16 ``[N, L, k]`` (all ``1/k``),
        ``request``/``step`` int32 ``[N]``, ``prompt_ids`` int32 zeros ``[requests * prompt_tokens]``, header with
        ``synthetic: true`` and ``model_id`` ``"synthetic-<L>x<E>x<k>"``. 100k steps of 48 x 128 x 8 (skew 1, reuse
        0.5) take about 5 s on one core here; higher skew needs more collision-repair passes (skew 2: about 3x).

    Raises:
        MoeOffloadError: an argument out of range.
    """
    L, E, k = int(num_moe_layers), int(num_experts), int(top_k)
    if L < 1 or E < 1 or not 1 <= k <= E:
        raise MoeOffloadError(f"synthetic trace needs layers >= 1 and 1 <= top_k <= experts, got {L}x{E}x{k}")
    if E > np.iinfo(np.int16).max:
        raise MoeOffloadError(f"at most {np.iinfo(np.int16).max} experts per layer fit the trace format, got {E}")
    if steps < 0 or requests < 1 or prompt_tokens < 1:
        raise MoeOffloadError("synthetic trace needs steps >= 0, requests >= 1, prompt_tokens >= 1")
    if not 0.0 <= reuse <= 1.0 or skew < 0:
        raise MoeOffloadError(f"synthetic trace needs 0 <= reuse <= 1 and skew >= 0, got reuse={reuse}, skew={skew}")

    per_req = prompt_tokens + steps
    n = requests * per_req
    rng = np.random.Generator(np.random.PCG64(seed))
    starts = np.zeros(n, dtype=bool)
    starts[::per_req] = True
    ids = np.empty((n, L, k), dtype=np.int16)
    p = 1.0 / np.arange(1, E + 1, dtype=np.float64) ** float(skew)
    p /= p.sum()
    for layer in range(L):
        perm = rng.permutation(E)
        ids[:, layer, :] = perm[_layer_ranks(rng, n, k, p, starts, float(reuse))].T

    req = np.repeat(np.arange(requests, dtype=np.int32), per_req)
    step = np.tile(np.concatenate([np.zeros(prompt_tokens, np.int32), np.arange(1, steps + 1, dtype=np.int32)]),
                   requests)
    header = {
        "format": FORMAT, "version": VERSION,
        "model_id": f"synthetic-{L}x{E}x{k}", "model_type": "synthetic",
        "num_moe_layers": L, "num_experts": E, "top_k": k, "synthetic": True, "router_probs": False,
        "requests": [{"prompt_tokens": int(prompt_tokens), "decode_steps": int(steps)} for _ in range(requests)],
        "source": f"moe_offload.trace.synthetic.synthetic_trace(skew={skew}, reuse={reuse}, seed={seed})",
    }
    weights = np.full((n, L, k), 1.0 / k, dtype=np.float16)
    return Trace(header, ids, weights, req, step, np.zeros(requests * prompt_tokens, dtype=np.int32))


def _layer_ranks(rng, n: int, k: int, p: np.ndarray, starts: np.ndarray, reuse: float) -> np.ndarray:
    """Popularity ranks ``[k, n]`` (uint8 or int16, lane-major) of one layer's selections under the lane process of
    the module docstring.

    Every lane redraw ("event") is first drawn unconditionally; then, in passes, each event whose value collides
    with the previous row's set or with another lane of its row (the later lane loses a tie) is redrawn from the
    popularity law restricted to the experts not excluded at that row. A redraw changes the lane over its whole run
    (until its next event), so the next pass re-checks the rows that run touches. Each pass resolves the collisions
    it sees exactly and new ones only arise later in time, so a handful of passes suffice.
    """
    E = len(p)
    exclude_prev = E >= 2 * k
    cdf = np.cumsum(p)
    cdf[-1] = np.inf
    before = np.concatenate([[0.0], np.cumsum(p)[:-1], [np.inf]])  # mass before rank r; sentinel rank E
    p_pad = np.concatenate([p, [0.0]])
    alias = _alias_table(p)

    redraw = rng.random((k, n)) >= reuse  # lane-major: each lane's row of cells is contiguous
    redraw[:, starts] = True
    cols = np.arange(n, dtype=np.int32)
    last = np.where(redraw, cols, 0)  # [k, n] row of the event each cell's value comes from
    np.maximum.accumulate(last, axis=1, out=last)
    nxt = np.where(redraw[:, ::-1], cols[::-1], n)  # reversed; after the scan: first event row >= t
    np.minimum.accumulate(nxt, axis=1, out=nxt)
    nxt = nxt[:, ::-1]
    F = np.zeros((k, n), dtype=np.uint8 if E < 255 else np.int16)  # value drawn at each event cell
    F[redraw] = _alias_draw(rng, None, int(redraw.sum()), alias)
    V = np.take_along_axis(F, last, axis=1)

    t, j = _collisions(V, redraw, starts, exclude_prev, np.arange(n))
    lanes = np.arange(k)[:, None]
    for _ in range(_MAX_PASSES):
        if len(t) == 0:
            return V
        excl = np.where(lanes != j[None, :], V[:, t], E)  # [k, c]; the lane's own slot is not an exclusion
        if exclude_prev:
            prev = np.where(starts[t][None, :], E, V[:, np.maximum(t - 1, 0)])
            excl = np.concatenate([excl, prev], axis=0)
        val = _draw_excluding(rng, excl, p_pad, before, cdf, alias).astype(V.dtype)
        # write the new values over each redrawn run [t, end)
        end = np.where(t + 1 < n, nxt[j, np.minimum(t + 1, n - 1)], n)
        lens = end - t
        rr = np.repeat(t, lens) + (np.arange(lens.sum()) - np.repeat(np.cumsum(lens) - lens, lens))
        V[np.repeat(j, lens), rr] = np.repeat(val, lens)
        # re-check the rows [t, end] (row `end` compares against the changed previous row)
        mark = np.bincount(t, minlength=n + 1) - np.bincount(np.minimum(end, n - 1) + 1, minlength=n + 1)
        t, j = _collisions(V, redraw, starts, exclude_prev, np.flatnonzero(np.cumsum(mark[:n])))
    raise RuntimeError("synthetic trace generation did not converge")  # pragma: no cover


def _collisions(V, redraw, starts, exclude_prev, rows):
    """Event cells ``(rows, lanes)`` among ``rows`` (int array) whose value collides: equals a value of the previous
    row (when ``exclude_prev``; not at a request's first row) or of another lane of its row that was kept or comes
    earlier. ``V``, ``redraw``: lane-major ``[k, n]``."""
    k = V.shape[0]
    Vr, Rr = V[:, rows], redraw[:, rows]
    bad = np.zeros(Vr.shape, dtype=bool)
    if exclude_prev:
        # a kept lane's value is also its previous value, so "equals the previous row's set" covers collisions with
        # kept lanes; within the row only earlier redrawn lanes remain
        Vp = V[:, np.maximum(rows - 1, 0)]
        prev = np.zeros(Vr.shape, dtype=bool)
        for jp in range(k):
            bad[jp + 1:] |= Vr[jp + 1:] == Vr[jp]
            prev |= Vr == Vp[jp]
        prev[:, starts[rows]] = False
        bad |= prev
    else:
        for jp in range(k):
            eq = Vr == Vr[jp]  # [k, m]: lanes holding lane jp's value
            bad[jp + 1:] |= eq[jp + 1:]  # a later lane loses to lane jp
            bad[:jp] |= eq[:jp] & ~Rr[jp]  # an earlier lane loses to lane jp if jp was kept
    bad &= Rr
    tj, ti = np.nonzero(bad)
    return rows[ti], tj


def _alias_table(p: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Walker's alias table ``(prob, alias)`` for sampling ranks ``0..E-1`` with probabilities ``p`` exactly."""
    E = len(p)
    prob = np.asarray(p, dtype=np.float64) * E
    alias = np.arange(E)
    small = [i for i in range(E) if prob[i] < 1.0]
    large = [i for i in range(E) if prob[i] >= 1.0]
    while small and large:
        s, g = small.pop(), large.pop()
        alias[s] = g
        prob[g] -= 1.0 - prob[s]
        (small if prob[g] < 1.0 else large).append(g)
    for i in small + large:
        prob[i] = 1.0
    return prob, alias


def _alias_draw(rng, p, size, table=None) -> np.ndarray:
    """Draws of ranks ``0..E-1`` with probabilities ``p`` (alias method), int64 array of ``size``."""
    prob, alias = table if table is not None else _alias_table(p)
    i = rng.integers(0, len(prob), size=size)
    return np.where(rng.random(size) < prob[i], i, alias[i])


def _draw_excluding(rng, excl: np.ndarray, p_pad: np.ndarray, before: np.ndarray, cdf: np.ndarray,
                    alias) -> np.ndarray:
    """One draw per column from the popularity law over ranks, excluding the ranks in ``excl`` ``[X, c]`` (``E``
    pads).

    Rejection from the unconditional law (alias method) for up to 32 rounds; columns still unresolved (excluded
    mass close to 1) get an exact inverse-CDF draw on the remaining mass: ``u ~ U(0, 1 - excluded mass)``, then for
    each excluded rank in ascending order, if ``u`` has reached its start, skip its mass.
    """
    E = len(p_pad) - 1
    out = np.empty(excl.shape[1], dtype=np.int64)
    todo = np.arange(excl.shape[1])
    for _ in range(32):
        if len(todo) == 0:
            return out
        d = _alias_draw(rng, None, len(todo), alias)
        ok = ~(excl[:, todo] == d).any(axis=0)
        out[todo[ok]] = d[ok]
        todo = todo[~ok]
    if len(todo):
        s = np.sort(excl[:, todo].T, axis=1)
        dup = np.zeros(s.shape, dtype=bool)
        dup[:, 1:] = s[:, 1:] == s[:, :-1]
        s[dup] = E  # a sentinel keeps the walk's ascending order: it never matches and has no mass
        u = rng.random(len(s)) * np.maximum(1.0 - p_pad[s].sum(axis=1), 0.0)
        for i in range(s.shape[1]):
            r = s[:, i]
            u += np.where(before[r] <= u, p_pad[r], 0.0)
        out[todo] = np.minimum(np.searchsorted(cdf, u, side="right"), E - 1)
    return out
