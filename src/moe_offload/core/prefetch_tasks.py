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
    confidences [n, width])``. The one choice of candidates ``generate_tasks`` and ``core.prefetch_queue``'s gated
    submission share."""
    top = np.argsort(-a, axis=1, kind="stable")[:, :width]
    return top, a[np.arange(a.shape[0])[:, None], top]  # take_along_axis, without its Python wrapper's cost


def generate_tasks(probs, layers: tuple[int, int], step_index: int, num_moe_layers: int, num_experts: int,
                   top_k: int, extra: int = 3, keep=None) -> list[PrefetchTask]:
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
    Returns:
        Tasks ordered by layer, then by decreasing confidence (ties: smaller expert index).
    Raises:
        MoeOffloadError: a shape that does not match ``layers``/``num_experts`` (a 3-D ``[1 + c, n, e]`` forecast
            must be indexed by row first), non-finite probabilities, or out-of-range arguments.
    """
    lo, hi = check_task_args(layers, step_index, num_moe_layers, num_experts, top_k, extra)
    a = _confidences(probs, hi - lo, num_experts)
    top, conf = top_candidates(a, prefetch_width(num_experts, top_k, extra))
    return candidate_tasks(top, conf, lo, step_index, num_moe_layers, num_experts, keep)[0]


def candidate_tasks(top: np.ndarray, conf: np.ndarray, lo: int, step_index: int, num_moe_layers: int,
                    num_experts: int, keep=None, admit=None,
                    kept: list | None = None) -> tuple[list[PrefetchTask], list[tuple[int, int]], int]:
    """The task of each candidate (``top_candidates``' ``top`` / ``conf`` of layers ``lo ..``) that ``keep`` admits
    and ``admit`` (optional, bool ``[n, width]`` aligned with ``top``: e.g. a cost gate's verdict) does too, ordered
    by layer then rank (``generate_tasks``' order); each one's ``(row, rank)`` in ``top``; and how many candidates
    ``keep`` admits and ``admit`` refuses (no task is made for them). ``kept``: a list the ``(row, rank)`` of every
    candidate ``keep`` admits is appended to, refused or not."""
    tasks, where = [], []
    add, task = tasks.append, PrefetchTask
    ok = admit.tolist() if admit is not None else None
    refused = 0
    for r, (qs, cs) in enumerate(zip(top.tolist(), conf.tolist())):
        p = lo + r
        ddl = position(step_index, p, num_moe_layers)
        base = p * num_experts
        for j, (q, c) in enumerate(zip(qs, cs)):
            if keep is None or keep(base + q):
                if kept is not None:
                    kept.append((r, j))
                if ok is not None and not ok[r][j]:
                    refused += 1
                    continue
                add(task(base + q, c, ddl, p, q, step_index))
                where.append((r, j))
    return tasks, where, refused


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
