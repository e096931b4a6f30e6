"""Graph mode end to end on a tiny model: the decode step compiles with ``fullgraph=True`` (no graph break), is not
recompiled across steps and requests, and generates FullLoad's tokens with the experts offloaded."""

from __future__ import annotations

import json

import pytest
import torch

from moe_offload.errors import MoeOffloadError
from moe_offload.generation.generate import run
from moe_offload.models.loader import load_full
from moe_offload.graph.decode import GraphDecoder, load_graph, run_graph

PROMPTS = ["hello there", "the sea and the wind"]


def test_graph_decode_equals_full_load(tiny_dirs, one_thread, tmp_path, monkeypatch):
    monkeypatch.setenv("MOE_OFFLOAD_CACHE", str(tmp_path))  # where the compile time is remembered
    path = tiny_dirs["mixtral"]
    full = load_full(path, device="cpu")
    ref = [o.token_ids for o in run(full, PROMPTS, 6)[0]]
    lm = load_graph(path, residency=0.5, policy="lru", device="cpu")
    torch._dynamo.utils.counters.clear()
    dec = GraphDecoder(lm, backend="aot_eager")
    outs, stats = run_graph(lm, PROMPTS[:1], 6, decoder=dec)  # compiles the step once
    assert not torch._dynamo.utils.counters["graph_break"]
    # the compiling step is out of the decode rate: 6 tokens, the first from the prefill, the second compiled
    assert len(outs[0].token_ids) == 6 and stats.decode_tokens == 4 and dec.last_compile_steps == 1
    compiled = dec.compile_s
    assert compiled > 0
    assert json.loads((tmp_path / "compile_times.json").read_text()) == {dec._compile_key(): [round(compiled, 1)] * 2}
    with torch._dynamo.config.patch(error_on_recompile=True):  # every further step and request: no recompile
        outs, stats = run_graph(lm, PROMPTS, 6, decoder=dec)
    assert dec.compile_s == compiled and dec.last_compile_steps == 0
    assert stats.decode_tokens == sum(len(o.token_ids) - 1 for o in outs)
    assert [o.token_ids for o in outs] == ref
    assert stats.offload.misses > 0 and stats.offload.hits > 0
    lm.close()


def test_graph_refuses_unsupported_policy(tiny_dirs):
    with pytest.raises(MoeOffloadError, match="supports the policies"):
        load_graph(tiny_dirs["mixtral"], policy="lfru")


@pytest.mark.parametrize("arch,policy", [("mixtral", "lfu"), ("gpt_oss", "lru"), ("qwen3_moe", "seqmoe-cacheonly"),
                                         ("deepseek_v3", "lru")])
def test_graph_engine_eager_equals_full_load(tiny_dirs, one_thread, arch, policy):
    """The graph engine's ops run eagerly too (prefill always does): FullLoad's tokens on several layouts (biases,
    shared experts), with misses."""
    path = tiny_dirs[arch]
    ref = [o.token_ids for o in run(load_full(path, device="cpu"), PROMPTS, 6)[0]]
    lm = load_graph(path, residency=0.5, policy=policy, device="cpu")
    outs, stats = run(lm, PROMPTS, 6)
    assert [o.token_ids for o in outs] == ref
    assert stats.offload.misses > 0
    lm.close()
    if policy != "seqmoe-cacheonly":  # the Python runtime, same model and routing: the same hits and misses
        from moe_offload.models.loader import load_offloaded

        py = load_offloaded(path, device="cpu", residency=0.5, policy=policy, progress=False)
        py_stats = run(py, PROMPTS, 6)[1].offload
        assert (stats.offload.hits, stats.offload.misses) == (py_stats.hits, py_stats.misses)


@pytest.mark.slow
def test_graph_decode_inductor(tiny_dirs, one_thread):
    """The default backend (inductor, generated kernels): no graph break, no recompile, FullLoad's tokens."""
    path = tiny_dirs["mixtral"]
    ref = [o.token_ids for o in run(load_full(path, device="cpu"), PROMPTS, 6)[0]]
    lm = load_graph(path, residency=0.5, policy="lfu", device="cpu")
    torch._dynamo.utils.counters.clear()
    dec = GraphDecoder(lm)
    run_graph(lm, PROMPTS[:1], 3, decoder=dec)
    assert not torch._dynamo.utils.counters["graph_break"]
    with torch._dynamo.config.patch(error_on_recompile=True):
        outs, _ = run_graph(lm, PROMPTS, 6, decoder=dec)
    assert [o.token_ids for o in outs] == ref
    lm.close()


def test_graph_predictor_same_decisions_as_python_runtime(tiny_dirs, one_thread, random_pset):
    """Probabilistic Belady driven by the predictor inside the step (eager, then compiled): the same hits and misses
    as the Python runtime's ForecastFeed at rollout every step, and FullLoad's tokens."""
    from moe_offload.models.loader import load_offloaded
    from moe_offload.predictor.attach import attach_predictor
    from moe_offload.graph.predictor import GraphPredictor

    path = tiny_dirs["qwen3_moe"]
    ref = [o.token_ids for o in run(load_full(path, device="cpu"), PROMPTS, 8)[0]]
    py = load_offloaded(path, device="cpu", residency=0.4, policy="seqmoe-cacheonly", progress=False)
    attach_predictor(py.engine, random_pset(py, 3), rollout_every=1)
    py_out, py_stats = run(py, PROMPTS, 8)
    torch._dynamo.utils.counters.clear()
    for compiled in (False, True):  # each from a cold slot pool, as the Python run
        lm = load_graph(path, residency=0.4, policy="seqmoe-cacheonly", device="cpu")
        lm.engine.predictor = GraphPredictor(random_pset(lm, 3), lm.engine.cache)
        outs, stats = (run_graph(lm, PROMPTS, 8, decoder=GraphDecoder(lm, backend="aot_eager")) if compiled
                       else run(lm, PROMPTS, 8))
        assert [o.token_ids for o in outs] == ref == [o.token_ids for o in py_out]
        assert (stats.offload.hits, stats.offload.misses) == (py_stats.offload.hits, py_stats.offload.misses)
        lm.close()
    assert not torch._dynamo.utils.counters["graph_break"]


def test_graph_lookup_only_equals_full_load(tiny_dirs, one_thread):
    """At residency 1.0 ``load_graph`` preloads every expert into the slot of its global id and turns the step's
    cache decisions off (lookup-only, the A/B baseline of ``bench graph``): FullLoad's tokens, every distinct expert
    of a layer counted a hit, exactly as the same decoder counts with the decisions back on; lookup-only needs the
    preload, the preload a slot per expert."""
    path = tiny_dirs["mixtral"]
    ref = [o.token_ids for o in run(load_full(path, device="cpu"), PROMPTS, 6)[0]]
    lm = load_graph(path, residency=1.0, policy="lru", device="cpu")
    assert lm.engine.preloaded and lm.engine.lookup_only
    assert all(lm.engine._direct)  # every layer through the kernel's operator on the pool's views
    assert lm.engine.cache.slots_of() == list(range(lm.engine.cache.N))
    dec = GraphDecoder(lm, backend="aot_eager")
    outs, stats = run_graph(lm, PROMPTS, 6, decoder=dec)
    assert [o.token_ids for o in outs] == ref
    assert stats.offload.misses == 0 and stats.offload.bytes_loaded == 0
    lookup_hits = stats.offload.hits
    lm.engine.set_lookup_only(False)
    outs, stats = run_graph(lm, PROMPTS, 6, decoder=dec)
    assert [o.token_ids for o in outs] == ref
    assert (stats.offload.hits, stats.offload.misses, stats.offload.bytes_loaded) == (lookup_hits, 0, 0)
    assert lookup_hits > 0
    lm.close()
    small = load_graph(path, residency=0.5, policy="lru", device="cpu")
    assert not small.engine.lookup_only
    with pytest.raises(MoeOffloadError, match="call preload_all first"):
        small.engine.set_lookup_only(True)
    with pytest.raises(MoeOffloadError, match="needs a slot for every expert"):
        small.engine.preload_all()
    small.close()


def test_bench_graph_ab_rows(tiny_dirs, one_thread):
    """``bench graph`` with residency 1.0: the policy's lookup-only row next to it, tokens equal FullLoad's in every
    row, and the A/B management line for the policy."""
    from moe_offload.bench.graph import LOOKUP_ONLY, bench_graph

    table = bench_graph(tiny_dirs["mixtral"], PROMPTS[:1], [1.0, 0.5], policy="lru", max_new_tokens=4, rounds=2,
                        backend="aot_eager", device="cpu")
    rows = [ln for ln in table.splitlines() if ln.startswith("| graph") or ln.startswith("| FullLoad")]
    assert [r.split("|")[1].strip() for r in rows[:4]] == ["FullLoad compiled", "graph lru", f"graph lru {LOOKUP_ONLY}",
                                                           "graph lru"]
    assert [r.split("|")[5].strip() for r in rows[:4]] == ["-", "1.0000", "-", rows[3].split("|")[5].strip()]
    assert all(r.split("|")[6].strip() == "yes" for r in rows[:4])
    assert "- graph lru: " in table and "(1.00: " in table and ", 0.50: " in table


def test_graph_seqmoe_prefetching_equals_full_load(tiny_dirs, one_thread, random_pset, tmp_path):
    """``seqmoe`` in graph mode: probabilistic Belady plus JSD prefetching by the CPU worker through the control
    region, eager and compiled. FullLoad's tokens; the worker requested and copied experts, and every reservation
    it was granted was copied (no Fetch slot left waiting once the run is over)."""
    import time

    from moe_offload.runtime.graph.prefetch import GRANT_SHIFT

    path = tiny_dirs["qwen3_moe"]
    ref = [o.token_ids for o in run(load_full(path, device="cpu"), PROMPTS, 8)[0]]
    probe = load_graph(path, residency=0.6, policy="lru", device="cpu")
    pdir = random_pset(probe, 3).save(tmp_path / "pred")
    probe.close()
    torch._dynamo.utils.counters.clear()
    for compiled in (False, True):
        lm = load_graph(path, residency=0.6, policy="seqmoe", device="cpu", predictor=str(pdir))
        pf = lm.engine.prefetcher
        outs, stats = (run_graph(lm, PROMPTS, 8, decoder=GraphDecoder(lm, backend="aot_eager")) if compiled
                       else run(lm, PROMPTS, 8))
        assert [o.token_ids for o in outs] == ref
        deadline = time.time() + 5
        granted = lambda: pf.ctrl.grant >> GRANT_SHIFT  # noqa: E731
        while (granted() > pf.ctrl.done_tag).any() and time.time() < deadline:
            time.sleep(0.01)
        assert not (granted() > pf.ctrl.done_tag).any()  # every granted copy was made and its tag returned
        assert pf.requested > 0 and pf.copied > 0 and pf.failed is None
        assert int(lm.engine.cache.landed) + pf.waited > 0  # prefetched experts landed or were waited for
        assert stats.offload.hits > 0
        lm.close()
        assert not pf._thread.is_alive()
    assert not torch._dynamo.utils.counters["graph_break"]


def _oracle_select(pf, needs: dict, L: int, E: int):
    """A scheduler ``select`` for ``pf``'s worker that asks, one at a time, for the experts the current request's
    decode steps use at least one step after ``pos`` (``needs[(request, step)]``: per MoE layer the experts the run
    routes to, from a trace of the same tokens), so that every granted expert is needed later."""
    from moe_offload.core.prefetch import PrefetchTask

    asked = set()

    def select(pos, b_cur=None, capacity=None):
        request = pf._request
        for (r, step), layers in sorted(needs.items()):
            for layer, experts in enumerate(layers):
                ddl = (step - 1) * L + layer
                if r != request or ddl < pos + L:
                    continue
                for e in experts:
                    if (r, step, layer, e) not in asked:
                        asked.add((r, step, layer, e))
                        return PrefetchTask(eid=layer * E + e, conf=1.0, ddl=ddl, layer=layer, expert=e, step=step)
        return None
    return select


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_graph_seqmoe_waits_for_prefetch_copies(tiny_dirs, one_thread, random_pset, tmp_path, monkeypatch, backend):
    """A worker that copies only while a layer waits: every prefetched expert a layer needs is adopted in flight and
    waited for by tag inside the compiled step (the grants reach the worker during the step, not at its end).
    Its scheduler asks only for experts a later step of the request uses (the routing of a trace of the same
    tokens), so a copy is waited for whatever the worker's timing. FullLoad's tokens (under inductor, whose own
    exp/SiLU may drift from eager: its lru run's tokens). Under inductor this failed while the graph read the control
    region itself at layer 0: a request read in two kernels, with the worker writing between them, gave a grant and a
    reservation for different experts."""
    import threading

    from moe_offload.models.loader import load_offloaded
    from moe_offload.runtime.graph.engine import GraphEngine
    from moe_offload.runtime.graph.prefetch import GraphPrefetcher
    from moe_offload.trace.collect import TraceRecorder

    path = tiny_dirs["qwen3_moe"]
    probe = load_graph(path, residency=0.6, policy="lru", device="cpu")
    pdir = random_pset(probe, 3).save(tmp_path / "pred")
    if backend == "aot_eager":
        ref = [o.token_ids for o in run(load_full(path, device="cpu"), PROMPTS, 12)[0]]
    else:
        ref = [o.token_ids for o in run_graph(probe, PROMPTS, 12, decoder=GraphDecoder(probe))[0]]
    probe.close()
    eager = load_offloaded(path, device="cpu", residency=0.6, progress=False)
    with TraceRecorder(eager) as rec:
        run(eager, PROMPTS, 12, recorder=rec)
        tr = rec.trace()
    needs = {(int(r), int(st)): [set(ids.tolist()) for ids in row]
             for r, st, row in zip(tr.request, tr.step, tr.expert_ids) if st >= 1}
    waiting = threading.Event()
    copy, wait = GraphPrefetcher._copy_granted, GraphEngine.wait_fetches

    def copy_when_waited_for(self):
        return copy(self) if waiting.is_set() else False

    def wait_flagged(self, slots, valid):
        waiting.set()
        try:
            wait(self, slots, valid)
        finally:
            waiting.clear()

    monkeypatch.setattr(GraphPrefetcher, "_copy_granted", copy_when_waited_for)
    monkeypatch.setattr(GraphEngine, "wait_fetches", wait_flagged)
    lm = load_graph(path, residency=0.6, policy="seqmoe", device="cpu", predictor=str(pdir))
    pf = lm.engine.prefetcher
    pf.max_outstanding = 8  # copies only finish when waited for: let more requests be pending
    pf.scheduler.select = _oracle_select(pf, needs, lm.num_moe_layers, lm.num_experts)
    outs, _ = run_graph(lm, PROMPTS, 12, decoder=GraphDecoder(lm, backend=backend))
    assert [o.token_ids for o in outs] == ref
    assert pf.waited > 0 and pf.copied > 0
    lm.close()


def test_graph_seqmoe_needs_a_predictor(tiny_dirs):
    with pytest.raises(MoeOffloadError, match="needs --predictor"):
        load_graph(tiny_dirs["qwen3_moe"], policy="seqmoe")


def test_graph_backend_failure_is_one_line(tiny_dirs):
    """A compiler backend that fails inside its own code generation is reported as one MoeOffloadError naming the
    way around it, not as the compiler's traceback."""
    lm = load_graph(tiny_dirs["mixtral"], residency=0.5, policy="lru", device="cpu")
    dec = GraphDecoder(lm, backend="aot_eager")

    def broken(*args):
        raise torch._dynamo.exc.BackendCompilerFailed(lambda: None, KeyError("buf248"), None)

    dec.step = broken
    with pytest.raises(MoeOffloadError, match="aot_eager backend failed to compile the decode step.*KeyError"):
        run_graph(lm, PROMPTS[:1], 3, decoder=dec)
    lm.close()
