"""TransferEngine (runtime.transfer): asynchronous host->device expert copies for prefetching (SeqMoE §8.3).

Tiny store/pool built directly (128-byte experts), no model loading; every test runs in well under a second.
"""

import threading
import time

import pytest
import torch

from moe_offload.core.policies import LRU
from moe_offload.core.slots import SlotTable
from moe_offload.errors import MoeOffloadError
from moe_offload.runtime.pool import SlotPool
from moe_offload.runtime.store import ExpertLayout, HostStore
from moe_offload.runtime.transfer import Landing, TransferEngine

N_EXPERTS = 8
N_SLOTS = 4


def make(device="cpu", pin=False):
    layout = ExpertLayout([("w1", (4, 4)), ("w2", (4, 4))], torch.float32)  # 32 floats = 128 bytes
    store = HostStore(layout, N_EXPERTS, pin=pin)
    store.buf.view(torch.float32).copy_(torch.arange(N_EXPERTS * 32, dtype=torch.float32).view(N_EXPERTS, -1) + 1)
    pool = SlotPool(layout, N_SLOTS, N_EXPERTS, torch.device(device))
    return store, pool


@pytest.fixture
def parts():
    return make()


@pytest.fixture
def engines():
    made = []
    yield made
    for te in made:
        te.close()


def new(engines, store, pool, **kw):
    te = TransferEngine(store, pool, **kw)
    engines.append(te)
    return te


def collect(te, n, timeout=5.0):
    """Poll until ``n`` landings arrived (fails after ``timeout`` seconds)."""
    out = []
    end = time.perf_counter() + timeout
    while len(out) < n:
        out += te.poll()
        assert time.perf_counter() < end, f"only {len(out)} of {n} landings after {timeout} s"
        time.sleep(0.001)
    return out


def wait_until(cond, timeout=5.0):
    end = time.perf_counter() + timeout
    while not cond():
        assert time.perf_counter() < end
        time.sleep(0.001)


def test_copies_land_right_bytes_in_right_slot(parts, engines):
    store, pool = parts
    te = new(engines, store, pool)
    plan = [(5, 0, 11), (2, 3, 12), (7, 1, 13)]
    for eid, slot, tag in plan:
        te.submit(eid, slot, tag)
    landings = collect(te, 3)
    assert {(l.eid, l.slot, l.tag, l.ok) for l in landings} == {(e, s, t, True) for e, s, t in plan}
    for eid, slot, _ in plan:
        assert torch.equal(pool.buf[slot], store.buf[eid])
    assert torch.count_nonzero(pool.buf[2]) == 0  # untouched slot
    assert all(l.error is None and l.started_at <= l.finished_at for l in landings)
    # the engine never touches the lookup table (the caller does on landing)
    assert (pool.lookup == -1).all()
    st = te.stats
    assert (st.submitted, st.copies, st.cancelled, st.failed) == (3, 3, 0, 0)
    assert st.bytes_copied == 3 * store.layout.expert_bytes == 3 * 128


def test_poll_reports_each_landing_once(parts, engines):
    store, pool = parts
    te = new(engines, store, pool)
    assert te.poll() == []
    for i in range(4):
        te.submit(i, i, 100 + i)
    landings = collect(te, 4)
    assert sorted(l.tag for l in landings) == [100, 101, 102, 103]
    assert len({l.eid for l in landings}) == 4
    wait_until(te.idle)
    time.sleep(0.01)
    assert te.poll() == []
    assert te.wait(0) is None  # already reported by poll


def test_fifo_order(parts, engines):
    store, pool = parts
    te = new(engines, store, pool, seconds_per_expert=0.002)
    order = [6, 1, 4, 0, 7, 3]
    for k, eid in enumerate(order):
        te.submit(eid, k % N_SLOTS, k)
    landings = collect(te, len(order))
    assert [l.eid for l in landings] == order
    assert [l.tag for l in landings] == list(range(len(order)))
    starts = [l.started_at for l in landings]
    assert starts == sorted(starts)
    for a, b in zip(landings, landings[1:]):  # one at a time: the next starts after the previous finished
        assert b.started_at >= a.finished_at


def test_link_emulation_gbps_lower_bound(parts, engines):
    store, pool = parts
    per_copy = 0.01
    gbps = store.layout.expert_bytes / (per_copy * 1e9)  # 128 B at 1.28e-5 GB/s -> 10 ms per expert
    te = new(engines, store, pool, link_gbps=gbps)
    assert te.seconds_per_expert == pytest.approx(per_copy)
    n = 5
    t0 = time.perf_counter()
    for i in range(n):
        te.submit(i, i % N_SLOTS, i)
    landings = collect(te, n)
    assert time.perf_counter() - t0 >= 0.9 * n * per_copy
    assert all(l.finished_at - l.started_at >= 0.9 * per_copy for l in landings)
    assert te.stats.busy_s >= 0.9 * n * per_copy


def test_link_emulation_seconds_per_expert_lower_bound(parts, engines):
    store, pool = parts
    te = new(engines, store, pool, seconds_per_expert=0.008)
    n = 4
    t0 = time.perf_counter()
    for i in range(n):
        te.submit(i + 4, i, i)
    collect(te, n)
    assert time.perf_counter() - t0 >= 0.9 * n * 0.008
    for i in range(n):
        assert torch.equal(pool.buf[i], store.buf[i + 4])


def test_pause_blocks_new_copies_and_resume_continues(parts, engines):
    store, pool = parts
    te = new(engines, store, pool)
    te.pause()
    assert te.paused
    for i in range(3):
        te.submit(i, i, i)
    time.sleep(0.03)
    assert te.poll() == []
    assert te.queued() == [0, 1, 2] and te.in_flight() == []
    assert torch.count_nonzero(pool.buf) == 0  # nothing started
    te.resume()
    landings = collect(te, 3)
    assert [l.eid for l in landings] == [0, 1, 2] and all(l.ok for l in landings)


def test_pause_lets_the_copy_in_flight_complete(parts, engines):
    store, pool = parts
    te = new(engines, store, pool, seconds_per_expert=0.04)
    for i in range(3):
        te.submit(i, i, i)
    wait_until(lambda: te.in_flight() == [0])
    te.pause()
    first = collect(te, 1)
    assert [l.eid for l in first] == [0] and first[0].ok
    time.sleep(0.06)  # longer than a copy: nothing new may have started
    assert te.poll() == [] and te.in_flight() == [] and te.queued() == [1, 2]
    te.resume()
    assert [l.eid for l in collect(te, 2)] == [1, 2]


def test_cancel_reports_not_ok_and_leaves_slot_alone(parts, engines):
    store, pool = parts
    te = new(engines, store, pool, seconds_per_expert=0.03)
    te.submit(0, 0, 1)
    wait_until(lambda: te.in_flight() == [0])
    te.submit(1, 1, 2)
    te.submit(2, 2, 3)
    assert te.cancel(0) is False  # in flight: it completes
    assert te.cancel(1) is True
    assert te.cancel(1) is False  # no longer queued
    assert te.cancel(6) is False  # unknown
    landings = collect(te, 3)
    by_eid = {l.eid: l for l in landings}
    assert by_eid[1] == Landing(1, 1, 2, False, by_eid[1].finished_at, None, "cancelled")
    assert by_eid[0].ok and by_eid[2].ok
    assert torch.count_nonzero(pool.buf[1]) == 0
    assert te.stats.cancelled == 1 and te.stats.copies == 2
    te.submit(1, 1, 4)  # a cancelled expert can be submitted again
    assert collect(te, 1)[0].ok


def test_wait_blocks_until_copy_done(parts, engines):
    store, pool = parts
    te = new(engines, store, pool, seconds_per_expert=0.05)
    t0 = time.perf_counter()
    te.submit(3, 2, 9)
    landing = te.wait(3)
    assert time.perf_counter() - t0 >= 0.045
    assert (landing.eid, landing.slot, landing.tag, landing.ok) == (3, 2, 9, True)
    assert torch.equal(pool.buf[2], store.buf[3])
    assert te.poll() == []  # consumed by wait
    assert te.wait(3) is None and te.wait(5) is None


def test_wait_promotes_a_queued_copy_even_while_paused(parts, engines):
    store, pool = parts
    te = new(engines, store, pool)
    te.pause()
    for i in range(3):
        te.submit(i, i, i)
    landing = te.wait(2)
    assert landing.ok and landing.eid == 2
    assert torch.equal(pool.buf[2], store.buf[2])
    assert te.queued() == [0, 1]  # the others still wait for resume
    te.resume()
    assert [l.eid for l in collect(te, 2)] == [0, 1]


def test_wait_timeout(parts, engines):
    store, pool = parts
    te = new(engines, store, pool, seconds_per_expert=0.2)
    te.submit(0, 0, 0)
    te.submit(1, 1, 1)
    with pytest.raises(TimeoutError):
        te.wait(1, timeout=0.02)
    assert te.pending(1)


def test_wait_from_another_thread_sees_the_landing(parts, engines):
    store, pool = parts
    te = new(engines, store, pool, seconds_per_expert=0.02)
    te.submit(4, 3, 7)
    got = []
    t = threading.Thread(target=lambda: got.append(te.wait(4)))
    t.start()
    t.join(5)
    assert got and got[0].ok and got[0].tag == 7


def test_close_joins_worker_and_cancels_queue(parts):
    store, pool = parts
    te = TransferEngine(store, pool, seconds_per_expert=0.03)
    assert te.worker_alive
    te.submit(0, 0, 0)
    wait_until(lambda: te.in_flight() == [0])
    te.submit(1, 1, 1)
    te.close()
    assert not te.worker_alive and te.closed
    landings = {l.eid: l for l in te.poll()}
    assert landings[0].ok and not landings[1].ok and landings[1].error == "cancelled"
    with pytest.raises(MoeOffloadError):
        te.submit(2, 2, 2)
    te.close()  # idempotent


def test_close_drain_runs_queued_copies(parts):
    store, pool = parts
    with TransferEngine(store, pool) as te:
        te.pause()
        for i in range(3):
            te.submit(i, i, i)
        te.close(drain=True)
        assert not te.worker_alive
        assert [l.ok for l in te.poll()] == [True, True, True]
    for i in range(3):
        assert torch.equal(pool.buf[i], store.buf[i])


def test_bad_arguments(parts, engines):
    store, pool = parts
    for kw in ({"link_gbps": 0}, {"link_gbps": -1.0}, {"link_gbps": float("nan")}, {"link_gbps": float("inf")},
               {"link_gbps": "fast"}, {"seconds_per_expert": 0}, {"seconds_per_expert": -0.1},
               {"link_gbps": 1.0, "seconds_per_expert": 0.1}):
        with pytest.raises(MoeOffloadError):
            TransferEngine(store, pool, **kw)
    other = SlotPool(ExpertLayout([("w1", (4, 4))], torch.float32), 2, N_EXPERTS, torch.device("cpu"))
    with pytest.raises(MoeOffloadError, match="layout"):
        TransferEngine(store, other)
    te = new(engines, store, pool)
    te.pause()
    for eid, slot in ((-1, 0), (N_EXPERTS, 0), (0, -1), (0, N_SLOTS)):
        with pytest.raises(MoeOffloadError):
            te.submit(eid, slot, 0)
    te.submit(0, 0, 0)
    with pytest.raises(MoeOffloadError, match="already"):
        te.submit(0, 1, 1)
    assert te.stats.submitted == 1


def test_with_slot_table_tags(parts, engines):
    """The §8.3 loop: prefetch reserves a slot with a tag, the copy lands, land() applies the matching tag."""
    store, pool = parts
    table = SlotTable(N_SLOTS, N_EXPERTS, LRU(), experts_per_layer=4)
    te = new(engines, store, pool)
    loads = [table.prefetch(e) for e in (1, 5, 6)]
    for ld in loads:
        te.submit(ld.eid, ld.slot, ld.tag)
    for landing in collect(te, 3):
        assert table.land(landing.eid, landing.slot, landing.tag, landing.ok)
        pool.lookup[landing.eid] = landing.slot
    for ld in loads:
        assert table.is_resident(ld.eid) and table.slot_of[ld.eid] == ld.slot
        assert torch.equal(pool.buf[ld.slot], store.buf[ld.eid])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_copy_stream():
    store, pool = make("cuda", pin=True)
    with TransferEngine(store, pool) as te:
        for i in range(N_SLOTS):
            te.submit(i + 2, i, i)
        first = te.wait(2)
        assert first.ok
        rest = collect(te, N_SLOTS - 1)
        assert all(l.ok for l in rest)
        torch.cuda.synchronize()
        for i in range(N_SLOTS):
            assert torch.equal(pool.buf[i].cpu(), store.buf[i + 2])
    with TransferEngine(store, pool, seconds_per_expert=0.01) as te:
        t0 = time.perf_counter()
        for i in range(3):
            te.submit(i, i, i)
        collect(te, 3)
        assert time.perf_counter() - t0 >= 0.9 * 3 * 0.01


def test_wait_returns_its_own_copy_not_an_unpolled_cancelled_one(parts, engines):
    """A copy cancelled and not yet polled, then the same expert copied again: wait() returns the new copy's landing
    (the cancelled one stays for poll). The refresh engine releases and re-copies an expert within one step."""
    store, pool = parts
    te = new(engines, store, pool, seconds_per_expert=0.05)
    te.submit(0, 0, 1)                 # occupies the worker
    te.submit(3, 1, 2)
    assert te.cancel(3)                # landing (ok=False, "cancelled") waits for poll
    te.submit(3, 2, 3)
    got = te.wait(3)
    assert got.ok and (got.slot, got.tag) == (2, 3)
    assert torch.equal(pool.buf[2], store.buf[3])
    stale = [l for l in collect(te, 2) if l.eid == 3]
    assert len(stale) == 1 and not stale[0].ok and stale[0].error == "cancelled"


def test_copy_now_is_left_to_submit_and_wait(parts, engines):
    """The worker engine never copies on the caller's thread (that is ``VirtualLinkEngine``'s, tests/
    test_virtual_link.py): ``copy_now`` does nothing and says so, and the caller submits and waits."""
    store, pool = parts
    te = new(engines, store, pool, seconds_per_expert=0.01)
    assert te.copy_now([3], [0]) is False
    assert torch.count_nonzero(pool.buf[0]) == 0 and te.stats.copies == 0
