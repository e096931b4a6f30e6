"""VirtualLinkEngine (runtime.virtual_link): copies on the calling thread, emulated link time on a virtual timeline
(SeqMoE §8.3's FIFO link, pause, and yield to on-demand copies at a chunk boundary).

A manual clock drives the engine, so every landing time below is worked out by hand: one copy holds the link
``seconds_per_expert = 8`` s, a chunk is 8 / LINK_CHUNKS = 1 s.
"""

import pytest
import torch

from moe_offload.core.prefetch import LINK_CHUNKS
from moe_offload.errors import MoeOffloadError
from moe_offload.runtime.pool import SlotPool
from moe_offload.runtime.store import ExpertLayout, HostStore
from moe_offload.runtime.transfer import TransferEngine, make_transfer_engine
from moe_offload.runtime.virtual_link import VirtualLinkEngine

N_EXPERTS, N_SLOTS = 8, 4
D = 8.0  # seconds per copy


class Clock:
    """Manual time: ``sleep_until`` jumps to the deadline."""

    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t

    def sleep_until(self, t: float) -> None:
        self.t = max(self.t, t)


def make(spe=D):
    layout = ExpertLayout([("w1", (4, 4)), ("w2", (4, 4))], torch.float32)
    store = HostStore(layout, N_EXPERTS)
    store.buf.view(torch.float32).copy_(torch.arange(N_EXPERTS * 32, dtype=torch.float32).view(N_EXPERTS, -1) + 1)
    pool = SlotPool(layout, N_SLOTS, N_EXPERTS, torch.device("cpu"))
    clock = Clock()
    te = VirtualLinkEngine(store, pool, seconds_per_expert=spe, clock=clock, sleep_until=clock.sleep_until)
    return store, pool, te, clock


def at(clock, t):
    clock.t = t


def times(landings):
    return [(l.eid, l.started_at, l.finished_at, l.ok) for l in landings]


def test_chunk_is_one_second():
    assert D / LINK_CHUNKS == 1.0


def test_fifo_copies_land_at_their_link_deadlines_with_their_bytes():
    store, pool, te, clock = make()
    te.submit(5, 0, 11)
    te.submit(2, 3, 12)
    at(clock, 1.0)
    te.submit(7, 1, 13)
    assert te.in_flight() == [5] and te.queued() == [2, 7] and te.outstanding() == 3
    at(clock, 7.9)
    assert te.poll() == [] and torch.count_nonzero(pool.buf[0]) == 0  # bytes arrive with the landing
    at(clock, 20.0)
    assert times(te.poll()) == [(5, 0.0, 8.0, True), (2, 8.0, 16.0, True)]
    at(clock, 24.0)
    got = te.poll()
    assert times(got) == [(7, 16.0, 24.0, True)] and got[0].tag == 13
    for eid, slot in ((5, 0), (2, 3), (7, 1)):
        assert torch.equal(pool.buf[slot], store.buf[eid])
    assert torch.count_nonzero(pool.buf[2]) == 0
    assert te.idle() and te.stats.copies == 3 and te.stats.busy_s == 24.0 and te.stats.max_queued == 2
    assert torch.equal(pool.lookup, torch.full_like(pool.lookup, -1))  # the engine never touches lookup


def test_pause_holds_queued_copies_and_resume_starts_the_next_at_once():
    _, _, te, clock = make()
    te.submit(0, 0)
    at(clock, 1.0)
    te.pause()
    te.submit(1, 1)
    at(clock, 30.0)
    assert times(te.poll()) == [(0, 0.0, 8.0, True)] and te.queued() == [1]
    te.resume()
    at(clock, 38.0)
    assert times(te.poll()) == [(1, 30.0, 38.0, True)]


def test_copy_now_takes_the_link_at_the_prefetchs_next_chunk_and_it_resumes_after():
    """A prefetch on the link since t=0 (due at 8); at t=2.5 two on-demand copies ask for it: they start at the
    chunk boundary t=3 and hold it to 19; the prefetch resumes with its 5 s left (lands at 24, its own busy time
    still 8 s); a copy queued behind it starts at 24."""
    store, pool, te, clock = make()
    te.submit(0, 0, 10)
    at(clock, 1.0)
    te.submit(1, 1, 11)
    at(clock, 2.5)
    assert te.copy_now([4, 6], [2, 3]) is True
    assert clock.t == 19.0
    assert torch.equal(pool.buf[2], store.buf[4]) and torch.equal(pool.buf[3], store.buf[6])
    assert te.poll() == []  # no landing for the caller's own copies
    at(clock, 40.0)
    assert times(te.poll()) == [(0, 16.0, 24.0, True), (1, 24.0, 32.0, True)]
    assert te.stats.copies == 4 and te.stats.busy_s == 32.0


def test_copy_now_on_an_idle_link_starts_at_once():
    _, _, te, clock = make()
    at(clock, 3.0)
    assert te.copy_now([2], [0])
    assert clock.t == 11.0


def test_wait_for_a_queued_copy_takes_the_link_like_an_on_demand_copy_even_paused():
    """Copies 0 (on the link from t=0) and 1 (queued); paused; at t=4 the caller waits for 1: copy 0 is exactly at a
    chunk boundary, so 1 runs 4..12 at once; copy 0 resumes with its 4 s left and lands at 16."""
    _, _, te, clock = make()
    te.submit(0, 0)
    te.submit(1, 1)
    te.pause()
    at(clock, 4.0)
    got = te.wait(1)
    assert clock.t == 12.0 and (got.eid, got.started_at, got.finished_at, got.ok) == (1, 4.0, 12.0, True)
    at(clock, 16.0)
    assert times(te.poll()) == [(0, 8.0, 16.0, True)]  # the wait's own landing is not reported again
    assert te.wait(1) is None


def test_wait_for_the_copy_on_the_link_sleeps_to_its_deadline():
    _, _, te, clock = make()
    te.submit(3, 2, 7)
    te.submit(4, 1)
    at(clock, 1.0)
    got = te.wait(3)
    assert clock.t == 8.0 and (got.eid, got.slot, got.tag, got.ok) == (3, 2, 7, True)
    assert te.in_flight() == [4]  # the next copy started at 8


def test_wait_timeout_leaves_the_copy_where_it_was():
    _, _, te, clock = make()
    te.submit(0, 0)
    te.submit(1, 1)
    with pytest.raises(TimeoutError):
        te.wait(1, timeout=2.0)
    assert clock.t == 2.0 and te.in_flight() == [0] and te.queued() == [1]
    with pytest.raises(TimeoutError):
        te.wait(0, timeout=1.0)
    assert te.wait(0, timeout=10.0).finished_at == 8.0


def test_cancel_reports_not_ok_and_never_touches_the_slot():
    _, pool, te, clock = make()
    te.submit(0, 0)
    te.submit(3, 1, 5)
    at(clock, 2.0)
    assert te.cancel(3) and not te.cancel(0) and not te.cancel(6)
    got = te.poll()
    assert [(l.eid, l.tag, l.ok, l.error, l.started_at) for l in got] == [(3, 5, False, "cancelled", None)]
    at(clock, 50.0)
    te.poll()
    assert torch.count_nonzero(pool.buf[1]) == 0 and te.stats.cancelled == 1 and te.stats.copies == 1


def test_a_failed_copy_lands_not_ok_with_its_error():
    store, _, te, clock = make()

    def broken(eid, dst, non_blocking=False):
        raise OSError("disk gone")

    store.copy_to = broken
    te.submit(2, 0)
    at(clock, 8.0)
    got = te.poll()
    assert len(got) == 1 and not got[0].ok and got[0].error == "OSError: disk gone" and te.stats.failed == 1
    with pytest.raises(RuntimeError, match="on-demand copy of expert 3 failed: OSError: disk gone"):
        te.copy_now([3], [1])


def test_without_emulation_copies_land_at_the_next_call():
    store, pool, te, clock = make(spe=None)
    te.submit(1, 0, 3)
    te.submit(2, 1, 4)
    got = te.poll()
    assert [(l.eid, l.ok) for l in got] == [(1, True), (2, True)] and clock.t == 0.0
    assert torch.equal(pool.buf[1], store.buf[2])
    assert te.copy_now([5], [2]) and torch.equal(pool.buf[2], store.buf[5])


def test_close_cancels_or_drains_the_queue():
    _, _, te, clock = make()
    te.submit(0, 0)
    te.submit(1, 1)
    te.close()
    assert clock.t == 8.0 and [(l.eid, l.ok) for l in te.poll()] == [(1, False), (0, True)]
    with pytest.raises(MoeOffloadError, match="closed"):
        te.submit(2, 2)
    assert te.copy_now([2], [2]) is False and not te.worker_alive
    _, _, te, clock = make()
    te.submit(0, 0)
    te.submit(1, 1)
    te.pause()
    te.close(drain=True)
    assert clock.t == 16.0 and [(l.eid, l.ok) for l in te.poll()] == [(0, True), (1, True)]


def test_bad_arguments():
    store, pool, te, _ = make()
    for kw in ({"link_gbps": 0}, {"seconds_per_expert": -1.0}, {"link_gbps": "fast"},
               {"link_gbps": 1.0, "seconds_per_expert": 0.1}):
        with pytest.raises(MoeOffloadError):
            VirtualLinkEngine(store, pool, **kw)
    with pytest.raises(MoeOffloadError, match="out of range"):
        te.submit(N_EXPERTS, 0)
    with pytest.raises(MoeOffloadError, match="out of range"):
        te.submit(0, N_SLOTS)
    with pytest.raises(MoeOffloadError, match="out of range"):
        te.copy_now([0], [N_SLOTS])
    te.submit(0, 0)
    with pytest.raises(MoeOffloadError, match="already queued"):
        te.submit(0, 1)
    assert VirtualLinkEngine(store, pool, link_gbps=1.0).seconds_per_expert == store.layout.expert_bytes / 1e9


def test_make_transfer_engine_picks_the_virtual_link_for_a_cpu_pool():
    store, pool, _, _ = make()
    te = make_transfer_engine(store, pool, seconds_per_expert=0.001)
    assert isinstance(te, VirtualLinkEngine) and te.seconds_per_expert == 0.001
    assert not isinstance(te, TransferEngine)
