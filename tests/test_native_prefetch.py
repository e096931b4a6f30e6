"""The disk tier's native prefetch queue (``runtime.native_prefetch``, issue 47 session 49): TransferEngine's
protocol (SeqMoE §8.3) read by a native worker thread: bytes land in the right slots with their tags, in submission
order; ``pause`` holds queued copies and ``wait`` promotes one past it; ``cancel`` drops a queued copy or stops a
running one at a chunk; a prefetch yields to on-demand reads; a failed read lands failed with the store's message;
the counters reach the store's statistics and the CPU account (thread ``copy worker``)."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest
import torch

from moe_offload.errors import MoeOffloadError
from moe_offload.runtime.cpu_account import CpuAccount, attach
from moe_offload.runtime.disk_store import IO_ALIGN, DiskStore
from moe_offload.runtime.kernels import native
from moe_offload.runtime.native_prefetch import NativePrefetchQueue
from moe_offload.runtime.pool import SlotPool
from moe_offload.runtime.store import ExpertLayout
from moe_offload.runtime.transfer import TransferEngine, make_transfer_engine

from disk_fixtures import fields_equal, largest_expert, stores  # noqa: F401 (stores: a fixture)

pytestmark = pytest.mark.skipif(native() is None, reason="the native kernels are not built here")


@pytest.fixture
def queue(stores):
    _, disk, pool = stores
    disk.reset_stats()
    q = NativePrefetchQueue(disk, pool)
    yield q
    q.close()


def _collect(q, n: int, timeout: float = 10.0) -> list:
    out, end = [], time.perf_counter() + timeout
    while len(out) < n:
        out += q.poll()
        assert time.perf_counter() < end, f"only {len(out)} of {n} landings"
        time.sleep(0.001)
    return out


def _until_running(q, eid: int, timeout: float = 10.0) -> None:
    """Wait until the copy of ``eid`` is the one running."""
    deadline = time.perf_counter() + timeout
    while q.in_flight() != [eid]:
        assert time.perf_counter() < deadline, f"the copy of {eid} never started"
        time.sleep(0.001)


def test_make_transfer_engine_picks_the_native_queue_for_a_disk_store(stores):
    """A disk store and a CPU pool: the native queue; with an emulated link: the Python worker, which paces."""
    _, disk, pool = stores
    eng = make_transfer_engine(disk, pool)
    paced = make_transfer_engine(disk, pool, seconds_per_expert=1e-4)
    try:
        assert type(eng) is NativePrefetchQueue and type(paced) is TransferEngine
    finally:
        eng.close()
        paced.close()


def test_copies_land_right_bytes_in_right_slots_in_order(stores, queue):
    """Four prefetches: each expert's fields in its slot, its tag returned, landings in submission order; the
    counters: 4 copies, 4 prefetch copies with their CPU, the store's 4 experts and their requests."""
    pinned, disk, pool = stores
    plan = [(5, 0, 11), (2, 3, 12), (7, 1, 13), (0, 2, 14)]
    for eid, slot, tag in plan:
        queue.submit(eid, slot, tag)
    landings = _collect(queue, 4)
    assert [(ld.eid, ld.slot, ld.tag, ld.ok, ld.error) for ld in landings] == [(e, s, t, True, None)
                                                                               for e, s, t in plan]
    assert all(ld.started_at <= ld.finished_at for ld in landings)
    rows = pool.buf.numpy()
    assert all(fields_equal(disk, rows[s], pinned.buf.numpy()[e]) for e, s, _ in plan)
    st = queue.stats
    assert (st.submitted, st.copies, st.prefetch_copies, st.cancelled, st.failed) == (4, 4, 4, 0, 0)
    assert st.bytes_copied == 4 * disk.layout.expert_bytes and st.prefetch_cpu_s > 0
    assert disk.stats.experts == 4
    assert disk.stats.requests == sum(-(-s.need // IO_ALIGN) for e, _, _ in plan for s in disk.spans(e))
    assert queue.poll() == [] and queue.idle()


def test_pause_holds_queued_copies_and_wait_promotes_one(stores, queue):
    """Paused: nothing starts; ``wait`` on the second of three starts it at once and returns its landing, which
    ``poll`` does not report again; ``resume`` runs the other two in their order."""
    _, disk, pool = stores
    queue.pause()
    for eid, slot in ((1, 0), (3, 1), (6, 2)):
        queue.submit(eid, slot, eid)
    time.sleep(0.05)
    assert queue.queued() == [1, 3, 6] and queue.in_flight() == [] and queue.outstanding() == 3
    landing = queue.wait(3, timeout=10)
    assert (landing.eid, landing.slot, landing.tag, landing.ok) == (3, 1, 3, True)
    assert queue.poll() == [] and queue.queued() == [1, 6] and queue.paused
    assert queue.wait(3) is None  # consumed
    queue.resume()
    assert [ld.eid for ld in _collect(queue, 2)] == [1, 6]


def test_cancel_drops_a_queued_copy_and_stops_a_running_one(stores, queue):
    """While an on-demand read is outstanding the running prefetch waits before its first chunk: ``cancel`` of it
    returns False and it lands cancelled with no request made; the queued one behind it is dropped (True) and lands
    cancelled without having started. Counted as cancelled, not failed; the store counts one stopped prefetch."""
    _, disk, _ = stores
    big = largest_expert(disk)
    with disk._on_demand():
        queue.submit(big, 0, 1)
        queue.submit(3, 1, 2)
        _until_running(queue, big)
        with pytest.raises(TimeoutError):
            queue.wait(big, timeout=0.05)  # it yields to the on-demand read
        assert queue.cancel(big) is False and queue.cancel(3) is True
        landing = queue.wait(big, timeout=10)
    assert (landing.ok, landing.error) == (False, "cancelled") and landing.started_at is not None
    queued = queue.wait(3)
    assert (queued.ok, queued.error, queued.started_at) == (False, "cancelled", None)
    st = queue.stats
    assert (st.cancelled, st.failed, st.copies) == (2, 0, 0)
    assert (disk.stats.requests, disk.stats.prefetch_cancelled, disk.stats.prefetch_yields) == (0, 1, 1)


def test_errors_and_close(stores):
    """Bad submissions raise one-line errors; ``close`` cancels what is queued (reported by ``poll``), later
    submissions raise, and ``copy_now`` declines."""
    _, disk, pool = stores
    q = NativePrefetchQueue(disk, pool)
    with pytest.raises(MoeOffloadError, match="out of range"):
        q.submit(disk.num_experts_total, 0)
    with pytest.raises(MoeOffloadError, match="slot -1 out of range"):
        q.submit(0, -1)
    q.pause()
    q.submit(2, 0)
    with pytest.raises(MoeOffloadError, match="already queued"):
        q.submit(2, 1)
    q.close()
    assert [(ld.eid, ld.ok, ld.error) for ld in q.poll()] == [(2, False, "cancelled")]
    assert q.closed and not q.worker_alive and q.copy_now([1], [0]) is False
    with pytest.raises(MoeOffloadError, match="closed"):
        q.submit(1, 0)
    q.close()  # idempotent


def test_close_drains_or_times_out(stores):
    """``close(drain=True)`` runs the queued copies, paused ones too, before the worker exits: each lands with its
    bytes. A close whose running prefetch yields to an on-demand read beyond ``timeout`` raises a one-line error and
    leaves the queue closed; once the read ends, a second close joins the worker and the prefetch lands."""
    pinned, disk, pool = stores
    q = NativePrefetchQueue(disk, pool)
    q.pause()
    q.submit(2, 0)
    q.submit(3, 1)
    q.close(drain=True)
    assert [(ld.eid, ld.ok) for ld in q.poll()] == [(2, True), (3, True)] and not q.worker_alive
    rows, host = pool.buf.numpy(), pinned.buf.numpy()
    assert fields_equal(disk, rows[0], host[2]) and fields_equal(disk, rows[1], host[3])
    q = NativePrefetchQueue(disk, pool)
    big = largest_expert(disk)
    try:
        with disk._on_demand():
            q.submit(big, 0)
            _until_running(q, big)
            with pytest.raises(MoeOffloadError, match=r"did not stop within 0.05 s"):
                q.close(timeout=0.05)
            assert q.closed and q.worker_alive
    finally:
        q.close()
    assert not q.worker_alive and [(ld.eid, ld.ok) for ld in q.poll()] == [(big, True)]
    assert fields_equal(disk, pool.buf.numpy()[0], host[big])


def test_reset_stats_folds_what_was_counted(stores, queue):
    """``reset_stats`` zeroes the queue's statistics after folding the worker's counts into the store's: a landed
    prefetch never collected by ``poll`` is counted in the store once, and not again after the reset."""
    _, disk, _ = stores
    queue.submit(2, 0)
    deadline = time.perf_counter() + 10
    while not queue.idle():
        assert time.perf_counter() < deadline
        time.sleep(0.001)
    queue.reset_stats()
    assert (queue.stats.copies, disk.stats.experts) == (0, 1)
    assert [ld.eid for ld in _collect(queue, 1)] == [2]
    assert disk.stats.experts == 1


def test_copy_now_and_the_cpu_account(stores, queue):
    """``copy_now`` reads misses at once on the calling thread (counted as copies, nothing submitted); a prefetch's
    seconds are charged to the account's ``copy worker`` thread, its bytes counted as prefetched."""
    pinned, disk, pool = stores
    account = CpuAccount()
    account.active = True
    attach(disk, account)
    try:
        assert queue.copy_now([4, 5], [0, 1]) is True
        rows = pool.buf.numpy()
        assert fields_equal(disk, rows[1], pinned.buf.numpy()[5])
        queue.submit(6, 2)
        assert _collect(queue, 1)[0].ok  # not waited for: a prefetch (a copy waited for is read as on demand)
        st = queue.stats
        assert (st.submitted, st.copies) == (1, 3)
        cell = account.seconds[("copy worker", "prefetch_reads")]
        assert cell[1] > 0 and account.bytes["prefetched"] == disk.layout.expert_bytes
    finally:
        attach(disk, None)


def test_a_failed_read_lands_failed_with_the_stores_message(tmp_path):
    """An expert file cut short after the store opened it: the prefetch lands failed, its error the store's one
    line (the file ended while an expert was read), and the queue goes on with the next copy."""
    layout = ExpertLayout([("w", (2048,))], torch.float32)  # 8 KiB experts
    path = tmp_path / "experts.bin"
    data = np.arange(3 * 2048, dtype=np.float32)
    data.tofile(path)
    store = DiskStore(layout, 3)
    for e in range(3):
        store.add_segment(e, 0, path, e * layout.expert_bytes, layout.expert_bytes)
    pool = SlotPool(layout, 2, 3, torch.device("cpu"))
    q = NativePrefetchQueue(store, pool)
    try:
        os.truncate(path, layout.expert_bytes)
        q.submit(2, 0)
        failed = q.wait(2, timeout=10)
        assert not failed.ok and "ended at byte" in failed.error and str(path) in failed.error
        q.submit(0, 1)
        assert q.wait(0, timeout=10).ok
        assert np.array_equal(pool.buf[1].view(torch.float32).numpy(), data[:2048])
        assert (q.stats.failed, q.stats.copies) == (1, 1)
    finally:
        q.close()
        store.close()


def test_a_queue_dropped_without_close_stops_its_running_read(stores):
    """A queue never closed, dropped while its running prefetch yields to an on-demand read this thread holds: the
    destructor stops the read at its chunk (it does not wait for the on-demand read to end) and joins the worker."""
    import gc

    _, disk, pool = stores
    q = NativePrefetchQueue(disk, pool)
    big = largest_expert(disk)
    with disk._on_demand():
        q.submit(big, 0)
        _until_running(q, big)
        t0 = time.perf_counter()
        del q
        gc.collect()
        assert time.perf_counter() - t0 < 5.0
