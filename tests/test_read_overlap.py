"""A layer's misses read from disk while its resident experts compute (``runtime.read_overlap``, issue 47): the
tokens stay FullLoad's, the decisions do not change, and a failed read still reaches the caller."""

from __future__ import annotations

import threading

import pytest

from moe_offload.errors import MoeOffloadError
from moe_offload.generation.generate import encode_prompt, generate_ids
from moe_offload.models.loader import load_full, load_offloaded
from moe_offload.runtime.kernels import native

PROMPTS = ["The slot pool is shared by all MoE layers.", "Explain KV caches."]

pytestmark = pytest.mark.skipif(native() is None, reason="the overlap runs on the native experts kernel")


def _tokens(lm, n: int = 6) -> list[list[int]]:
    return [generate_ids(lm, encode_prompt(lm.tokenizer, p), n)[0] for p in PROMPTS]


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_overlap_keeps_tokens_and_decisions(tiny_dirs, arch):
    """LRU from disk with and without the overlap: FullLoad's tokens, the same hits and misses; the overlap ran."""
    want = _tokens(load_full(tiny_dirs[arch], device="cpu"))
    runs = {}
    for enabled in (True, False):
        lm = load_offloaded(tiny_dirs[arch], device="cpu", residency=0.3, progress=False, host_store="disk")
        lm.engine._overlap.enabled = enabled
        got = _tokens(lm)
        st = lm.engine.stats
        runs[enabled] = (got, st.hits, st.misses, lm.engine._overlap.layers)
        lm.close()
    assert runs[True][0] == runs[False][0] == want
    assert runs[True][1:3] == runs[False][1:3] and runs[True][2] > 0
    assert runs[True][3] > 0 and runs[False][3] == 0


def test_overlap_with_prefetches_keeps_tokens(tiny_dirs):
    """xl+gate from disk (prefetches on the copy worker, misses on the overlap thread): FullLoad's tokens."""
    from moe_offload.predictor.cross_layer import attach_forecasts

    d = tiny_dirs["qwen3_moe"]
    want = _tokens(load_full(d, device="cpu"))
    lm = load_offloaded(d, device="cpu", residency=0.3, policy="xl+gate", progress=False, host_store="disk")
    attach_forecasts(lm, "xl+gate", None)
    assert _tokens(lm) == want and lm.engine._overlap.layers > 0
    lm.close()


def test_failed_read_reaches_the_caller(tiny_dirs):
    """A read that fails on the overlap thread raises its error in the layer that needed it, after the compute."""
    lm = load_offloaded(tiny_dirs["qwen3_moe"], device="cpu", residency=0.3, progress=False, host_store="disk")
    store = lm.engine.store
    real = store.copy_many

    def broken(*args, **kwargs):  # the prefill's reads (several tokens: no overlap) succeed
        if threading.current_thread().name.startswith("moe-offload-overlap"):
            raise MoeOffloadError("reading model.safetensors failed: Input/output error")
        return real(*args, **kwargs)

    store.copy_many = broken
    with pytest.raises(MoeOffloadError, match="Input/output error"):
        _tokens(lm, 4)
    assert lm.engine._overlap.layers > 0
    del store.copy_many
    lm.close()


def test_a_thread_that_cannot_start_does_not_hang(monkeypatch):
    """The overlap thread's start-up failing (its core pinning raising): ``start`` returns the failed future instead
    of waiting for a thread that never runs; after ``close`` it no longer applies and ``start`` refuses."""
    from concurrent.futures import BrokenExecutor
    from types import SimpleNamespace

    from moe_offload.runtime import read_overlap

    def no_affinity():
        raise OSError("sched_setaffinity: Invalid argument")

    monkeypatch.setattr(read_overlap, "pin_io_thread", no_affinity)
    ov = read_overlap.ReadOverlap()
    fut = ov.start(lambda rnd: None, SimpleNamespace(loads=[1]))
    with pytest.raises(BrokenExecutor):
        fut.result(timeout=10)
    ov.close()
    rnd = SimpleNamespace(loads=[1], waits=[], eids=[1, 2])
    assert not ov.applies(rnd, SimpleNamespace(device=SimpleNamespace(type="cpu")), SimpleNamespace(mode="disk"))
    with pytest.raises(RuntimeError, match="closed"):
        ov.start(lambda rnd: None, rnd)


def test_overlapped_misses_cost_the_meter_their_visible_wait(tiny_dirs):
    """The cost meter is fed what an overlapped layer's misses cost the step: their 6 ms of reads, of which 1 ms
    was waited for, count 1 ms; a wait longer than the reads (prefetches in flight) counts the reads' 6 ms."""
    lm = load_offloaded(tiny_dirs["qwen3_moe"], device="cpu", residency=0.3, policy="xl+gate", progress=False,
                        host_store="disk")
    pf = lm.engine.prefetcher
    pf._demand, pf._last_demand_s = [2, 0.010], 0.006
    pf.overlapped(0.001)
    assert pf._demand == [2, pytest.approx(0.005)] and pf._last_demand_s == 0.0
    pf._demand, pf._last_demand_s = [2, 0.010], 0.006
    pf.overlapped(0.5)
    assert pf._demand == [2, pytest.approx(0.010)]
    lm.close()
