"""SeqMoE prefetching in the runtime (SeqMoE §4 pipeline, §6, §8.3): forecasts -> tasks -> scheduler -> slot
reservations -> asynchronous copies that land while layers compute.

Per MoE layer the engine calls, in this order (the same order ``sim.prefetch_sim`` replays):

1. ``land_ready()``: apply finished copies (``SlotTable.land``; on success point ``pool.lookup`` at the slot);
2. (the engine plans the layer with ``hold=True``)
3. ``fetch_waits(round.waits)``: needed experts still in flight are waited for (never copied twice);
   ``load_on_demand(round.loads)``: misses are copied through the same link, ahead of queued prefetches, with new
   prefetch copies paused meanwhile (§8.3);
4. ``issue(layer)``: the scheduler's choices (in a prefill with a popularity profile: the next layers' most popular
   experts, SeqMoE §8.4, keeping ``e`` slots out of Fetch) are reserved (``SlotTable.prefetch`` evicts only Used experts, never
   one this layer computes with) and submitted to the ``TransferEngine``; the copies run while the layer computes;
5. (the engine computes, then ``SlotTable.release(layer)``).

A one-token layer reading from the disk tier (``runtime.read_overlap``) runs step 3 on the engine's overlap thread
while the main thread computes the layer's resident experts, then ``issue`` once the reads are over. While step 3
runs there, the main thread calls nothing of the prefetcher but ``observe`` (the layer's cross-layer forecast: it
touches the scheduler and reads the slot table, which the reads never touch): its pending lookup writes are not
synchronised.

Forecasts arrive through ``observe(forecast)`` (a ``predictor.runtime.Forecast``), e.g. from a ``ForecastFeed``.
"""

from __future__ import annotations

import math
import time

import torch

from ..core.prefetch import PrefetchScheduler, position, submit_forecast
from ..core.prefetch_cost import CostMeter, UseLedger
from ..core.prefill_prefetch import PrefillPrefetch
from ..core.slots import Load, SlotTable
from .cpu_account import io
from .kernels import forecast_candidates_kernel
from .pool import SlotPool
from .store import HostStore
from .transfer import TransferEngine


class Prefetcher:
    """Drives one ``TransferEngine`` from a prefetch scheduler and the slot table.

    Args:
        store, pool, table: the engine's host store, slot pool and slot table (with ``experts_per_layer``).
        scheduler: ``core.prefetch`` scheduler (JSD, MoE-Infinity, ProMoE); its ``b_avg`` is experts per layer time.
        transfer: the copy engine (``runtime.transfer.make_transfer_engine``: a ``VirtualLinkEngine`` for a CPU pool,
            else a ``TransferEngine``); its link emulation, if any, also paces on-demand loads.
        num_moe_layers, num_experts, top_k: model geometry (L, e, k).
        max_outstanding: prefetch copies queued or in flight at most (default ``ceil(b_avg) + 1``): more would only
            reserve slots early for copies that cannot start yet.
        meter: a ``core.prefetch_cost.CostMeter`` (a ``+gate`` policy): fed each step's measured copy costs, its
            cost becomes the scheduler's gate (``core.prefetch_cost``); None: every task is queued.
    Attributes:
        prefetches: copies submitted; landed: landings applied; waited: in-flight experts a layer waited for.
        prefill_prefetches: of ``prefetches``, those issued during prefills by popularity (SeqMoE §8.4).
        prefill: the ``core.prefill_prefetch.PrefillPrefetch`` in use (None: prefills prefetch nothing).
    """

    def __init__(self, store: HostStore, pool: SlotPool, table: SlotTable, scheduler: PrefetchScheduler,
                 transfer: TransferEngine, num_moe_layers: int, num_experts: int, top_k: int,
                 max_outstanding: int | None = None, meter: CostMeter | None = None):
        self.store, self.pool, self.table, self.scheduler, self.transfer = store, pool, table, scheduler, transfer
        self.meter = meter
        self._demand = [0, 0.0]       # this step's on-demand experts and the wall seconds spent on them
        self._last_demand_s = 0.0     # the wall seconds of the last load_on_demand
        self._seen_prefetch = (0, 0.0)  # the transfer engine's prefetch copies and their CPU seconds at the last step
        if meter is not None:  # the forecasts' candidates against what the layers used: the gate's calibration
            scheduler.ledger = UseLedger()
        scheduler.candidates_kernel = forecast_candidates_kernel()  # None without the native kernels: numpy's
        self._step_t0 = 0.0             # when the current step began (perf_counter seconds)
        self.L, self.E, self.k = num_moe_layers, num_experts, top_k
        self.max_outstanding = max_outstanding or max(2, math.ceil(scheduler.b_avg) + 1)
        self.step = 0
        self.prefetches = self.landed = self.waited = self.prefill_prefetches = 0
        self.prefill: PrefillPrefetch | None = None
        self._lookup_writes: dict[int, int] = {}  # eid -> slot (-1: evicted), applied at the end of each call

    def set_prefill_popularity(self, popularity) -> None:
        """Enable prefill offloading (SeqMoE §8.4) with an offline ``[L, E]`` expert popularity profile (e.g. a
        predictor's ``header.prefill_popularity``); None disables it. Raises MoeOffloadError for a bad shape."""
        self.prefill = None if popularity is None else PrefillPrefetch(popularity, self.L, self.E)

    def begin_step(self, request: int, step: int) -> None:
        """A forward pass begins; a new request (step 0) drops the previous request's pending tasks. With a cost
        meter, the step that ended feeds it and the scheduler's gate becomes its current cost."""
        if self.meter is not None:
            self._meter_step()
            self._step_t0 = time.perf_counter()
        self.step = step
        if step == 0:
            self.scheduler.reset()

    def _meter_step(self) -> None:
        """Feed the meter the ended step's on-demand copies (their count and wall time, measured here), its
        prefetch copies (their count and the CPU seconds of the thread that ran them: the transfer engine's
        ``prefetch_copies`` / ``prefetch_cpu_s``; on-demand copies run by the same worker are not in them), its wall
        time (decode steps only) and the forecasts' candidates settled in it (``core.prefetch_cost.UseLedger``;
        ``CostMeter.observe``)."""
        st, sched = self.transfer.stats, self.scheduler
        now = time.perf_counter()
        copies0, cpu0 = self._seen_prefetch
        if st.prefetch_copies < copies0:  # the transfer engine's stats were reset
            copies0, cpu0 = 0, 0.0
        settled = sched.ledger.take()
        if self.step == 0:  # a prefill's settlements (many tokens' experts) are not a decode step's, as in the simulator
            settled = (0, 0.0, 0)
        self.meter.observe(self._demand[0], self._demand[1], st.prefetch_copies - copies0, st.prefetch_cpu_s - cpu0,
                           step_wall_s=now - self._step_t0 if self.step >= 1 and self._step_t0 else 0.0,
                           settled=settled)
        self._seen_prefetch, self._demand = (st.prefetch_copies, st.prefetch_cpu_s), [0, 0.0]
        sched.gate = self.meter.cost

    def observe(self, forecast) -> None:
        """Turn a one-step (or cross-layer) forecast into prefetch tasks (SeqMoE §6.1: k + 3 per layer, conf, ddl;
        ``core.prefetch.submit_forecast``)."""
        submit_forecast(self.scheduler, forecast, self.L, self.E, self.k, table=self.table)

    def _set_lookup(self, eid: int, slot: int) -> None:
        self._lookup_writes[eid] = slot

    def _flush_lookup(self) -> None:
        """Apply the recorded ``pool.lookup`` writes in one indexed write (the last write of an expert wins)."""
        w = self._lookup_writes
        if w:
            self.pool.set_lookup(list(w), list(w.values()))
            w.clear()

    def settle(self, layer: int, needed: list[int]) -> None:
        """Layer ``layer`` is about to be planned needing ``needed`` (global expert ids): the forecasts' candidates
        for it are checked against them (``core.prefetch_cost.UseLedger.settle``; only with a cost meter)."""
        ledger = self.scheduler.ledger
        if ledger is not None:
            ledger.settle(position(self.step, layer, self.L), needed)

    def land_ready(self) -> None:
        """Apply every finished prefetch copy (stale tags are ignored by the table)."""
        for ld in self.transfer.poll():
            if self.table.land(ld.eid, ld.slot, ld.tag, ld.ok) and ld.ok:
                self._set_lookup(ld.eid, ld.slot)
                self.landed += 1
        self._flush_lookup()

    def fetch_waits(self, waits: list[Load]) -> None:
        """Block until needed in-flight experts are in their slots (the table adopted them: ``waits``)."""
        for w in waits:
            ld = self.transfer.wait(w.eid)
            if ld is None or not ld.ok or ld.slot != w.slot:  # cancelled or failed: copy it now
                self.transfer.submit(w.eid, w.slot, w.tag, on_demand=True)
                self.transfer.wait(w.eid)
            self._set_lookup(w.eid, w.slot)
            self.waited += 1
        self._flush_lookup()

    def load_on_demand(self, loads: list[Load]) -> None:
        """Copy missed experts now (through the link, ahead of queued prefetches, new ones paused: §8.3): on this
        thread (a CPU pool's ``VirtualLinkEngine.copy_now``: at once, or once a prefetch holding the emulated link
        yields at a chunk; the disk tier's ``TransferEngine.copy_now``: at once, with the store's readers, a
        prefetch read yielding at its next chunk), else by the ``TransferEngine``'s worker ahead of its queue."""
        self._last_demand_s = 0.0
        if not loads:
            return
        t0 = time.perf_counter()
        self.transfer.pause()
        try:
            for ld in loads:
                if ld.evicted >= 0:
                    self._set_lookup(ld.evicted, -1)
            with io(self.store, "on_demand_reads"):
                copied = self.transfer.copy_now([ld.eid for ld in loads], [ld.slot for ld in loads])
            if copied:
                for ld in loads:
                    self._set_lookup(ld.eid, ld.slot)
                return
            for ld in loads:
                self.transfer.submit(ld.eid, ld.slot, ld.tag, on_demand=True)
            for ld in loads:
                got = self.transfer.wait(ld.eid)
                if got is None or not got.ok:
                    raise RuntimeError(f"on-demand copy of expert {ld.eid} failed: {got and got.error}")
                self._set_lookup(ld.eid, ld.slot)
        finally:
            self._flush_lookup()
            self.transfer.resume()
            self._last_demand_s = time.perf_counter() - t0
            self._demand[0] += len(loads)
            self._demand[1] += self._last_demand_s

    def overlapped(self, visible_s: float) -> None:
        """The last ``load_on_demand`` ran while its layer computed (``runtime.read_overlap``) and the step waited
        ``visible_s`` seconds for it: that, not the copies' whole wall time, is what the misses cost the step, and
        what the cost meter is fed (``core.prefetch_cost``: a used prefetch saves a miss's wait)."""
        self._demand[1] -= self._last_demand_s - min(visible_s, self._last_demand_s)
        self._last_demand_s = 0.0

    def issue(self, layer: int) -> None:
        """Reserve and submit the scheduler's next tasks at position (step, ``layer``) up to ``max_outstanding``;
        in a prefill with a popularity profile, the next layers' most popular experts instead (SeqMoE §8.4)."""
        try:
            self._issue(layer)
        finally:
            self._flush_lookup()

    def _issue(self, layer: int) -> None:
        te = self.transfer
        busy = lambda: te.outstanding() >= self.max_outstanding  # noqa: E731
        if self.step == 0 and self.prefill is not None:
            reserve = min(self.E, self.table.num_slots)
            for eid in self.prefill.candidates(layer):
                if busy() or self.table.num_protected + 1 > self.table.num_slots - reserve:
                    return
                if self._start(self.table.prefetch(eid, reserve=reserve)):
                    self.prefill_prefetches += 1
            return
        pos = position(self.step, layer, self.L)
        while not busy():
            task = self.scheduler.select(pos)
            if task is None:
                return
            self._start(self.table.prefetch(task.eid))

    def _start(self, ld: Load | None) -> bool:
        """Submit the copy of a reservation made by ``SlotTable.prefetch`` (None: nothing to do)."""
        if ld is None:
            return False
        if ld.evicted >= 0:
            self._set_lookup(ld.evicted, -1)
        self.transfer.submit(ld.eid, ld.slot, ld.tag)
        self.prefetches += 1
        return True

    def close(self) -> None:
        """Stop the copy worker (queued copies are cancelled)."""
        self.transfer.close()


def lookup_is_consistent(pool: SlotPool, table: SlotTable) -> bool:
    """Debug check: ``pool.lookup`` equals the table's mapping of resident experts (Fetch slots excluded)."""
    want = torch.tensor(table.slot_of, dtype=torch.long)
    return bool(torch.equal(pool.lookup.cpu(), want))
