"""The CPU-time account of a decode step by thread and role (issue 47, part 1; ``runtime.cpu_account``)."""

import threading

import pytest

from moe_offload.generation.generate import encode_prompt, generate_ids, run
from moe_offload.models.loader import load_offloaded
from moe_offload.runtime import cpu_account
from moe_offload.runtime.cpu_account import CpuAccount, summary_line

PROMPT = "Hello there, how are you today? The slot pool is shared by all MoE layers."


class _FakeClocks:
    """thread_time and perf_counter advanced by hand (cpu, wall)."""

    def __init__(self, monkeypatch):
        self.cpu = self.wall = 0.0
        monkeypatch.setattr(cpu_account.time, "thread_time", lambda: self.cpu)
        monkeypatch.setattr(cpu_account.time, "perf_counter", lambda: self.wall)

    def spend(self, cpu, wall):
        self.cpu += cpu
        self.wall += wall


def test_nested_blocks_charge_their_own_time(monkeypatch):
    """A staging copy inside a prefetch read is charged to the copy; the read keeps the rest; the thread's
    take_io sees the outer block's whole time once."""
    clocks, acc = _FakeClocks(monkeypatch), CpuAccount()
    acc.active = True
    with acc.io("prefetch_reads"):
        clocks.spend(0.001, 0.010)      # the read: mostly waiting for the disk
        with acc.io("staging_copies"):
            clocks.spend(0.002, 0.002)  # the copy: all CPU
    assert acc.seconds[("main", "prefetch_reads")] == pytest.approx([0.001, 0.010])
    assert acc.seconds[("main", "staging_copies")] == pytest.approx([0.002, 0.002])
    assert acc.take_io() == pytest.approx((0.003, 0.012)) and acc.take_io() == (0.0, 0.0)
    acc.active = False
    with acc.io("on_demand_reads"):  # not a decode step: not counted
        clocks.spend(1.0, 1.0)
    assert ("main", "on_demand_reads") not in acc.seconds
    with pytest.raises(ValueError, match="unknown role"):
        acc.charge("reading", 0.0, 0.0)


def test_threads_are_told_apart_and_pools_add_up(monkeypatch):
    acc = CpuAccount()
    acc.active = True

    def work():
        acc.charge("prefetch_reads", 0.5, 1.0)

    for name in ("moe-offload-transfer", "moe-offload-disk_0", "moe-offload-disk_1"):
        t = threading.Thread(target=work, name=name)
        t.start()
        t.join()
    acc.charge("compute", 2.0, 2.0)
    d = acc.as_dict(steps=2)
    assert list(d["ms_per_step"]) == ["main", "copy worker", "disk readers"]
    assert d["ms_per_step"]["disk readers"]["prefetch_reads"] == {"cpu": 500.0, "wall": 1000.0}  # two threads
    assert d["ms_per_step"]["main"]["compute"] == {"cpu": 1000.0, "wall": 1000.0}
    line = summary_line(d)
    assert line.startswith("main: compute 1000.0; copy worker: prefetch reads 250.0 (500.0 wall)")


def test_generate_accounts_the_main_thread_and_the_on_demand_bytes(tiny_dirs):
    """Offloaded at a low residency: the main thread's roles add up to its wall time per step (the lap timer's
    phases, copies split out), and the on-demand bytes are whole experts, within what the engine loaded."""
    lm = load_offloaded(tiny_dirs["qwen3_moe"], device="cpu", residency=0.3, progress=False)
    try:
        _, stats = run(lm, [PROMPT], 30)  # 30 steps: a pause outside the steps (1 in ~20 runs, 6 ms) averages out
        eng = lm.engine
        d = eng.account.as_dict(eng.breakdown.steps)
        main = d["ms_per_step"]["main"]
        assert {"compute", "management", "stall", "on_demand_reads"} <= set(main)
        assert sum(v["wall"] for v in main.values()) == pytest.approx(1e3 * eng.breakdown.step_s / eng.breakdown.steps,
                                                                      rel=0.05)
        on_demand = d["bytes_per_step"]["on_demand"] * eng.breakdown.steps
        assert on_demand > 0 and on_demand % lm.expert_bytes == pytest.approx(0, abs=1e-6)
        assert on_demand <= eng.stats.bytes_loaded  # the prefill's loads are not counted
        assert d["bytes_per_step"]["prefetched"] == 0
    finally:
        lm.close()


def test_prefetches_from_disk_are_split_into_used_and_wasted(tiny_dirs, random_pset):
    """Cross-layer prefetching from disk: the copy worker's reads and staging copies are its own rows; every
    prefetched expert decided in a decode step is either used or wasted, never more than were prefetched."""
    from moe_offload.predictor.cross_layer import attach_cross_layer

    lm = load_offloaded(tiny_dirs["qwen3_moe"], device="cpu", residency=0.4, policy="xl", progress=False,
                        host_store="disk")
    try:
        attach_cross_layer(lm, None)
        generate_ids(lm, encode_prompt(lm.tokenizer, PROMPT), 12)
        eng = lm.engine
        d = eng.account.as_dict(eng.breakdown.steps)
        worker = d["ms_per_step"].get("copy worker", {})
        assert "prefetch_reads" in worker and "staging_copies" in worker
        b = {k: v * eng.breakdown.steps for k, v in d["bytes_per_step"].items()}
        assert b["prefetched"] > 0
        assert b["prefetched_used"] + b["prefetched_wasted"] <= eng.table.prefetches_used * lm.expert_bytes + \
            eng.table.prefetches_wasted * lm.expert_bytes
        # decided: used, or wasted (cross-layer forecasts of random routers are mostly wrong, and a prefetch whose
        # layer ran without it is wasted at once under the layer cycle, core.prob_belady)
        assert eng.table.prefetches_used + eng.table.prefetches_wasted > 0
    finally:
        lm.close()


def test_account_table_by_hand():
    """The benchmarks' table: the main thread's step, predictor + management and its share, copies summed over
    threads (CPU, wall in parentheses), MB per step."""
    from moe_offload.runtime.cpu_account import account_table

    a = {"decode_steps": 4, "ms_per_step": {
        "main": {"compute": {"cpu": 30.0, "wall": 30.0}, "predictor": {"cpu": 1.0, "wall": 1.0},
                 "management": {"cpu": 1.5, "wall": 1.5}, "stall": {"cpu": 0.5, "wall": 5.5},
                 "on_demand_reads": {"cpu": 0.5, "wall": 2.0}},
        "copy worker": {"prefetch_reads": {"cpu": 1.0, "wall": 6.0}, "staging_copies": {"cpu": 2.0, "wall": 2.0}},
        "disk readers": {"staging_copies": {"cpu": 0.5, "wall": 0.5}}},
        "bytes_per_step": {"on_demand": 3e6, "prefetched": 5e6, "prefetched_used": 4e6, "prefetched_wasted": 1e6}}
    head, rule, row = account_table([("lru 0.25", a)])
    assert [c.strip() for c in row.split("|")[1:-1]] == [
        "lru 0.25", "40.00", "30.00", "2.50 (6.2%)", "5.50", "0.50 (2.00)", "1.00 (6.00)", "2.50 (2.50)", "3.00",
        "4.00 / 1.00"]


def test_a_read_inside_a_callers_block_is_the_callers(monkeypatch):
    """A disk read inherits its caller's role (an on-demand copy the worker runs through the prefetch path is still
    on demand); alone on a thread (a reader pool's), it takes its own."""
    clocks, acc = _FakeClocks(monkeypatch), CpuAccount()
    acc.active = True
    with acc.io("on_demand_reads"):
        with acc.io("prefetch_reads", inherit=True):
            clocks.spend(0.001, 0.004)
        with acc.io("staging_copies"):
            clocks.spend(0.002, 0.002)
    with acc.io("prefetch_reads", inherit=True):
        clocks.spend(0.001, 0.001)
    assert acc.seconds[("main", "on_demand_reads")] == pytest.approx([0.001, 0.004])
    assert acc.seconds[("main", "staging_copies")] == pytest.approx([0.002, 0.002])
    assert acc.seconds[("main", "prefetch_reads")] == pytest.approx([0.001, 0.001])
