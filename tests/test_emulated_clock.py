"""runtime.emulated_clock: emulated waits slept on the wall clock, or skipped on a virtual clock that jumps over them
(what every engine timer and the virtual link read)."""

import time

import pytest
import torch

from moe_offload.errors import MoeOffloadError
from moe_offload.runtime import emulated_clock as ec
from moe_offload.runtime.pool import SlotPool
from moe_offload.runtime.store import ExpertLayout, HostStore
from moe_offload.runtime.virtual_link import VirtualLinkEngine


def test_skipped_wait_moves_the_clock_not_the_wall():
    """A 5 s wait while skipping returns at once; the clock is 5 s further on and stays there after the block."""
    assert not ec.skipping()
    with ec.skipping_waits():
        assert ec.skipping()
        wall0, t0 = time.perf_counter(), ec.now()
        ec.wait_until(t0 + 5.0)
        ec.wait_until(t0 + 1.0)  # already past: nothing to skip
        assert time.perf_counter() - wall0 < 0.5
        assert ec.now() - t0 >= 5.0
    assert not ec.skipping()
    assert ec.now() - t0 >= 5.0  # the clock never goes back


def test_slept_wait_on_the_skipped_clock():
    """Sleeping, a deadline on the clock (which includes earlier skips) costs its real distance, no more."""
    with ec.skipping_waits():
        ec.wait_until(ec.now() + 3.0)
    wall0, t0 = time.perf_counter(), ec.now()
    ec.wait_until(t0 + 0.05)
    waited = time.perf_counter() - wall0
    assert 0.05 <= waited < 1.0 and ec.now() >= t0 + 0.05


def test_nested_blocks_restore_the_mode():
    with ec.skipping_waits():
        with ec.skipping_waits(False):
            assert not ec.skipping()
        assert ec.skipping()
    assert not ec.skipping()


def test_virtual_link_copies_skip_their_link_time():
    """On-demand copies of 3 experts at 2 s each: the bytes are in their slots, the clock moved 6 s, the wall
    hardly; a prefetch lands when the (skipped) clock passes its deadline."""
    layout = ExpertLayout([("w1", (4, 4))], torch.float32)
    store = HostStore(layout, 6)
    store.buf.view(torch.float32).copy_(torch.arange(6 * 16, dtype=torch.float32).view(6, -1))
    pool = SlotPool(layout, 4, 6, torch.device("cpu"))
    te = VirtualLinkEngine(store, pool, seconds_per_expert=2.0)
    with ec.skipping_waits():
        wall0, t0 = time.perf_counter(), ec.now()
        assert te.copy_now([1, 4, 5], [0, 1, 2])
        assert ec.now() - t0 >= 6.0 and time.perf_counter() - wall0 < 1.0
        for slot, eid in ((0, 1), (1, 4), (2, 5)):
            assert torch.equal(pool.buf[slot], store.buf[eid])
        te.submit(3, 3, tag=7)
        assert te.poll() == []
        got = te.wait(3)
        assert got.ok and got.tag == 7 and torch.equal(pool.buf[3], store.buf[3])
        assert ec.now() - t0 >= 8.0 and time.perf_counter() - wall0 < 1.0
    te.close()


def test_skip_refused_off_the_cpu():
    ec.check_skip_device(True, torch.device("cpu"))
    ec.check_skip_device(False, "cuda")
    with pytest.raises(MoeOffloadError, match="--emulated-waits skip needs the CPU, not cuda:0"):
        ec.check_skip_device(True, "cuda:0")
