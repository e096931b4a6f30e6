"""The disk tier's prefetch reads (issue 35, item 3): they yield to on-demand reads at each chunk, a cancelled one
stops at a chunk (in Python, and in one native call checking flags: issue 47), and the on-demand reads' speed is
set against a measured disk (``demand_efficiency``)."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from moe_offload.errors import MoeOffloadError
from moe_offload.runtime.disk_store import IO_ALIGN, DiskReadStats, StopFlag, copy_concurrently
from moe_offload.runtime.kernels import native
from moe_offload.runtime.transfer import TransferEngine

from disk_fixtures import fields_equal, largest_expert, stores  # noqa: F401 (stores: a fixture)


def _needs_native(path: str) -> None:
    if path == "native" and native() is None:
        pytest.skip("the native kernels are not built here")


@pytest.mark.parametrize("path", ["native", "python"])
def test_prefetch_yields_to_on_demand_reads(stores, path):
    """A prefetch waits before its first chunk while an on-demand read is outstanding, then reads all of it, one
    request per chunk: one native call polling the store's flags (``stopped`` None: the store makes its own
    ``StopFlag``), or Python asking a ``stopped()`` callable at each chunk."""
    _needs_native(path)
    pinned, disk, _ = stores
    eid = largest_expert(disk)
    assert sum(s.need for s in disk.spans(eid)) > IO_ALIGN  # several chunks
    got = np.zeros(disk.layout.expert_bytes, dtype=np.uint8)
    disk.reset_stats()
    result = []
    stopped = None if path == "native" else (lambda: False)
    with disk._on_demand():  # an on-demand read outstanding
        t = threading.Thread(target=lambda: result.append(disk.read_prefetch(eid, got, stopped)))
        t.start()
        time.sleep(0.2)
        assert t.is_alive() and disk.stats.requests == 0 and not got.any()  # nothing read yet
    t.join(10)
    assert result == [True] and fields_equal(disk, got, pinned.buf.numpy()[eid])
    assert disk.stats.requests == sum(-(-s.need // IO_ALIGN) for s in disk.spans(eid))  # one request per chunk
    assert disk.stats.prefetch_yields == 1
    assert disk.stats.prefetch_cancelled == 0 and disk.stats.experts == 1


def test_stopped_prefetch_stops_at_a_chunk(stores):
    """``stopped()`` turning true after the first chunk: one request, False returned, counted as cancelled."""
    _, disk, _ = stores
    eid = largest_expert(disk)
    got = np.zeros(disk.layout.expert_bytes, dtype=np.uint8)
    disk.reset_stats()
    asked = []

    def stopped() -> bool:
        asked.append(1)
        return len(asked) > 1

    assert disk.read_prefetch(eid, got, stopped) is False
    st = disk.stats
    assert (st.requests, st.prefetch_cancelled, st.experts) == (1, 1, 0)


def test_native_prefetch_stopped_while_it_yields(stores):
    """The native read: a ``StopFlag`` set while the prefetch waits for an on-demand read ends it before any request
    (False, counted as cancelled, its bytes not counted); one set before the call reads nothing either."""
    _needs_native("native")
    _, disk, _ = stores
    eid = largest_expert(disk)
    got = np.zeros(disk.layout.expert_bytes, dtype=np.uint8)
    disk.reset_stats()
    flag, result = StopFlag(), []
    with disk._on_demand():
        t = threading.Thread(target=lambda: result.append(disk.read_prefetch(eid, got, flag)))
        t.start()
        time.sleep(0.1)
        flag.set()
        t.join(10)  # ends without the on-demand read finishing
        assert result == [False]
    flag = StopFlag()
    flag.set()
    assert disk.read_prefetch(eid, got, flag) is False
    st = disk.stats
    assert (st.requests, st.prefetch_cancelled, st.experts, st.bytes_read, st.prefetch_yields) == (0, 2, 0, 0, 1)
    assert not got.any()


def test_transfer_cancel_stops_a_running_disk_copy(stores, monkeypatch):
    """``TransferEngine.cancel`` of a copy in flight from the disk store (the Python path, its first chunk held): it
    stops at the next chunk and lands ``ok=False``, ``error="cancelled"``, counted in ``stats.cancelled`` (not
    ``failed``)."""
    _, disk, pool = stores
    monkeypatch.setattr(disk, "_kernel", None)  # chunks read in Python, so that the test can hold one
    eid = largest_expert(disk)
    entered, release = threading.Event(), threading.Event()
    real = disk._read_span

    def held(span, view, lo=0, hi=None):  # the first chunk waits until the test has cancelled the copy
        entered.set()
        release.wait(10)
        return real(span, view, lo, hi)

    disk._read_span = held
    try:
        eng = TransferEngine(disk, pool)
        eng.submit(eid, 0)
        assert entered.wait(10)
        assert eng.cancel(eid) is False  # running: not dropped from the queue, stopped at its next chunk
        release.set()
        landing = eng.wait(eid, timeout=10)
        assert (landing.ok, landing.error) == (False, "cancelled")
        assert (eng.stats.cancelled, eng.stats.failed, eng.stats.copies) == (1, 0, 0)
        eng.close()
    finally:
        del disk._read_span


def test_transfer_cancel_stops_a_native_disk_copy(stores):
    """The same through the native read: the copy waits for an on-demand read, is cancelled (its job's
    ``StopFlag``), and lands ``ok=False``, ``error="cancelled"`` once the on-demand read is over, with no request
    made."""
    _needs_native("native")
    _, disk, pool = stores
    eid = largest_expert(disk)
    disk.reset_stats()
    eng = TransferEngine(disk, pool)
    try:
        with disk._on_demand():
            eng.submit(eid, 0)
            deadline = time.perf_counter() + 10
            while eng._current is None and time.perf_counter() < deadline:  # the worker took the copy
                time.sleep(0.01)
            time.sleep(0.05)
            assert eng.cancel(eid) is False  # running: stopped in the native read
        landing = eng.wait(eid, timeout=10)
        assert (landing.ok, landing.error) == (False, "cancelled")
        assert (eng.stats.cancelled, eng.stats.failed, eng.stats.copies) == (1, 0, 0)
        assert (disk.stats.requests, disk.stats.prefetch_cancelled) == (0, 1)
    finally:
        eng.close()


def test_demand_efficiency_hand_worked():
    """Two 1 MB reads alone at 1 GB/s (1 ms each) and four 0.5 MB reads two at a time at 2 GB/s together (0.25 ms of
    wall time each): the disk needs 3 ms; outstanding for 4 ms, the reads reached 75% of it."""
    st = DiskReadStats(demand_s=0.004, demand_bytes=4_000_000,
                       demand_reads={(1_000_000, 1): 2, (500_000, 2): 4})
    assert st.demand_efficiency(lambda size, depth: {1: 1.0, 2: 2.0}[depth]) == pytest.approx(0.75)
    assert st.demand_gbps == pytest.approx(1.0)
    assert DiskReadStats().demand_efficiency(lambda s, d: 1.0) is None


def test_disk_gbps_between_measured_depths():
    """Depth 3 lies halfway between QD 2 (1.6) and QD 4 (1.8): 1.7; beyond QD 4: QD 4's figure."""
    from moe_offload.core.disk_link import disk_gbps

    disk = {"table_gbps": {"64": {"1": 1.0, "2": 1.6, "4": 1.8}}}
    assert disk_gbps(disk, 64 * 1024, 3) == pytest.approx(1.7)
    assert disk_gbps(disk, 64 * 1024, 16) == pytest.approx(1.8)


def test_on_demand_reads_are_timed_with_their_queue_depth(stores):
    """``copy_many`` of 3 experts with 4 readers: 3 reads at depth 3, the wall time counted once."""
    _, disk, _ = stores
    disk.reset_stats()
    got = np.zeros((3, disk.layout.expert_bytes), dtype=np.uint8)
    disk.copy_many([0, 1, 2], [got[i] for i in range(3)])
    st = disk.stats
    assert sum(st.demand_reads.values()) == 3 and {d for _, d in st.demand_reads} == {3}
    assert st.demand_bytes == sum(s.length for e in (0, 1, 2) for s in disk.spans(e)) and st.demand_s > 0


def test_copy_concurrently_caller_takes_part_and_reraises():
    """With depth 2 the caller and one pool thread do the copies; every pair is copied once; a failure is raised
    after all have finished."""
    from concurrent.futures import ThreadPoolExecutor

    seen, names = [], set()

    def copy(e, d):
        names.add(threading.current_thread().name)
        seen.append((e, d))
        time.sleep(0.01)

    with ThreadPoolExecutor(4, thread_name_prefix="pool") as pool:
        copy_concurrently(copy, pool, list(range(6)), list("abcdef"), depth=2)
        assert sorted(seen) == list(zip(range(6), "abcdef"))
        assert threading.current_thread().name in names and len(names) == 2

        def fail(e, d):
            if e == 1:
                raise ValueError("boom")

        with pytest.raises(ValueError, match="boom"):
            copy_concurrently(fail, pool, [0, 1, 2], [0, 1, 2], depth=3)


def test_transfer_copy_now_reads_misses_at_once_from_disk(stores):
    """A CPU pool fed by the disk tier: ``TransferEngine.copy_now`` reads the misses at once, as the pool loads them
    without a prefetcher (``copy_many``: whole experts, depth 3 here), into their slots; nothing goes through the
    worker. With an emulated link it declines (the worker paces the copies)."""
    pinned, disk, pool = stores
    disk.reset_stats()
    eng = TransferEngine(disk, pool)
    try:
        assert eng.copy_now([4, 5, 6], [0, 1, 2]) is True
        rows = pool.buf.numpy()
        assert all(fields_equal(disk, rows[s], pinned.buf.numpy()[e]) for e, s in ((4, 0), (5, 1), (6, 2)))
        assert {d for _, d in disk.stats.demand_reads} == {3} and eng.stats.submitted == 0
        assert (eng.stats.copies, eng.stats.bytes_copied) == (3, 3 * disk.layout.expert_bytes)
        with pytest.raises(MoeOffloadError, match="slot -1 out of range"):
            eng.copy_now([4], [-1])
    finally:
        eng.close()
    paced = TransferEngine(disk, pool, seconds_per_expert=1e-4)
    try:
        assert paced.copy_now([4], [0]) is False
    finally:
        paced.close()
