"""Graph mode's prefetcher: a CPU worker thread that talks to the compiled decode step only through a shared control
region (SeqMoE §8.3), so the step never waits for it and never synchronises with the host.

The control region (``ControlRegion``, int64 CPU tensors the worker reads and writes through numpy views; on CUDA
they would be pinned, mapped host memory):

* ``step``, ``request``: the forward pass in progress (written by the host before each step);
* ``layer``: the MoE layer computing now: the inference position (written by the step);
* ``pause``: 1 while the step loads missed experts on demand (new prefetch copies wait: §8.3's pause flag);
* ``requests [R]``: prefetch requests, ``expert id + 1`` (0: free), written by the worker into free entries;
  at each MoE layer the step takes every filled entry (in index order) and frees it (the worker never writes a
  filled entry, so nothing is taken twice or lost);
* ``grant [S]``: per slot, ``tag << GRANT_SHIFT | expert`` of its latest reservation (written by the step: "the
  GPU assigns each new task a slot and binds its tag to that slot");
* ``done_tag [S]``: per slot, the tag of the last copy the worker finished (the step lands a Fetch slot only when
  this equals its expected tag; a stale tag changes nothing).

The step reads and writes the region only through copies taken before the compiled graph starts and inside the
experts op of each MoE layer (``moe_offload::slot_experts_fetching``, ``runtime.graph.engine``), never by tensor
ops on the region in the graph: a compiled graph applies its mutations of input tensors when it ends, may read an
input once for all layers, or read it again in several kernels while the worker changes it. So per MoE layer l:
land the copies whose tags the region showed (layer 0: the copy ``begin_step`` took; later layers: the snapshot
the previous layer's op returned), plan (the layer adopts in-flight experts it needs), reserve slots for the
requests in that snapshot (``FetchingGraphCache.reserve_slots``) and release the layer; then the op publishes the
position, the grants and a forecast made at this layer, frees the taken requests, waits for the adopted experts
(until the worker returns the tag of the slot's grant), raises the pause flag while it loads misses, computes, and
returns a new snapshot of ``done_tag`` and ``requests`` for layer l + 1.

The worker loop: turn each forecast the op posted (``GraphPredictor.probs`` of a trigger layer) into prefetch
tasks (``core.prefetch.submit_forecast``); copy every granted slot whose tag it has not returned yet, in tag order,
and return the tag; while fewer than ``max_outstanding`` requests and copies are pending and the step is not
paused, ask the scheduler (JSD: SeqMoE Algorithm 1) for the next task at the current position and write it into a
free request entry.

Decisions: the slot states, reservations and landings are ``FetchingGraphCache``'s (= ``SlotTable``'s). Which
tasks are requested, and at which layer a copy lands, depend on the worker's timing, so a graph-mode run with
prefetching is lossless (every expert a layer computes with is in its slot: needed experts in flight are waited
for) but its hit counts are not replayed exactly by the simulator.
"""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import numpy as np
import torch

from ...common.threads import pin_io_thread
from ...core.prefetch import PrefetchScheduler, position, submit_forecast
from ...errors import MoeOffloadError
from ...core.forecast import Forecast
from .fetch_cache import FetchingGraphCache

#: ``grant = tag << GRANT_SHIFT | expert``: one int64 store per reservation (experts < 2**24, tags < 2**39)
GRANT_SHIFT = 24
#: the worker's pause between polls when it has nothing to do (seconds): each poll takes the GIL from the step
IDLE_S = 0.0005


class ControlRegion:
    """The shared control region (SeqMoE §8.3). See the module docstring for each field.

    Args:
        num_slots: S; max_requests: R, request entries (``FetchingGraphCache.R``).
    """

    def __init__(self, num_slots: int, max_requests: int):
        z = lambda *shape: torch.zeros(shape, dtype=torch.long)  # noqa: E731
        self.step, self.request, self.layer, self.pause = z(), z(), z(), z()
        self.requests = z(max_requests)
        self.grant = z(num_slots)
        self.done_tag = z(num_slots)

    def host(self) -> SimpleNamespace:
        """numpy views sharing the fields' memory (0-d ones too): how the worker and the op's body access them."""
        return SimpleNamespace(**{k: v.numpy() for k, v in vars(self).items()})


class GraphPrefetcher:
    """Prefetching for graph mode: the step's side (traced), the experts op's side, and the CPU worker thread.

    Args:
        engine: the ``GraphEngine`` (its ``cache`` a ``FetchingGraphCache`` on the CPU, its ``store``/``pool``).
        scheduler: a ``core.prefetch`` scheduler (JSD for ``seqmoe``); used by the worker thread only.
        predictor: the ``GraphPredictor`` whose forecasts make the tasks (None: nothing is requested).
        num_moe_layers, num_experts, top_k: L, E, k.
        max_outstanding: requests pending plus copies not finished, at most.
    Attributes:
        requested, copied: requests the worker wrote, copies it finished (the worker's counters); copy_s: seconds it
        spent copying; waited: in-flight experts a layer waited for; failed: the exception that stopped the
        worker, or None; carry: ``(done_tag [S], requests [R])`` int64, the snapshot the last op returned.
    Raises:
        MoeOffloadError: a cache without prefetch states, or one not on the CPU (on CUDA the control region would
        be pinned, mapped host memory: not built).
    """

    def __init__(self, engine, scheduler: PrefetchScheduler, predictor, num_moe_layers: int, num_experts: int,
                 top_k: int, max_outstanding: int = 3):
        if not isinstance(engine.cache, FetchingGraphCache):
            raise MoeOffloadError("graph-mode prefetching needs a FetchingGraphCache")
        if engine.cache.lookup.device.type != "cpu":
            raise MoeOffloadError("graph-mode prefetching (--policy seqmoe with --graph) runs on the CPU only: on CUDA "
                                  "its control region needs pinned, mapped host memory (not built)")
        self.engine, self.cache, self.scheduler, self.predictor = engine, engine.cache, scheduler, predictor
        self.L, self.E, self.k = num_moe_layers, num_experts, top_k
        self.max_outstanding = max_outstanding
        self.ctrl = ControlRegion(self.cache.S, self.cache.R)
        self._host = self.ctrl.host()
        self._start = (self.ctrl.done_tag.clone(), self.ctrl.requests.clone())  # the region as a step starts
        self.carry = self._start
        self.requested = self.copied = self.waited = 0
        self.copy_s = 0.0
        self._posted: list = []  # forecasts the op posted: (step, predictor, probs), taken by the worker
        self._request = -1
        self._stop = threading.Event()
        self.failed: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="moe-offload-graph-prefetch", daemon=True)
        self._thread.start()

    # ---- host side, between steps --------------------------------------------------------------------------

    def begin_step(self, request: int, step: int) -> None:
        """Before each forward pass: publish it in the control region. Raises RuntimeError if the worker died."""
        self.check()
        self._host.request[...] = request
        self._host.step[...] = step
        for mine, live in zip(self._start, (self.ctrl.done_tag, self.ctrl.requests)):
            mine.copy_(live)

    def counts(self) -> dict:
        """The worker's ``requested`` and ``copied``, the cache's ``landed``, the step's ``waited`` (ints, since
        loading)."""
        return {"requested": self.requested, "copied": self.copied, "landed": int(self.cache.landed),
                "waited": self.waited}

    def check(self) -> None:
        """Raise RuntimeError if the worker has died."""
        if self.failed is not None:
            raise RuntimeError(f"the graph-mode prefetch worker failed: {self.failed}") from self.failed

    def close(self) -> None:
        """Stop the worker (pending requests are dropped; Fetch slots stay as they are)."""
        self._stop.set()
        self._thread.join(timeout=5)

    # ---- the step's side (fixed shapes, traced) ----------------------------------------------------------------

    def land(self, layer: int) -> torch.Tensor:
        """Land the copies the region showed before MoE ``layer`` and return the request entries seen with them
        (``[R]`` int64): at layer 0 a copy of the region taken by ``begin_step``, else the last op's snapshot.
        Never the region itself: the worker writes it while the step runs, and a compiled graph may read one input
        in several kernels (inductor did: a request read twice gave a grant for one expert and a reservation for
        another)."""
        done, requests = self._start if layer == 0 else self.carry
        self.cache.land(done)
        return requests

    def reserve(self, layer: int, requests: torch.Tensor):
        """Reserve slots for the filled request entries, then release the layer's Compute slots (its experts were
        protected while reserving). Returns ``(slots [R], grants [R], taken [R] bool)`` for the op: the granted
        slots (S: none) and their ``tag << GRANT_SHIFT | expert``, and the entries taken."""
        c = self.cache
        taken = requests > 0
        eids = torch.where(taken, requests - 1, c.N)
        slots, tags, accepted = c.reserve_slots(eids)
        c.release(layer)
        return slots, torch.where(accepted, (tags << GRANT_SHIFT) | eids, 0), taken

    # ---- the experts op's side (its eager body, host code) -------------------------------------------------------

    def exchange(self, layer: int, slots: torch.Tensor, grants: torch.Tensor, taken: torch.Tensor,
                 forecast: torch.Tensor | None, predictor_index: int) -> None:
        """Publish MoE ``layer``'s position and grants, free the taken request entries, and post the forecast
        predictor ``predictor_index`` made at this layer (``forecast [1 + c, n, e]``; None / -1: none)."""
        h = self._host
        h.layer[...] = layer
        g = grants.numpy()
        ok = np.flatnonzero(g)
        if ok.size:
            h.grant[slots.numpy()[ok]] = g[ok]
        h.requests[taken.numpy()] = 0
        if forecast is not None and predictor_index >= 0:
            self._posted.append((int(h.step), predictor_index, forecast.clone()))

    def granted_tag(self, slot: int) -> int:
        """The tag of ``slot``'s latest reservation (0: never reserved)."""
        return int(self._host.grant[slot]) >> GRANT_SHIFT

    def snapshot(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of ``done_tag`` and ``requests`` for the next layer's landing and reservations."""
        return self.ctrl.done_tag.clone(), self.ctrl.requests.clone()

    # ---- the worker thread ---------------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            pin_io_thread(realtime=False)  # it polls and schedules: never ahead of the compute
            while not self._stop.is_set():
                busy = self._copy_granted()
                busy |= self._take_forecasts()
                busy |= self._request_tasks()
                if not busy:
                    time.sleep(IDLE_S)
        except BaseException as exc:  # reported to the main thread at the next step
            self.failed = exc

    def _copy_granted(self) -> bool:
        """Copy every slot granted under a tag not finished yet, in tag order; return the tags (§8.3)."""
        h = self._host
        grant = h.grant.copy()
        tag = grant >> GRANT_SHIFT
        todo = np.flatnonzero(tag > h.done_tag)
        if not todo.size:
            return False
        store, pool = self.engine.store, self.engine.pool
        dst = pool._bytes
        for s in todo[np.argsort(tag[todo], kind="stable")].tolist():
            t0 = time.perf_counter()
            store.copy_to(int(grant[s]) & ((1 << GRANT_SHIFT) - 1), dst[s] if dst is not None else pool.buf[s])
            self.copy_s += time.perf_counter() - t0
            h.done_tag[s] = tag[s]
            self.copied += 1
        return True

    def _take_forecasts(self) -> bool:
        """Queue the tasks of every forecast the op posted since the last look; a new request first empties the
        scheduler's queue."""
        request = int(self._host.request)
        if request != self._request:
            self._request = request
            self.scheduler.reset()
        if not self._posted:
            return False
        while self._posted:
            step, i, probs = self._posted.pop(0)
            fc = Forecast(request=request, step=step, layers=self.predictor.layers[i], probs=probs)
            submit_forecast(self.scheduler, fc, self.L, self.E, self.k, table=_Residency(self.cache))
        return True

    def _request_tasks(self) -> bool:
        """Write the scheduler's next tasks into free request entries while fewer than ``max_outstanding``
        requests and copies are pending and the step is not paused."""
        h = self._host
        if h.pause or h.step == 0:  # no prefetching during on-demand loads and prefills
            return False
        req = h.requests
        free = np.flatnonzero(req == 0).tolist()
        pending = len(req) - len(free) + int(((h.grant >> GRANT_SHIFT) > h.done_tag).sum())
        if pending >= self.max_outstanding or not free:
            return False
        pos = position(int(h.step), int(h.layer), self.L)
        wrote = False
        for j in free:
            if pending >= self.max_outstanding:
                break
            task = self.scheduler.select(pos)
            if task is None:
                break
            req[j] = task.eid + 1
            self.requested += 1
            pending += 1
            wrote = True
        return wrote


class _Residency:
    """``tasks_from_forecast``'s view of residency (``slot_of``, ``fetching``) from a snapshot of the device cache:
    tasks of resident or in-flight experts are left out (a stale view only costs a refused request)."""

    def __init__(self, cache: FetchingGraphCache):
        self.slot_of = cache.lookup[:-1].tolist()
        fetch = cache.fetch_of[:-1]
        self.fetching = set((fetch >= 0).nonzero().flatten().tolist())
