"""Prefetch tasks (SeqMoE §6.1): positions and deadlines, ``generate_tasks`` from a one-step prediction (the top-(k+3)
experts per layer with their confidences) and ``tasks_from_forecast`` from a predictor's forecast; a scheduler
(``core.prefetch_queue``) queues them. Conventions (positions, deadlines, units) in ``core.prefetch``'s docstring.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..errors import MoeOffloadError


#: a prefetch copy moves in this many chunks, and yields the link to on-demand copies at a chunk boundary (SeqMoE
#: §8.3's pause, at the granularity a real copy engine can stop: between the chunks it issues), so a miss waits at
#: most 1/LINK_CHUNKS of one expert copy behind a prefetch; the simulator and the emulated link share it
LINK_CHUNKS = 8


def link_time_after_chunk(remaining: float, chunk: float) -> float:
    """Link time a copy has left once the chunk it is in completes: ``floor(remaining / chunk) * chunk`` (seconds or
    layer times, as given), so an on-demand copy that asks for the link waits ``remaining - result`` < ``chunk``
    (SeqMoE §8.3's pause). ``chunk`` is a copy's time / ``LINK_CHUNKS``; the simulator and the runtime's emulated
    link both use this."""
    return math.floor(remaining / chunk) * chunk


@dataclass(slots=True)
class PrefetchTask:
    """One candidate expert transfer (SeqMoE §6.1). Treated as immutable (nothing assigns its fields); not frozen,
    because a frozen dataclass's constructor costs ~5x more, and a decode step makes a few hundred tasks.

    Attributes:
        eid: global expert id ``layer * num_experts + expert``.
        conf: prediction confidence, the expected contribution to expert hits (batch-mean activation probability).
        ddl: deadline, the global position (in MoE layers, see the module docstring) at which the expert is needed.
        layer: MoE layer index ``p`` of the expert (0-based among MoE layers).
        expert: expert index ``q`` within its layer.
        step: the generation step ``i`` (>= 1) whose execution of ``layer`` needs the expert.
    """

    eid: int
    conf: float
    ddl: int
    layer: int = -1
    expert: int = -1
    step: int = 0


def position(step: int, layer: int, num_moe_layers: int) -> int:
    """Global position of MoE ``layer`` in generation ``step``: ``(step - 1) * L + layer`` (SeqMoE §6.1).

    Step 0 (prefill) maps to negative positions ``-L .. -1``; decode step 1, layer 0 is position 0.
    """
    return (step - 1) * num_moe_layers + layer


def prefetch_width(num_experts: int, top_k: int, extra: int = 3) -> int:
    """k', the number of tasks per layer: ``k + extra`` clamped to ``k <= k' < e`` (SeqMoE §6.1; §9.1 uses
    ``extra = 3``). When ``k == e`` (every expert active) k' = e."""
    return max(top_k, min(top_k + extra, num_experts - 1))


def _as_array(probs) -> np.ndarray:
    if hasattr(probs, "detach"):  # a torch tensor, without importing torch here
        probs = probs.detach().float().cpu().numpy()
    return np.asarray(probs, dtype=np.float64)


def _confidences(probs, n: int, num_experts: int) -> np.ndarray:
    """``generate_tasks``' ``probs`` as float ``[n, num_experts]`` (a batch ``[b, 1, n, e]``: its mean over b).

    Raises:
        MoeOffloadError: another shape, or non-finite values.
    """
    a = _as_array(probs)
    if a.ndim == 4 and a.shape[1] == 1 and a.shape[0] >= 1:
        a = a[:, 0].mean(axis=0)
    elif a.ndim != 2:
        raise MoeOffloadError(f"probs must be [n, e] or [b, 1, n, e], got shape {tuple(a.shape)} "
                              "(for a Forecast pass probs[0])")
    if a.shape != (n, num_experts):
        raise MoeOffloadError(f"probs must cover {n} layers x {num_experts} experts, got shape {tuple(a.shape)}")
    if not np.isfinite(a).all():
        raise MoeOffloadError("probs contains non-finite values")
    return a


def check_task_args(layers: tuple[int, int], step_index: int, num_moe_layers: int, num_experts: int, top_k: int,
                    extra: int = 3) -> tuple[int, int]:
    """``generate_tasks``' arguments checked; returns ``(l, l')``.

    Raises:
        MoeOffloadError: an argument out of its range (``generate_tasks``' Args)."""
    lo, hi = (int(x) for x in layers)
    if num_moe_layers < 1 or not 0 <= lo < hi <= num_moe_layers:
        raise MoeOffloadError(f"layers must satisfy 0 <= l < l' <= L={num_moe_layers}, got {layers}")
    if num_experts < 1 or not 1 <= top_k <= num_experts:
        raise MoeOffloadError(f"need 1 <= top_k <= num_experts, got top_k={top_k}, num_experts={num_experts}")
    if extra < 0:
        raise MoeOffloadError(f"extra must be >= 0, got {extra}")
    if step_index < 1:
        raise MoeOffloadError(f"step_index is the decode step predicted (>= 1), got {step_index}")
    return lo, hi


def not_resident(table):
    """``keep(eid)`` for ``generate_tasks``: the expert is neither resident nor in flight in ``table`` (a
    ``core.slots.SlotTable`` or anything with ``slot_of`` and ``fetching``); None for no table."""
    if table is None:
        return None
    slot_of, fetching = table.slot_of, table.fetching
    return lambda eid: slot_of[eid] < 0 and eid not in fetching  # noqa: E731


def top_candidates(a: np.ndarray, width: int) -> tuple[np.ndarray, np.ndarray]:
    """The ``width`` most confident experts of each layer of a one-step prediction ``a`` (float ``[n, e]``), best
    first, ties to the smaller expert index (SeqMoE §6.1's top-k'): ``(int64 expert indices [n, width], their
    confidences [n, width])``; ``forecast_candidates``' numpy path."""
    top = np.argsort(-a, axis=1, kind="stable")[:, :width]
    return top, a[np.arange(a.shape[0])[:, None], top]  # take_along_axis, without its Python wrapper's cost


def chance_of_use(p: np.ndarray, top_k: int, sums: np.ndarray | None = None) -> np.ndarray:
    """float64 ``[n, E]``: each expert's chance of being among the ``top_k`` its layer uses, from a forecast row
    ``p`` (float64 ``[n, E]``). Forecasts come in two scales: per-expert activation probabilities (a row sums to
    about ``top_k``: SeqMoE's predictor) and a distribution over the experts (a row sums to 1: cross-layer
    forecasts, ``runtime.cross_layer``). Each row is scaled to sum to ``top_k``, capped at 1. ``sums`` (``[n, 1]``):
    the whole rows' sums when ``p`` holds only some entries of each row (``[n, m]``, e.g. its top candidates)."""
    if sums is None:
        sums = p.sum(axis=-1, keepdims=True)
    return np.minimum(1.0, p * top_k / np.where(sums > 0, sums, 1.0))


def forecast_candidates(probs, n: int, num_experts: int, width: int, top_k: int, gate=None, chances: bool = False,
                        kernel=None) -> tuple[list, list, list | None, list | None]:
    """A one-step prediction's prefetch candidates (SeqMoE §6.1's top-k' per layer, ``top_candidates``), as nested
    lists ``[n][width]``: ``(experts, confidences, chances of use or None, the gate's verdicts or None)``. The one
    choice of candidates ``generate_tasks`` and ``core.prefetch_queue``'s gated submission share.

    Args:
        probs: ``generate_tasks``' ``probs`` (``[n, num_experts]``, or ``[b, 1, n, num_experts]``).
        width: k' (``prefetch_width``); top_k: k.
        gate: a ``core.prefetch_cost.PrefetchCost`` or None: with ``chances``, each candidate's verdict, ``worth``
            vectorised: ``min(1, chance * used_scale) > threshold`` (all False while the gate is ``closed``).
        chances: compute each candidate's ``chance_of_use`` (over its whole row's sum) and the gate's verdicts.
        kernel: the native ``forecast_candidates`` (``runtime.kernels.forecast_candidates_kernel``) or None: for a
            2-D float32/float64 ``probs`` it computes the same lists bit for bit in one call (numpy's pairwise row
            sums included); anything else, or a non-finite value, goes through numpy.
    Raises:
        MoeOffloadError: as ``generate_tasks`` (a bad shape, non-finite values).
    """
    mode, scale, thr = 0, 1.0, 0.0
    if gate is not None and chances:
        mode = 2 if gate.closed else 1
        scale, thr = gate.used_scale, gate.threshold
    if kernel is not None and type(probs) is np.ndarray and probs.shape == (n, num_experts):
        got = kernel(probs, width, top_k, chances, mode, scale, thr)
        if got is not None:
            return got
    a = _confidences(probs, n, num_experts)
    top, conf = top_candidates(a, width)
    chance = worth = None
    if chances:
        chance = chance_of_use(conf, top_k, a.sum(axis=-1, keepdims=True))      # the candidates' only
        if mode:
            worth = (np.zeros(chance.shape, dtype=bool) if mode == 2
                     else np.minimum(1.0, chance * scale) > thr).tolist()
        chance = chance.tolist()
    return top.tolist(), conf.tolist(), chance, worth


def generate_tasks(probs, layers: tuple[int, int], step_index: int, num_moe_layers: int, num_experts: int,
                   top_k: int, extra: int = 3, keep=None, kernel=None) -> list[PrefetchTask]:
    """Prefetch tasks from one one-step prediction (SeqMoE §6.1).

    The prediction made at step ``i - 1``, layer ``l'`` gives, for each layer ``l <= p < l'``, the probability of
    every expert being activated at step ``i``. For each layer the ``k'`` experts with the highest confidence
    become tasks (``k' = prefetch_width(e, k, extra)``, i.e. ``k + extra`` with ``k <= k' < e``), with

        conf = Mean(A'_{i,l:l'}[:, 0, p, q])   (the mean over the batch of b requests; b = 1: the probability)
        ddl  = (i - 1) * L + p                  (the position at which layer p of step i runs)

    so a task created at position ``(i - 2) * L + l' - 1`` has an overlap window of ``L - (l' - 1 - p)`` layers.

    Args:
        probs: float array or tensor, ``[n, e]`` for one request (``Forecast.probs[0]``), or ``[b, 1, n, e]`` for a
            batch of b requests (the paper's ``A'_{i,l:l'}``; confidence is the mean over b). ``n = l' - l``.
        layers: ``(l, l')``, the MoE layers predicted, ``0 <= l < l' <= L``.
        step_index: ``i >= 1``, the generation step the prediction is for (``Forecast.step + 1``).
        num_moe_layers: L, MoE layers in the model.
        num_experts: e, routed experts per MoE layer.
        top_k: k, experts activated per token.
        extra: k' - k (default 3, SeqMoE §9.1).
        keep: optional ``keep(eid) -> bool``: the top-k' candidates it rejects make no task.
        kernel: optional native ``forecast_candidates`` (``forecast_candidates``' ``kernel``).
    Returns:
        Tasks ordered by layer, then by decreasing confidence (ties: smaller expert index).
    Raises:
        MoeOffloadError: a shape that does not match ``layers``/``num_experts`` (a 3-D ``[1 + c, n, e]`` forecast
            must be indexed by row first), non-finite probabilities, or out-of-range arguments.
    """
    lo, hi = check_task_args(layers, step_index, num_moe_layers, num_experts, top_k, extra)
    top, conf, _, _ = forecast_candidates(probs, hi - lo, num_experts, prefetch_width(num_experts, top_k, extra),
                                          top_k, kernel=kernel)
    return candidate_tasks(top, conf, lo, step_index, num_moe_layers, num_experts, keep)[0]


def candidate_tasks(top: list, conf: list, lo: int, step_index: int, num_moe_layers: int,
                    num_experts: int, keep=None, admit: list | None = None,
                    kept: list | None = None) -> tuple[list[PrefetchTask], int]:
    """The task of each candidate (``forecast_candidates``' ``top`` / ``conf`` of layers ``lo ..``: nested lists
    ``[n][width]``) that ``keep`` admits and ``admit`` (optional, bools ``[n][width]`` aligned with ``top``: e.g. a
    cost gate's verdict) does too, ordered by layer then rank (``generate_tasks``' order), and how many candidates
    ``keep`` admits and ``admit`` refuses (no task is made for them). ``kept``: a list the ``(row, rank)`` in ``top``
    of every candidate ``keep`` admits is appended to, refused or not."""
    tasks = []
    add, task = tasks.append, PrefetchTask
    refused = 0
    for r, (qs, cs) in enumerate(zip(top, conf)):
        p = lo + r
        ddl = position(step_index, p, num_moe_layers)
        base = p * num_experts
        ok = admit[r] if admit is not None else None
        for j, (q, c) in enumerate(zip(qs, cs)):
            if keep is None or keep(base + q):
                if kept is not None:
                    kept.append((r, j))
                if ok is not None and not ok[j]:
                    refused += 1
                    continue
                add(task(base + q, c, ddl, p, q, step_index))
    return tasks, refused


def tasks_from_forecast(forecast, num_moe_layers: int, num_experts: int, top_k: int,
                        extra: int = 3, table=None) -> list[PrefetchTask]:
    """``generate_tasks`` on a ``predictor.runtime.Forecast`` (its row 0, for step ``forecast.step + 1``).

    Args:
        table: optional ``core.slots.SlotTable``: tasks of experts already resident or in flight are left out (no
            transfer is needed; queued, they would only make the scheduler pick tasks the slot table refuses).
    Raises:
        MoeOffloadError: as ``generate_tasks``.
    """
    return generate_tasks(forecast.probs[0], forecast.layers, forecast.step + 1, num_moe_layers, num_experts, top_k,
                          extra, not_resident(table))
