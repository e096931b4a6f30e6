"""Forecasts used a fixed number of MoE layers after the layer that triggers them, so that the predictor can run in
a process of its own beside the decode step (issue 17; SeqMoE §8.2 keeps the predictor off the critical path by
running it on the device inside the captured step, which the Python runtime on a CPU cannot do).

``ForecastFeed`` runs a predictor at its trigger layer and hands the forecast over before that layer is planned, so
the decode step waits for the predictor. ``LaggedFeed`` submits the trigger layer's routing to a prediction source
and hands the forecast over ``lag`` MoE layers later, before that layer is planned: at position
``step * L + layer``, a forecast triggered at position ``p`` is handed over at ``p + lag`` (into the next step when
``p + lag`` passes the last layer). With ``PredictorProcess`` as the source, the predictor computes in another
process while the next ``lag`` layers compute; the step only waits when it is not done by then.

The hand-over positions depend on ``lag`` alone, never on timing, so the decisions are deterministic and the
simulator replays them with ``InlinePredictions`` (``sim.forecasts.forecast_stream(..., lag=...)``): the same
positions, the same forecasts (both sources run ``PredictorRunner.predict`` on the same numpy path).

What ``lag`` costs: SeqMoE's two predictors per model trigger at the middle and the last MoE layer and forecast
the *next* step, whose earliest deadline is at least half a step away; a lag of a few layers delays the eviction
scores and the prefetch tasks by those layers. Forecasts still pending when a request ends are dropped (the next
request starts from its prefill).
"""

from __future__ import annotations

import multiprocessing
import time
from collections import deque

import numpy as np
import torch

from ..errors import MoeOffloadError
from .runtime import Forecast, PredictorRunner, PredictorStats, RangeRouting

#: seconds a ``PredictorProcess`` waits for its worker to start (importing torch in a fresh interpreter)
START_TIMEOUT_S = 120.0


class InlinePredictions:
    """A prediction source that computes each forecast at once, in this process (the simulator's source).

    Args:
        runner: the ``PredictorRunner`` that computes (its ``rollout`` / ``rollout_every`` apply).
    """

    def __init__(self, runner: PredictorRunner):
        self.runner = runner

    def begin_step(self, request: int, step: int) -> None:
        """A forward pass begins (0 = the request's prefill)."""
        self.runner.begin_step(request, step)

    def submit(self, i: int, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> np.ndarray:
        """Predictor ``i``'s forecast probs (float32 ``[1 + c, n, e]``) from its range's routing ``[T, n, k]``."""
        return self.runner.predict(i, top_k_index, top_k_weights).probs.numpy()

    def result(self, handle: np.ndarray) -> np.ndarray:
        """The probs of a submission (computed already)."""
        return handle

    def close(self) -> None:
        """Nothing to release."""


def _serve(conn, header, state: dict, rollout: int, rollout_every: int) -> None:
    """The worker process of ``PredictorProcess``: rebuild the predictor set, then answer each
    ``(forward pass number, request, step, i, ids, weights)`` with predictor ``i``'s probs until it receives None."""
    try:
        torch.set_num_threads(1)
        from .model import PredictorSet

        pset = PredictorSet(header)
        pset.load_state_dict({k: torch.from_numpy(v) for k, v in state.items()})
        runner = PredictorRunner(pset.eval(), rollout=rollout, rollout_every=rollout_every)
        conn.send(("ready", None))
        last = -1
        while (msg := conn.recv()) is not None:
            forward, request, step, i, ids, w = msg
            if forward != last:  # the first submission of a forward pass
                runner.begin_step(request, step)
                last = forward
            conn.send(("ok", runner.predict(i, torch.from_numpy(ids), torch.from_numpy(w)).probs.numpy()))
    except (EOFError, OSError, KeyboardInterrupt):  # the main process closed the pipe or exited
        return
    except Exception as e:  # reported to the main process, which raises it as a MoeOffloadError
        try:
            conn.send(("error", f"{type(e).__name__}: {e}"))
        except OSError:
            pass


class PredictorProcess:
    """A prediction source that runs the predictors in a worker process (started with ``spawn``; one intra-op
    thread), fed through a pipe: ``submit`` sends a trigger layer's routing and returns at once, ``result`` waits
    for the answer. Answers come in submission order.

    Args:
        pset: the predictor set (CPU; its weights are copied to the worker).
        rollout, rollout_every: as ``PredictorRunner``.
    Raises:
        MoeOffloadError: the worker did not start within ``START_TIMEOUT_S`` seconds or reported an error (also from
            ``result``: the worker failed or exited).
    """

    def __init__(self, pset, rollout: int, rollout_every: int):
        if any(p.device.type != "cpu" for p in pset.parameters()):
            raise MoeOffloadError("the predictor process runs CPU predictors only")
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        state = {k: v.detach().numpy() for k, v in pset.state_dict().items()}
        self._proc = ctx.Process(target=_serve, args=(child, pset.header, state, rollout, rollout_every),
                                 name="moe-offload-predictor", daemon=True)
        self._proc.start()
        child.close()
        self._step = (-1, -1, 0)   # (forward pass number, request, step)
        self._sent = deque()   # handles of the submissions not answered yet, oldest first
        self._next = 0
        if not self._conn.poll(START_TIMEOUT_S):
            self.close()
            raise MoeOffloadError(f"the predictor process did not start within {START_TIMEOUT_S:.0f} s")
        self._answer()

    def _answer(self):
        try:
            kind, payload = self._conn.recv()
        except (EOFError, OSError):
            raise MoeOffloadError("the predictor process exited unexpectedly") from None
        if kind == "error":
            raise MoeOffloadError(f"the predictor process failed: {payload}")
        return payload

    def begin_step(self, request: int, step: int) -> None:
        """A forward pass begins (sent with its first submission)."""
        self._step = (self._step[0] + 1, request, step)

    def submit(self, i: int, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> int:
        """Send predictor ``i``'s routing ``[T, n, k]`` (int64 ids, float32 weights) to the worker; returns a
        handle for ``result``."""
        self._conn.send((*self._step, i, top_k_index.cpu().numpy(), top_k_weights.float().cpu().numpy()))
        h = self._next
        self._next += 1
        self._sent.append(h)
        return h

    def result(self, handle: int) -> np.ndarray:
        """The probs (float32 ``[1 + c, n, e]``) of submission ``handle``, waiting for the worker if needed; the
        answers of older submissions not asked for are dropped.

        Raises:
            MoeOffloadError: the worker was closed, failed or exited, or ``handle`` is not pending."""
        if self._proc is None:
            raise MoeOffloadError("the predictor process is closed")
        while self._sent:
            h = self._sent.popleft()
            probs = self._answer()
            if h == handle:
                return probs
        raise MoeOffloadError(f"no pending prediction {handle}")

    def close(self) -> None:
        """Stop the worker (waits up to 5 s, then terminates it)."""
        if self._proc is None:
            return
        try:
            self._conn.send(None)
        except (OSError, ValueError):
            pass
        self._proc.join(5.0)
        if self._proc.is_alive():
            self._proc.terminate()
            self._proc.join()
        self._conn.close()
        self._proc = None
        self._sent.clear()


class LaggedFeed:
    """Engine observer that hands each forecast to its consumers ``lag`` MoE layers after its trigger layer (module
    docstring); the counterpart of ``predictor.runtime.ForecastFeed`` (``lag = 0`` hands over at the trigger layer,
    as it does).

    Args:
        source: ``InlinePredictions`` or ``PredictorProcess``.
        pset: the predictor set (its layer ranges and ``header.num_moe_layers``).
        consumers: objects with ``observe(forecast)``, called in this order.
        lag: MoE layers between a trigger and the hand-over (>= 0).
        rollout: the source's recursive steps (reported as ``rollout``).
    Attributes:
        stats: ``PredictorStats`` of this process's side: submitting, and waiting for late answers.
        receive_s: seconds of ``stats.decode_s`` spent taking answers at their hand-over positions (receiving them,
            and waiting for those not ready yet).
    Raises:
        MoeOffloadError: ``lag < 0``.
    """

    def __init__(self, source, pset, *consumers, lag: int, rollout: int):
        if lag < 0:
            raise MoeOffloadError(f"the predictor lag must be >= 0 MoE layers, got {lag}")
        self.source, self.consumers, self.lag, self.rollout = source, consumers, lag, rollout
        self.L = pset.header.num_moe_layers
        self._ranges = [p.spec.layers for p in pset.predictors]
        self._routing = RangeRouting(self._ranges)
        self._pending: deque = deque()   # (hand-over position, handle, Forecast without probs), oldest first
        self.request, self.step = -1, 0
        self.stats = PredictorStats()
        self.receive_s = 0.0

    def begin_step(self, request: int, step: int) -> None:
        """Before each forward pass (0 = prefill): a new request drops the previous one's pending forecasts."""
        if step == 0:
            self._pending.clear()
        else:
            self.stats.decode_steps += 1
        self.request, self.step = request, step
        self.source.begin_step(request, step)

    @torch.no_grad()
    def __call__(self, layer: int, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> None:
        """Engine observer call at MoE ``layer`` (``[T, k]`` ids and weights), before the layer is planned: submit a
        trigger layer's routing, then hand over every forecast due at this position."""
        t0 = time.perf_counter()
        pos = self.step * self.L + layer
        hit = self._routing.by_layer.get(layer)
        full = None if hit is None else self._routing.add(hit, top_k_index, top_k_weights)
        if full is not None:
            i = full[0]
            self._pending.append((pos + self.lag, self.source.submit(*full),
                                  Forecast(self.request, self.step, self._ranges[i], None)))
            if self.step == 0:
                self.stats.prefill_calls += 1
            else:
                self.stats.decode_calls += 1
        due = []
        if self._pending and self._pending[0][0] <= pos:
            t1 = time.perf_counter()
            while self._pending and self._pending[0][0] <= pos:
                _, h, f = self._pending.popleft()
                f.probs = self.source.result(h)
                due.append(f)
            if self.step:
                self.receive_s += time.perf_counter() - t1
        dt = time.perf_counter() - t0
        if self.step == 0:
            self.stats.prefill_s += dt
        else:
            self.stats.decode_s += dt
        for f in due:
            for c in self.consumers:
                c.observe(f)

    def close(self) -> None:
        """Release the source (stops a ``PredictorProcess``)."""
        self._pending.clear()
        self.source.close()
