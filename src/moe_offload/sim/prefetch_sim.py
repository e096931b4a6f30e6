"""Trace replay with prefetching over a link that overlaps compute (SeqMoE §4 pipeline, §6, §7, §8.3).

Time is counted in *layer times*: one MoE layer's FullLoad compute takes 1. The host->device link moves
``link_epl`` experts per layer time (SeqMoE §2.2: ~1.39 for Qwen3-30B-A3B-FP8 on an RTX 4090 over PCIe 4.0), one
copy at a time in FIFO order. For each layer, in the runtime's order:

1. land the prefetches whose copy finished by now (Fetch -> Compute, ``SlotTable.land``);
2. hand the forecasts this layer triggers to the policy (``observe``) and turn them into prefetch tasks
   (``core.prefetch.tasks_from_forecast``: k + 3 tasks per layer, conf, ddl) for the scheduler; a cross-layer
   forecast only once the layer is planned (``core.forecast.triggered``);
3. plan the layer (``plan_layer(..., hold=True)``): hits, in-flight experts to wait for, on-demand loads; the
   layer stalls until its waits and loads are done. On-demand loads pause prefetching (§8.3): a prefetch copy in
   flight that the layer does not wait for yields the link at its next chunk boundary (a copy moves in
   ``LINK_CHUNKS`` chunks; ``preempt``: chunks of that share of a copy, the disk tier's) and resumes after the
   loads; when the layer waits for an in-flight copy, the loads queue behind it;
4. compute for 1 layer time, during which the link runs the scheduler's choices (``select(pos)``) back to back;
   each one reserves a Fetch slot (``SlotTable.prefetch``, evicting a Used expert by the policy) and lands when
   its copy finishes; the tasks are created while the layer's own experts are still in Compute, so a prefetch
   never overwrites an expert the layer computes with (SeqMoE §4 order), and then the layer's Compute slots
   become Used (``release(layer)``). In a prefill with a popularity profile (``prefill_popularity``) the link
   instead runs the next layers' most popular experts (SeqMoE §8.4) with ``e`` slots kept out of Fetch; a prefill
   layer is counted as 1 layer time like a decode layer (conservative: a long prompt's layer hides more copies).

The scheduler, the policy and the slot table are the objects the runtime uses. In-flight experts a layer needs
count as misses (SeqMoE §9.1: a hit is resident before on-demand loading) and are reported as ``late``.

The costs the runtime pays on its cores (``CoreCosts``, issue 47 part 4; all 0 unless given, as on a GPU whose
copies run on a DMA engine): each decode MoE layer's forecast and management work (``overhead``) and each
prefetch copy's CPU (``prefetch_cpu``), both taken from the compute, so they lengthen the layer they fall in; and
each expert's staging copy after its read (``copy``), which keeps the copy engine busy as long as the link. The
decode speed projection is ``FullLoad time / (FullLoad time + stalls + those costs)`` over decode steps. A
``+gate`` policy's gate is the runtime's: a ``core.prefetch_cost.CostMeter`` fed each step what this replay
measured (a miss's stall, a prefetch's CPU, the share of the step spent stalled, the prefetches used and wasted).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

from ..core.prefetch import LINK_CHUNKS, link_time_after_chunk, make_scheduler, position, submit_forecast
from ..core.forecast import triggered
from ..core.prefetch_cost import CostMeter, UseLedger
from ..core.prefill_prefetch import PrefillPrefetch
from ..core.slots import SlotTable
from ..errors import MoeOffloadError
from ..trace.format import Trace
from ..core.policy_spec import PolicySpec, parse_policy
from ..core.replay import ReplayResult
from .simulator import build_policy, layer_needs



@dataclass(frozen=True)
class CoreCosts:
    """What the runtime's decode step spends on the compute's cores besides computing, in layer times (one MoE
    layer's FullLoad compute = 1), as measured on a machine (``bench decode`` takes them from each row's own
    account, ``runtime.cpu_account``).

    Attributes:
        overhead: per decode MoE layer, the forecasts' and the slot management's time on the compute's thread.
        prefetch_cpu: per prefetch copy, the CPU its reads and staging copy take from the compute.
        copy: per expert copied (on demand or prefetched), the staging copy into its slot after the read: the copy
            engine's time on top of the link's ``1 / link_epl`` (0 where reads land in the slot).
    Raises:
        MoeOffloadError: a negative or non-finite value.
    """

    overhead: float = 0.0
    prefetch_cpu: float = 0.0
    copy: float = 0.0

    def __post_init__(self):
        for name in ("overhead", "prefetch_cpu", "copy"):
            v = getattr(self, name)
            if not (v >= 0.0 and v != float("inf")):
                raise MoeOffloadError(f"{name} must be >= 0 layer times, got {v}")


@dataclass
class PrefetchReplayResult(ReplayResult):
    """Totals of one replay with prefetching: ``ReplayResult``'s counts (distinct experts per layer execution; no
    ``per_step``) plus the prefetch and time counts (times in layer times).
    ``decode_fraction_of_full_load`` = decode FullLoad time / (that + decode stalls + decode ``CoreCosts``)."""

    decode_late: int = 0
    prefetches: int = 0
    prefill_prefetches: int = 0
    prefetches_used: int = 0
    on_demand_loads: int = 0
    decode_layers: int = 0
    decode_stall: float = 0.0
    decode_overhead: float = 0.0
    decode_prefetches: int = 0

    @property
    def decode_fraction_of_full_load(self) -> float:
        if not self.decode_layers:
            return 1.0
        return self.decode_layers / (self.decode_layers + self.decode_stall + self.decode_overhead)

    @property
    def prefetch_accuracy(self) -> float:
        """Share of landed-or-adopted prefetches that a layer then needed."""
        return self.prefetches_used / self.prefetches if self.prefetches else 0.0


def replay_with_prefetch(trace: Trace, num_slots: int, policy: PolicySpec | str, link_epl: float, forecasts=None,
                         scheduler: str | None = "jsd", needs=None, reserve: int = 1,
                         prefill_popularity=None, costs: CoreCosts | None = None,
                         preempt: float = 1.0 / LINK_CHUNKS) -> PrefetchReplayResult:
    """Replay ``trace`` with ``num_slots`` slots, eviction ``policy`` and, when ``scheduler`` is given, prefetching
    from the predictor's ``forecasts`` (``sim.forecasts.forecast_stream``) over a link of ``link_epl`` experts
    per layer time.

    Args:
        policy: the eviction policy (``simulator.build_policy``: a forecast-driven one is probabilistic Belady, fed
            the forecasts).
        link_epl: experts the link copies per layer compute time (> 0).
        scheduler: ``jsd`` (SeqMoE), ``moe-infinity``, ``promoe``, or None (no prefetching: on-demand only).
        reserve: slots a decode prefetch never takes (kept for on-demand misses).
        prefill_popularity: ``[L, E]`` offline expert popularity: prefills prefetch by it (SeqMoE §8.4, keeping
            ``e`` slots free), as the runtime's ``Prefetcher.set_prefill_popularity``; None: no prefill prefetching.
        costs: the runtime's ``CoreCosts`` on this machine (None: none, copies beside the compute as a GPU's DMA
            engine); charged to the clock, and measured by a ``+gate`` policy's gate (module docstring).
        preempt: as ``replay_policy``'s.

    Raises:
        MoeOffloadError: ``link_epl <= 0``, ``preempt`` outside (0, 1], prefetching or a forecast-driven policy
            without forecasts.
    """
    if not link_epl > 0:
        raise MoeOffloadError(f"link bandwidth must be > 0 experts per layer time, got {link_epl}")
    needs = needs if needs is not None else layer_needs(trace)
    pol = build_policy(policy, trace, num_slots, needs)
    if forecasts is None and (scheduler is not None or hasattr(pol, "observe")):
        raise MoeOffloadError("prefetching and forecast-driven eviction need a predictor's forecasts")
    L, E = trace.num_moe_layers, trace.num_experts
    table = SlotTable(num_slots, L * E, pol, experts_per_layer=E, reserve=reserve)
    sched = make_scheduler(scheduler, num_moe_layers=L, b_avg=link_epl, auto_ema=False) if scheduler else None
    if sched is not None:  # the runtime's candidates, found natively when the kernels are built (the same ones)
        from ..runtime.kernels import forecast_candidates_kernel

        sched.candidates_kernel = forecast_candidates_kernel(build=False)
    if not 0.0 < preempt <= 1.0:
        raise MoeOffloadError(f"preempt must be a share of one copy in (0, 1], got {preempt}")
    # a miss takes the link at a prefetch's next chunk boundary: it waits at most ``preempt`` of a copy
    meter = (CostMeter(contention=1.0, preempt=preempt) if sched is not None and parse_policy(policy).gated
             else None)
    if meter is not None:
        sched.ledger = UseLedger()
    name = policy if scheduler is None else f"{policy}+{scheduler}"
    prefill = None if prefill_popularity is None or sched is None else PrefillPrefetch(prefill_popularity, L, E)
    replay = _LinkReplay(trace, table, sched, prefill, PrefetchReplayResult(policy=name, num_slots=num_slots),
                         link_epl, costs or CoreCosts(), preempt)
    for i, (req, step, needed, tokens) in enumerate(needs):
        if meter is not None:
            replay.meter_step(meter)
        table.begin_step(req, step)
        if step == 0 and sched is not None:
            sched.reset()
        events = forecasts[i] if forecasts is not None else ()
        for p in range(L):
            replay.layer(step, p, needed[p], tokens[p], events)
    res = replay.res
    res.accesses = res.hits + res.misses
    return res


class _LinkReplay:
    """The clock, the link and the copies in flight of one ``replay_with_prefetch`` (times in layer times): one MoE
    layer at a time, its forecasts fed, its misses copied on demand (a prefetch in flight yields the link at its
    next chunk boundary, SeqMoE §8.3), then the link's spare time until the layer ends filled with prefetches."""

    def __init__(self, trace: Trace, table: SlotTable, sched, prefill, res: PrefetchReplayResult, link_epl: float,
                 costs: CoreCosts, preempt: float = 1.0 / LINK_CHUNKS):
        self.L, self.E, self.k = trace.num_moe_layers, trace.num_experts, trace.top_k
        self.costs = costs
        # this step so far: on-demand loads, stall, prefetches started, its start (``meter_step``)
        self.step_loads, self.step_stall, self.step_prefetches, self.step_t0 = 0, 0.0, 0, 0.0
        self.step_decode = False
        self.table, self.sched, self.prefill, self.res = table, sched, prefill, res
        self.observe = getattr(table.policy, "observe", None)
        self.d = 1.0 / link_epl + costs.copy  # one expert copy: its read, then its staging copy
        self.chunk = self.d * preempt  # a miss takes the link at a prefetch's next chunk boundary
        self.now = self.link_free = 0.0
        self.inflight: list[tuple[float, int, int, int]] = []     # heap of (finish, eid, slot, tag)
        self.finish_of: dict[int, float] = {}
        self.prefetched: set[int] = set()     # landed/adopted prefetches not yet needed by a layer
        self.prefill_reserve = min(self.E, table.num_slots)

    def meter_step(self, meter: CostMeter) -> None:
        """A step begins: feed ``meter`` what the step that ended measured (a decode step's; ``CostMeter.observe``,
        in layer times) and make its cost the scheduler's gate, as the runtime's prefetcher does."""
        sched = self.sched
        if self.step_decode:
            meter.observe(self.step_loads, self.step_stall, self.step_prefetches,
                          self.step_prefetches * self.costs.prefetch_cpu, step_wall_s=self.now - self.step_t0,
                          settled=sched.ledger.take())
            sched.gate = meter.cost
        else:
            sched.ledger.take()  # a prefill's settlements are not a decode step's
        self.step_loads, self.step_stall, self.step_prefetches, self.step_t0 = 0, 0.0, 0, self.now

    def start(self, ld, t0: float) -> float:
        """Queue prefetch ``ld`` on the link from ``t0`` (after what it carries); returns when it lands."""
        fin = max(self.link_free, t0) + self.d
        heapq.heappush(self.inflight, (fin, ld.eid, ld.slot, ld.tag))
        self.finish_of[ld.eid] = fin
        self.prefetched.add(ld.eid)
        self.res.prefetches += 1
        return fin

    def land_until(self, t: float) -> None:
        """Land every copy that finished by ``t``."""
        while self.inflight and self.inflight[0][0] <= t:
            _, eid, slot, tag = heapq.heappop(self.inflight)
            self.finish_of.pop(eid, None)
            self.table.land(eid, slot, tag, ok=True)

    def layer(self, step: int, p: int, needed, tokens, events) -> None:
        """Run MoE layer ``p`` of decode step ``step`` (0: prefill) needing experts ``needed``; ``events``: the
        step's ``(trigger layer, forecast)`` pairs."""
        table, res = self.table, self.res
        self.land_until(self.now)
        self.hand_over(triggered(events, p, planned=False))
        if self.prefetched:  # prefetched experts this layer finds resident or in flight
            res.prefetches_used += sum(1 for e in needed
                                       if e in self.prefetched and (table.is_resident(e) or table.in_flight(e)))
            self.prefetched.difference_update(needed)
        if self.sched is not None and self.sched.ledger is not None:
            self.sched.ledger.settle(position(step, p, self.L), needed)
        plan = table.plan_layer(needed, tokens, layer=p, hold=True)
        self.hand_over(triggered(events, p, planned=True))
        ready = self.on_demand(plan)
        stall = ready - self.now
        self.now = ready
        res.hits += plan.hits
        res.misses += plan.misses
        decode = step > 0
        overhead = self.costs.overhead if decode else 0.0
        end = self.now + 1.0 + overhead
        started = res.prefetches
        self.prefetch_until(step, p, end)
        started = res.prefetches - started
        table.release(p)  # after creating this layer's prefetches: they never evict what it computes with
        cpu = started * self.costs.prefetch_cpu if decode else 0.0  # the copies started take CPU from the layer
        if decode:
            res.decode_hits += plan.hits
            res.decode_misses += plan.misses
            res.decode_late += plan.late
            res.decode_layers += 1
            res.decode_stall += stall
            res.decode_overhead += overhead + cpu
            res.decode_prefetches += started
        self.step_decode = decode
        self.step_loads += plan.num_loads
        self.step_stall += stall
        self.step_prefetches += started
        self.now = end + cpu

    def hand_over(self, forecasts: list) -> None:
        """Give each forecast to the policy (``observe``) and to the scheduler (``submit_forecast``), in order."""
        for f in forecasts:
            if self.observe is not None:
                self.observe(f)
            if self.sched is not None:
                submit_forecast(self.sched, f, self.L, self.E, self.k, table=self.table)

    def on_demand(self, plan) -> float:
        """Copy ``plan``'s misses on demand; returns when the layer has every expert (copies it waits for
        included)."""
        now, inflight = self.now, self.inflight
        ready = now
        for w in plan.waits:
            ready = max(ready, self.finish_of.get(w.eid, now))
        n_loads = plan.num_loads
        self.res.on_demand_loads += n_loads
        if not n_loads:
            return ready
        waited = {w.eid for w in plan.waits}
        cur = next((e for e in inflight if e[0] > now and e[1] not in waited), None)
        if cur is not None and not waited:  # yield the link at the copy's next chunk boundary (§8.3)
            rem = cur[0] - now
            after = link_time_after_chunk(rem, self.chunk)
            loads_done = now + (rem - after) + n_loads * self.d
            inflight.remove(cur)
            inflight.append((loads_done + after,) + cur[1:])
            heapq.heapify(inflight)
            self.finish_of[cur[1]] = self.link_free = loads_done + after
            return max(ready, loads_done)
        self.link_free = max(self.link_free, now) + n_loads * self.d
        return max(ready, self.link_free)

    def prefetch_until(self, step: int, p: int, end: float) -> None:
        """Fill the link until ``end`` with prefetches: by popularity in a prefill (keeping ``E`` slots free),
        else the scheduler's choices at layer ``p``'s position."""
        table = self.table
        if step == 0 and self.prefill is not None:
            for eid in self.prefill.candidates(p):
                if self.link_free >= end or table.num_protected + 1 > table.num_slots - self.prefill_reserve:
                    break
                ld = table.prefetch(eid, reserve=self.prefill_reserve)
                if ld is not None:
                    self.link_free = self.start(ld, self.now)
                    self.res.prefill_prefetches += 1
        elif self.sched is not None:
            pos = position(step, p, self.L)
            while self.link_free < end:
                task = self.sched.select(pos)
                if task is None:
                    break
                ld = table.prefetch(task.eid)
                if ld is not None:
                    self.link_free = self.start(ld, self.now)


def link_fraction(res: ReplayResult, trace: Trace, link_epl: float, costs: CoreCosts | None = None) -> float:
    """Decode speed as a fraction of FullLoad under this module's link model for a replay without prefetching
    (``simulator.replay``): every decode miss stalls its layer by ``1 / link_epl + costs.copy`` layer times (the
    link is idle at layer start) and every decode layer pays ``costs.overhead``, so the fraction is ``decode layers
    / (decode layers x (1 + overhead) + decode misses x (1 / link_epl + copy))``."""
    layers = int((res.per_step.step > 0).sum()) * trace.num_moe_layers
    c = costs or CoreCosts()
    return layers / (layers * (1.0 + c.overhead) + res.decode_misses * (1.0 / link_epl + c.copy)) if layers else 1.0


def replay_policy(trace: Trace, policy: PolicySpec | str, num_slots: int, link_epl: float | None, forecasts=None,
                  prefill_popularity=None, needs=None, on_loads=None,
                  costs: CoreCosts | None = None,
                  preempt: float = 1.0 / LINK_CHUNKS) -> tuple[ReplayResult, float | None]:
    """One policy's replay as ``simulate`` and ``bench decode`` run it: a policy with a prefetch scheduler
    (``PolicySpec.prefetch``: the SeqMoE pipelines; ``seqmoe-oracle`` fed perfect forecasts,
    ``sim.forecasts.oracle_stream``; ``xl`` / ``seqmoe-xl`` fed cross-layer forecasts, ``sim.forecasts.xl_stream``)
    through ``replay_with_prefetch``, every other policy through ``simulator.replay`` (a forecast-driven one fed
    ``forecasts``).

    Args:
        policy: a ``core.policy_spec.PolicySpec`` (a name is parsed).
        link_epl: link speed in experts per layer time; None: no speed projection.
        forecasts: ``sim.forecasts.forecast_stream`` of ``trace`` (for the forecast-driven policies).
        prefill_popularity: the predictor's ``[L, E]`` prefill popularity (SeqMoE §8.4) or None.
        on_loads: ``simulator.replay``'s hook for a tier below the slots (not for the prefetching pipelines).
        costs: the runtime's ``CoreCosts`` on the machine projected for (None: none).
        preempt: the share of one copy an on-demand copy waits behind a prefetch in flight, in (0, 1] (the chunk a
            prefetch yields the link at: the emulated link's ``1 / LINK_CHUNKS``; the disk tier's
            ``DiskStore.preempt_share``).
    Returns:
        ``(result, decode fraction of FullLoad under the link model or None)``.
    Raises:
        MoeOffloadError: unknown policy, or a forecast-driven one without ``forecasts``; prefetching without
            ``link_epl`` or with ``on_loads``.
    """
    from .simulator import replay

    spec = parse_policy(policy)
    if spec.prefetch:
        if link_epl is None:
            raise MoeOffloadError(f"--policy {spec.name} needs a link speed")
        if on_loads is not None:
            raise MoeOffloadError(f"--policy {spec.name} prefetches over one link: the host cache tier is projected "
                                  "for the history policies only")
        pr = replay_with_prefetch(trace, num_slots, spec, link_epl, forecasts=forecasts, scheduler=spec.prefetch,
                                  needs=needs, prefill_popularity=prefill_popularity, costs=costs, preempt=preempt)
        return pr, pr.decode_fraction_of_full_load
    res = replay(trace, num_slots, spec, needs=needs, forecasts=forecasts if spec.forecast_driven else None,
                 on_loads=on_loads)
    return res, (link_fraction(res, trace, link_epl, costs) if link_epl else None)
