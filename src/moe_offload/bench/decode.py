"""``moe-offload bench decode``: decode speed across residencies and policies against FullLoad, measured in one run,
next to what the simulator predicts for the same requests under the same link model (issue 17)."""

from __future__ import annotations

import gc
from pathlib import Path

from ..common.threads import io_priority
from ..core.policy_spec import parse_policies, parse_policy, require_predictor
from ..generation.generate import run
from ..models.loader import load_full, load_offloaded
from ..core.forecast import ROLLOUT_EVERY
from ..runtime.cpu_account import account_table
from ..runtime.disk_store import PREFETCH_CHUNK, preempt_share
from ..runtime.emulated_clock import check_skip_device, now, skipping_waits, wait_until
from .decode_rows import DecodeRow, baseline_policy, breakdown_table, median_rows, round_order, rounds_note, table


def bench_decode(path: Path, prompts: list[str], residencies: list[float], *, max_new_tokens: int = 64,
                 device: str | None = None, dtype: str | None = None, policy: list | str = "lru",
                 progress: bool = True, predictor: str | None = None, link_epl: float | None = None,
                 rollout_every: int = ROLLOUT_EVERY, skip_waits: bool = False, predictor_lag: int | None = None,
                 host_store: str = "pinned", rounds: int = 1) -> str:
    """Run FullLoad and then the offloaded model at each residency and policy on the same prompts (greedy).

    Args:
        policy: the policies (``core.policy_spec.PolicySpec``s; a string is parsed by ``parse_policies``: one name or
            several, comma-separated); those a predictor drives need ``predictor``.
        predictor: a trained predictor directory, run with the forecast-driven policies (its time is included).
        rollout_every: decode steps between the predictor's recursive rollouts (``PredictorRunner``).
        link_epl: emulate the link regime in which one layer's FullLoad compute overlaps the transfer of this many
            experts (SeqMoE §2.2: 1.39 for Qwen3-30B-A3B-FP8 on an RTX 4090): the FullLoad run of this very
            benchmark gives the layer time ``t = decode s / (tokens * L)``, and every expert copy (on demand or
            prefetch) then takes at least ``t / link_epl`` seconds. None: copies at this machine's memcpy speed.
            With it, the routing of the benchmark's requests is recorded once (an unmeasured run at residency 1.0)
            and every row also shows the simulator's prediction for it (``sim.prefetch_sim.replay_policy``, the
            same slot count, link speed and predictor settings): the gap to the measured fraction is what the
            runtime loses to its own overhead.
        skip_waits: the emulated copies' waits skipped on a virtual clock instead of slept
            (``runtime.emulated_clock``; CPU only): every timer, tok/s included, reads that clock.
        host_store: "pinned" or "disk" (``runtime.disk_store``: every miss and prefetch a real direct read of the
            checkpoint; the scheduler models the disk as the link, at the bandwidth the this-machine profile's disk
            entry gives for one expert's read at queue depth 1, ``core.disk_link.disk_gbps``; the simulated column
            at the speed the baseline policy's misses were read in this run, ``loaded_disk_links``).
        predictor_lag: None: the predictor runs inside the decode step; else in a process of its own, each forecast
            used this many MoE layers after its trigger layer (``predictor.lagged``; the seqmoe policies but seqmoe-xl), and
            the simulator replays the same hand-over positions.
        rounds: how many times each row is measured (``bench.decode_rows``: interleaved rounds, in the given order
            then reversed, FullLoad first in each; a row shows the medians, its range of tok/s and, with several
            policies, its median per-round ratio to the baseline's at the same residency: ``baseline_policy``).

    Returns a markdown table: policy, residency, slots, decode tok/s, ratio to FullLoad (same run), the simulator's
    ratio, hit rate, bytes loaded, mean TTFT, whether the tokens equal FullLoad's, device expert bytes; then the
    decode-step time breakdown per row. A warm-up request precedes each measurement (each load).

    Raises:
        MoeOffloadError: as ``load_offloaded``; a forecast-driven policy without ``predictor``; ``skip_waits`` on
            a device that is not the CPU; ``predictor_lag`` with ``xl`` or ``seqmoe-xl``; ``host_store`` disk with
            an emulated link or without a measured disk (``bench link --disk``); ``rounds`` below 1.
    """
    from ..errors import MoeOffloadError

    policies = parse_policies(policy) if isinstance(policy, str) else [parse_policy(p) for p in policy]
    require_predictor(policies, predictor)
    if predictor_lag is not None and (not predictor or any(p.cross_layer for p in policies)):
        raise MoeOffloadError("--predictor-lag needs --predictor and runs the SeqMoE predictor alone (seqmoe, "
                              "seqmoe-cacheonly), not with --policy xl or seqmoe-xl")
    if rounds < 1:
        raise MoeOffloadError(f"rounds must be >= 1, got {rounds}")
    disk = _disk_entry(host_store, link_epl)
    full_row, ref_tokens, t_layer, L, expert_bytes = _measure_full(path, prompts, max_new_tokens, device, dtype,
                                                                    progress, skip_waits)
    spe = t_layer / link_epl if link_epl else None
    regime = ""
    if disk is not None:  # the disk is the link: the scheduler's B_avg and the simulator's link from its speed
        link_epl, regime = _disk_link_epl(disk, expert_bytes, t_layer)
        from ..models.expert_pack import find_pack

        pack = find_pack(path, None)
        regime += (f"; from the expert pack {pack.folder} (read straight into the slots)" if pack is not None
                   else "; from the checkpoint's safetensors files (through a staging buffer)")
        if io_priority() == "realtime":
            regime += "; the expert readers under the real-time scheduler (--io-priority realtime)"
    baseline = baseline_policy(policies)

    def measure_full() -> tuple[DecodeRow, list]:
        return _measure_full(path, prompts, max_new_tokens, device, dtype, progress, skip_waits)[:2]

    def measure_cell(pol, r) -> tuple[DecodeRow, dict]:
        with skipping_waits(skip_waits):
            return _measure_policy(path, prompts, max_new_tokens, pol, r, device, dtype, progress, predictor,
                                   link_epl, spe, rollout_every, ref_tokens, predictor_lag, host_store)

    rows, breakdowns = _measure_rounds(rounds, [(pol, r) for pol in policies for r in residencies], baseline,
                                       full_row, ref_tokens, measure_full, measure_cell)
    if spe:
        regime = (f"; emulated link: {link_epl} experts per layer time = {1e6 * spe:.0f} us per expert copy "
                  f"(FullLoad layer time {1e6 * t_layer:.0f} us), its waits "
                  + ("skipped on a virtual clock" if skip_waits else "slept"))
    if link_epl:
        trace = _record_routing(path, prompts, max_new_tokens, device, dtype,
                                xl=any(p.cross_layer for p in policies))
        costs = [core_costs(bd, t_layer, L, expert_bytes) for _, _, bd in breakdowns]
        links = link_epl
        if disk is not None:  # the disk as the baseline read it beside the compute, not as `bench link` found it idle
            links, words = loaded_disk_links(breakdowns, baseline, link_epl, t_layer, costs)
            regime += words
        # the disk tier's chunks: DiskStore.preempt_share's, with the expert's bytes for its mean read (a read of
        # the pack is those bytes rounded up to 4 KiB; of the safetensors files, its spans': within 4 KiB a field)
        preempt = None if disk is None else preempt_share(PREFETCH_CHUNK, expert_bytes)
        _simulate_rows(rows[1:], trace, links, predictor, rollout_every, predictor_lag, costs, preempt)
    lag = ("" if predictor_lag is None else
           f"; in a process of its own, forecasts used {predictor_lag} MoE layers after their trigger layer")
    pred = f", predictor {predictor} (rollout every {rollout_every} steps{lag})" if predictor else ""
    if predictor and any(p.cross_layer and p.needs_predictor for p in policies):  # seqmoe-xl
        from ..predictor.model import load_predictor
        from ..predictor.xl_weights import describe_xl_weights

        pred += f"; seqmoe-xl's cross-layer blend weights {describe_xl_weights(load_predictor(predictor))}"
    base_name = baseline.name if baseline is not None else None
    if rounds > 1:
        regime += "; " + rounds_note(rounds, base_name)
    return "\n".join(table(rows, base_name)
                     + [f"\n{len(prompts)} prompts x {max_new_tokens} new tokens, model {path}" + pred + regime, "",
                        *breakdown_table(breakdowns), "",
                        "Decode step CPU by role (ms per step; copies: CPU (wall), every thread):", "",
                        *account_table([(f"{p} {r:.2f}", b["cpu_account"]) for p, r, b in breakdowns])])


def _measure_full(path, prompts, max_new_tokens, device, dtype, progress, skip_waits):
    """Load FullLoad, measure it and free it: ``(its row, its tokens per prompt, the FullLoad layer time in seconds
    (decode seconds per token per MoE layer), MoE layers, bytes per expert)``.

    Raises:
        MoeOffloadError: as ``load_full``; ``skip_waits`` on a device that is not the CPU (``check_skip_device``)."""
    full = load_full(path, device=device, dtype=dtype)
    try:
        check_skip_device(skip_waits, full.device)
        out, ref = _measure(full, prompts, max_new_tokens, progress)
        row = DecodeRow("FullLoad", "FullLoad", None, None, ref.decode_tokens_per_s, 1.0, None, 0,
                        sum(ref.ttft_s) / len(ref.ttft_s), True,
                        full.num_moe_layers * full.num_experts * full.expert_bytes, 1.0)
        t_layer = ref.decode_s / max(1, ref.decode_tokens) / full.num_moe_layers
        return row, [o.token_ids for o in out], t_layer, full.num_moe_layers, full.expert_bytes
    finally:
        del full
        gc.collect()


def _measure_rounds(rounds: int, cells: list, baseline, full_row: DecodeRow, ref_tokens, measure_full,
                    measure_cell) -> tuple[list[DecodeRow], list[tuple[str, float, dict]]]:
    """Every ``(policy, residency)`` of ``cells`` measured in ``rounds`` rounds by ``measure_cell(policy, residency)
    -> (row, breakdown)`` (``bench.decode_rows``: in the given order in even rounds, reversed in odd ones; FullLoad,
    whose first round is ``full_row``, measured again first in each later round by ``measure_full() -> (row,
    tokens)``) and merged into one row each (``median_rows``, ``vs_baseline`` against ``baseline``). Returns
    ``(rows, breakdowns)``: FullLoad's row then the cells', and ``(policy, residency, breakdown)`` per cell. The
    simulated column's link keeps the first round's FullLoad layer time.

    Raises:
        MoeOffloadError: as ``measure_full`` and ``measure_cell`` (``load_full``, ``load_offloaded``,
            ``attach_forecasts``)."""
    measured: list[list] = [[] for _ in cells]
    full_rows = [full_row]
    for k in range(rounds):
        if k:  # each round's rows are set against its own FullLoad
            again, tokens = measure_full()
            again.same = tokens == ref_tokens
            full_rows.append(again)
        for c in round_order(range(len(cells)), k):
            measured[c].append(measure_cell(*cells[c]))
    full_tok_s = [f.tok_s for f in full_rows]
    merged = median_rows(measured, full_tok_s, baseline)
    (full, _), = median_rows([[(f, {}) for f in full_rows]], full_tok_s)
    full.ratio = full.simulated = 1.0
    return [full] + [row for row, _ in merged], [(row.policy, row.residency, bd) for row, bd in merged]


def _disk_entry(host_store: str, link_epl: float | None) -> dict | None:
    """The this-machine profile's disk entry for ``host_store`` "disk" (None for other stores).

    Raises:
        MoeOffloadError: an unknown store, disk with an emulated link, or a disk never measured.
    """
    from ..errors import MoeOffloadError
    from ..core.disk_link import this_machine_disk

    if host_store not in ("pinned", "disk"):
        raise MoeOffloadError(f"bench decode --host-store is pinned or disk, not {host_store}")
    if host_store != "disk":
        return None
    if link_epl:
        raise MoeOffloadError("--link-regime emulates a link; with --host-store disk the link is the disk itself")
    disk = this_machine_disk()
    if not disk or "table_gbps" not in disk:
        raise MoeOffloadError("--host-store disk models the disk from a measurement: run `moe-offload bench link "
                              "--disk DIR` first (DIR on the checkpoint's filesystem)")
    return disk


def _disk_link_epl(disk: dict, expert_bytes: int, t_layer: float) -> tuple[float, str]:
    """``(experts per FullLoad layer time, the regime's words)`` of the measured disk for ``expert_bytes`` reads at
    queue depth 1 (FullLoad's expert bytes: a quantized checkpoint's stored experts are smaller, so its model is
    conservative)."""
    from ..core.disk_link import disk_gbps

    gbps = disk_gbps(disk, expert_bytes, 1)
    epl = t_layer * gbps * 1e9 / expert_bytes
    return epl, (f"; experts read from disk (direct I/O, real reads): the scheduler models a "
                 f"{gbps:.2f} GB/s link (the measured disk at {expert_bytes / 1024:.0f} KiB requests, queue depth 1) "
                 f"= {epl:.2f} experts per FullLoad layer time ({1e6 * t_layer:.0f} us)")


def _measure(lm, prompts: list[str], max_new_tokens: int, progress: bool):
    """A warm-up request (allocator, kernels; not counted), then the prompts: ``(outputs, RunStats)``."""
    run(lm, prompts[:1], min(8, max_new_tokens))
    return run(lm, prompts, max_new_tokens, progress=progress)


def _measure_policy(path, prompts, max_new_tokens, pol, r, device, dtype, progress, predictor, link_epl, spe,
                    rollout_every, ref_tokens, lag=None, host_store="pinned") -> tuple[DecodeRow, dict]:
    """Load the offloaded model with policy ``pol`` at residency ``r`` (the predictor attached when it needs one,
    the link emulated when ``spe``), measure it, and return its row (``ratio`` left for the caller) and its
    time breakdown."""
    from ..predictor.cross_layer import attach_forecasts
    from ..predictor.model import load_predictor

    lm = load_offloaded(path, device=device, dtype=dtype, residency=r, policy=pol, progress=False,
                        link_epl=link_epl or 2.0, seconds_per_expert=spe, host_store=host_store)
    try:
        if pol.forecast_driven:
            pset = load_predictor(predictor, model_id=lm.model_id, device=lm.device) if pol.needs_predictor else None
            attach_forecasts(lm, pol, pset, rollout_every=rollout_every, lag=lag)
        if spe is not None and lm.engine.prefetcher is None:  # a prefetcher's TransferEngine paces its copies
            _emulate_on_demand(lm, spe)
        outs, s = _measure(lm, prompts, max_new_tokens, progress)
        eng = lm.engine
        row = DecodeRow(eng.policy_name if pol.family == "auto" else pol.name, pol, r, eng.pool.num_slots,
                        s.decode_tokens_per_s, 0.0, s.offload.hit_rate, s.offload.bytes_loaded,
                        sum(s.ttft_s) / len(s.ttft_s), [o.token_ids for o in outs] == ref_tokens, eng.pool.nbytes)
        st = eng.prefetcher.transfer.stats if getattr(eng, "prefetcher", None) is not None else None
        per_copy = st.prefetch_cpu_s / st.prefetch_copies if st is not None and st.prefetch_copies else 0.0
        disk = getattr(eng.store, "stats", None)  # a disk store's DiskReadStats: its misses' reads, prefills too
        reads = sum(getattr(disk, "demand_reads", {}).values())
        demand = {"demand_gbps": disk.demand_gbps, "demand_read_s": disk.demand_s / reads} if reads else {}
        return row, eng.breakdown.as_dict() | {"cpu_account": eng.account.as_dict(eng.breakdown.steps),
                                               "prefetch_cpu_s_per_copy": per_copy} | demand
    finally:
        lm.close()
        del lm
        gc.collect()


class _Renumbered:
    """A trace recorder seen through request numbers shifted by ``offset`` (each ``generation.generate.run`` call numbers its
    requests from 0)."""

    def __init__(self, rec, offset: int):
        self.rec, self.offset = rec, offset

    def start_request(self, index: int, prompt_ids: list[int]) -> None:
        self.rec.start_request(index + self.offset, prompt_ids)

    def end_step(self, step: int) -> None:
        self.rec.end_step(step)


def _record_routing(path, prompts, max_new_tokens, device, dtype, xl: bool = False):
    """The routing of every measured run — the warm-up request, then the prompts — recorded once on an unmeasured
    offloaded run at residency 1.0 (a lossless run routes identically at any residency and policy); with ``xl`` also
    the cross-layer forecasts (``trace collect --xl-forecasts``)."""
    from ..core.forecast import XL_DEPTH
    from ..trace.collect import TraceRecorder

    lm = load_offloaded(path, device=device, dtype=dtype, residency=1.0, policy="lru", progress=False)
    try:
        with TraceRecorder(lm, source="bench decode", xl_depth=XL_DEPTH if xl else 0) as rec:
            run(lm, prompts[:1], min(8, max_new_tokens), recorder=rec)
            run(lm, prompts, max_new_tokens, recorder=_Renumbered(rec, 1))
            return rec.trace()
    finally:
        lm.close()


def core_costs(breakdown: dict, t_layer: float, num_moe_layers: int, expert_bytes: int):
    """The ``sim.prefetch_sim.CoreCosts`` one measured row paid, in FullLoad layer times ``t_layer`` (seconds): per
    decode MoE layer its predictor and management time (``breakdown``'s ms per step); per prefetch copy the CPU the
    transfer engine measured, times the share of the cores the compute uses; per expert copied (``expert_bytes``
    each), the staging copies' wall time (its ``cpu_account``)."""
    from ..common.threads import compute_share
    from ..sim.prefetch_sim import CoreCosts

    ms = breakdown.get("ms_per_step", {})
    overhead = (ms.get("predictor", 0.0) + ms.get("management", 0.0)) * 1e-3 / num_moe_layers / t_layer
    contention = compute_share()
    account = breakdown.get("cpu_account", {})
    staging_ms = sum(roles.get("staging_copies", {}).get("wall", 0.0)
                     for roles in account.get("ms_per_step", {}).values())
    moved = account.get("bytes_per_step", {})
    copies = (moved.get("on_demand", 0.0) + moved.get("prefetched", 0.0)) / expert_bytes
    return CoreCosts(overhead=overhead,
                     prefetch_cpu=breakdown.get("prefetch_cpu_s_per_copy", 0.0) * contention / t_layer,
                     copy=staging_ms * 1e-3 / copies / t_layer if copies > 0 else 0.0)


def loaded_disk_links(breakdowns: list, baseline, link_epl: float, t_layer: float,
                      costs: list) -> tuple[list[float], str]:
    """Each measured row's link for the simulated column when the disk is the link, in experts per FullLoad layer time
    ``t_layer`` (seconds): at the row's residency, the wall time per on-demand expert read of the ``baseline``
    policy's row in this run (``demand_read_s``: its misses, read beside the compute with no prefetch sharing the
    disk; prefills included) less its staging copy, which the simulator charges apart (``CoreCosts.copy``, ``costs``
    aligned with ``breakdowns``); else ``link_epl`` (the disk ``bench link --disk`` measured idle). The runtime read
    the pack at 1.3 GB/s where the idle measurement gave 2.15 (issue 47, session 50): a projection at the idle speed
    missed the stall of the rows that wait most. Returns the links (aligned with ``breakdowns``, ``(policy,
    residency, breakdown)``) and the footer's words."""
    loaded = {}
    for (p, r, bd), c in zip(breakdowns, costs):
        read_s = bd.get("demand_read_s", 0.0)
        if baseline is not None and p == baseline.name and not baseline.prefetch and read_s > 0:
            loaded[r] = (1.0 / max(read_s / t_layer - c.copy, 1e-9), read_s, bd.get("demand_gbps", 0.0))
    links = [loaded[r][0] if r in loaded else link_epl for _, r, _ in breakdowns]
    if not loaded:
        return links, "; the simulated column models the same link"
    said = ", ".join(f"{1e3 * s:.2f} ms per expert read ({g:.2f} GB/s) at {r:.2f}"
                     for r, (_, s, g) in sorted(loaded.items()))
    return links, (f"; the simulated column models the disk as {baseline.name}'s on-demand reads found it beside the "
                   f"compute ({said}; at another residency as the scheduler)")


def _simulate_rows(rows: list[DecodeRow], trace, link_epl, predictor: str | None, rollout_every: int,
                   lag: int | None = None, costs: list | None = None, preempt: float | None = None) -> None:
    """Fill each row's ``simulated``: the replay of ``trace`` with the row's policy and slot count under the link
    model of ``sim.prefetch_sim`` at ``link_epl`` (experts per layer time; a list: one per row), the predictor's
    forecasts replayed with the runtime's settings, charging each row the ``CoreCosts`` it measured (``costs``, one
    per row; None: none), a miss waiting behind a prefetch in flight for ``preempt`` of one copy (None: the
    emulated link's chunk, ``replay_policy``'s default)."""
    from ..sim.forecasts import forecast_stream, xl_stream
    from ..sim.prefetch_sim import replay_policy
    from ..sim.simulator import layer_needs

    needs = layer_needs(trace)
    streams, pset = {}, None
    wanted = {r.requested for r in rows}
    if any(p.needs_predictor for p in wanted):
        from ..predictor.model import load_predictor

        pset = load_predictor(predictor, model_id=trace.header["model_id"])
        streams = dict.fromkeys({p for p in wanted if p.needs_predictor and not p.cross_layer},
                                forecast_stream(pset, trace, rollout_every=rollout_every, lag=lag))
    for p in {p for p in wanted if p.cross_layer}:
        streams[p] = xl_stream(trace, pset if p.needs_predictor else None, rollout_every=rollout_every)
    for i, row in enumerate(rows):
        if row.requested.family == "auto" or not row.same:  # auto starts from its own simulation's state
            continue
        popularity = pset.header.prefill_popularity if pset is not None and row.requested.needs_predictor else None
        link = link_epl[i] if isinstance(link_epl, list) else link_epl
        _, row.simulated = replay_policy(trace, row.requested, row.slots, link,
                                         forecasts=streams.get(row.requested), prefill_popularity=popularity,
                                         needs=needs, costs=costs[i] if costs else None,
                                         **({} if preempt is None else {"preempt": preempt}))


def _emulate_on_demand(lm, seconds_per_expert: float) -> None:
    """Make every on-demand expert copy of a non-prefetching engine take at least ``seconds_per_expert``."""
    eng = lm.engine
    plain = eng._load

    def slow_load(loads):
        t0 = now()
        plain(loads)
        wait_until(t0 + len(loads) * seconds_per_expert)

    eng._load = slow_load
