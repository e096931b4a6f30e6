"""Cross-layer forecasts (issue 21): the next layers' routers on this layer's router input, alone (policy ``xl``)
or blended with SeqMoE's forecasts (``seqmoe-xl``): the router calls equal the model's own routing on every served
architecture (or are refused in one line), the runtime's forecasts equal the simulator's replay of the recorded
trace, and the tokens stay FullLoad's."""

import json

import numpy as np
import pytest
import torch

from moe_offload.errors import MoeOffloadError
from moe_offload.runtime.cross_layer import CrossLayerForecaster, xl_probabilities

SERVED = []
try:
    from moe_offload.architectures.supported import load_record

    SERVED = [r["model_type"] for r in load_record()["types"] if r["status"] == "served"]
except Exception:  # noqa: BLE001 - no record: the sweep test below is skipped
    pass


def _tiny_model(model_type: str):
    """A tiny random model of ``model_type`` with its weights in memory (no checkpoint) and random router biases."""
    from moe_offload.models.capability import generation_class
    from moe_offload.models.tiny import tiny_config

    _, config = tiny_config(model_type)
    torch.manual_seed(0)
    model = generation_class(config)[0].from_config(config).eval()
    with torch.no_grad():
        for name, p in list(model.named_parameters()) + list(model.named_buffers()):
            if name.endswith(("router.weight", "gate.weight")) or name.endswith(("expert_bias", "correction_bias")):
                p.normal_(0.0, 0.3 if name.endswith("weight") else 0.1)
    return model


@pytest.mark.parametrize("model_type", SERVED)
def test_router_calls_equal_the_models_routing(model_type):
    """Each MoE layer's router called by the forecaster on the input its router received (distance 0) chooses
    exactly the top-k its experts module received, bitwise, on every served architecture — or the forecaster
    refuses the model type in one line (a router that needs more than the hidden state)."""
    from moe_offload.models.capability import experts_modules

    model = _tiny_model(model_type)
    mods = experts_modules(model)
    try:
        fc = CrossLayerForecaster(model, mods, mods[0][1].num_experts, depth=2)
    except MoeOffloadError as e:
        assert "\n" not in str(e) and "cannot be applied" in str(e)
        return
    seen = {}

    def grab(i):
        def hook(mod, args, kwargs):
            seen[i] = (args[1] if len(args) > 1 else kwargs["top_k_index"]).clone()
        return hook

    handles = [m.register_forward_pre_hook(grab(i), with_kwargs=True) for i, (_, m) in enumerate(mods)]
    ids = torch.randint(3, 200, (1, 7))
    with torch.no_grad():
        model(input_ids=ids)
        for h in handles:
            h.remove()
        for layer in range(len(mods)):
            got = fc.route(layer, fc.inputs[layer])[2].reshape(seen[layer].shape)
            assert torch.equal(got.sort(-1).values, seen[layer].sort(-1).values), (model_type, layer)
            p = xl_probabilities(fc.route(layer, fc.inputs[layer]), fc.E)
            k = seen[layer].shape[-1]
            assert torch.equal(p.topk(k, -1).indices.sort(-1).values, seen[layer].reshape(-1, k).sort(-1).values)
        assert fc.probs(len(mods) - 1) is None
        if len(mods) > 1:
            assert fc.probs(0).shape == (min(2, len(mods) - 1), fc.E)
        for layer in range(len(mods) - 1):  # probs (one stacked GEMM where the routers allow) == router by router
            n = min(2, len(mods) - 1 - layer)
            x = fc.inputs[layer]
            want = torch.stack([xl_probabilities(fc.route(layer + 1 + j, x), fc.E).mean(0) for j in range(n)])
            got = torch.from_numpy(fc.probs(layer))
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
            top = [torch.sort(t, dim=-1, descending=True, stable=True).indices[:, :k] for t in (got, want)]
            assert torch.equal(*top), (model_type, layer)
            x1 = x[..., -1:, :]                  # one token (a decode step: numpy for float32 on the CPU)
            fc.inputs[layer] = x1
            want = torch.stack([xl_probabilities(fc.route(layer + 1 + j, x1), fc.E).mean(0) for j in range(n)])
            got = torch.from_numpy(fc.probs(layer))
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
            assert torch.equal(*[t.topk(k, -1).indices.sort(-1).values for t in (got, want)]), (model_type, layer)
            fc.inputs[layer] = x
    if model_type in ("mixtral", "qwen3_moe", "qwen2_moe", "olmoe"):
        assert fc._stacked[0] is not None, model_type    # plain linear softmax top-k routers take the GEMM path
    fc.close()


def test_bfloat16_routers_forecast_one_token_in_numpy():
    """A bfloat16 model's linear softmax routers take the one-token numpy path too (their weights widened once):
    the forecast equals the routers' own to bfloat16 rounding, with the same top-k."""
    from moe_offload.models.capability import experts_modules

    model = _tiny_model("mixtral").to(torch.bfloat16)
    mods = experts_modules(model)
    fc = CrossLayerForecaster(model, mods, mods[0][1].num_experts, depth=2)
    assert fc._host_w[0] is not None   # the native kernel's bfloat16 weights, or numpy's widened copy
    with torch.no_grad():
        model(input_ids=torch.randint(3, 200, (1, 5)))
        k = model.config.num_experts_per_tok
        for layer in range(len(mods) - 1):
            n = min(2, len(mods) - 1 - layer)
            x1 = fc.inputs[layer][..., -1:, :]
            fc.inputs[layer] = x1
            want = torch.stack([xl_probabilities(fc.route(layer + 1 + j, x1), fc.E).mean(0) for j in range(n)])
            got = torch.from_numpy(fc.probs(layer))
            torch.testing.assert_close(got, want, rtol=0.05, atol=2e-3)
            assert torch.equal(*[t.topk(k, -1).indices.sort(-1).values for t in (got, want)]), layer
    fc.close()


class _Record:
    """A consumer that keeps every forecast it is handed."""

    def __init__(self):
        self.got = []

    def observe(self, f):
        self.got.append(f)


def _attach_xl(lm, runner=None):
    from moe_offload.models.capability import experts_modules
    from moe_offload.predictor.cross_layer import CrossLayerFeed

    rec = _Record()
    fc = CrossLayerForecaster(lm.model, experts_modules(lm.model), lm.num_experts)
    feed = CrossLayerFeed(fc, [lm.engine.table.policy, rec], runner)
    lm.engine.observers.append(feed)
    return rec


@pytest.mark.parametrize("store", ["pinned", "disk"])
@pytest.mark.parametrize("blend", [False, True])
def test_xl_eviction_runtime_equals_simulator(tiny_dirs, random_pset, blend, one_thread, store):
    """Probabilistic Belady fed cross-layer forecasts (alone, or blended with a predictor's): the forecasts the
    runtime handed over equal the simulator's replay of the trace recorded with them (``xl_stream``) — bitwise for
    the cross-layer forecasts alone; blended, up to the float16 routing weights a trace stores, which the
    predictor's input is computed from — and so do the hits and misses; tokens equal FullLoad's. From disk the
    forecasts are handed over while the misses are read (``runtime.read_overlap``), in the same decision order."""
    from moe_offload.generation.generate import run
    from moe_offload.models.loader import load_full, load_offloaded
    from moe_offload.core.forecast import ROLLOUT
    from moe_offload.predictor.runtime import PredictorRunner
    from moe_offload.sim.forecasts import xl_stream
    from moe_offload.sim.simulator import replay
    from moe_offload.trace.collect import TraceRecorder

    prompts = ["a b c", "hello there"]
    ref, _ = run(load_full(tiny_dirs["mixtral"]), prompts, 8)
    lm = load_offloaded(tiny_dirs["mixtral"], residency=0.5, policy="seqmoe-cacheonly", progress=False,
                        host_store=store)
    pset = random_pset(lm, seed=4) if blend else None
    with TraceRecorder(lm, xl_depth=3) as tracer:
        rec = _attach_xl(lm, PredictorRunner(pset, rollout=ROLLOUT) if blend else None)
        outs, st = run(lm, prompts, 8, recorder=tracer)
        tr = tracer.trace()
    assert (lm.engine._overlap.layers > 0) == (store == "disk")
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    stream = xl_stream(tr, pset)
    sim_fc = [f for events in stream for _, f in events]
    run_fc = [f for f in rec.got]
    assert len(run_fc) == len(sim_fc) > 0 and any(f.cross_layer for f in sim_fc)
    for a, b in zip(run_fc, sim_fc):
        assert (a.step, a.layers, a.cross_layer) == (b.step, b.layers, b.cross_layer)
        pa, pb = (torch.as_tensor(np.asarray(f.probs)) for f in (a, b))  # cross-layer forecasts are numpy
        assert torch.equal(pa, pb) if not blend else torch.allclose(pa, pb, atol=1e-3)
    if blend:  # row 0 of a blended forecast mixes both; the rows of the predictor's rollout still ahead follow
        assert {f.probs.shape[0] for f in sim_fc if f.cross_layer} <= set(range(2, 2 + ROLLOUT))
    sim = replay(tr, lm.engine.pool.num_slots, "seqmoe-cacheonly", forecasts=stream)
    assert (sim.hits, sim.misses) == (st.offload.hits, st.offload.misses) and sim.misses > 0


@pytest.mark.parametrize("native", [False, True], ids=["numpy", "native"])
def test_layer_cycle_victims_from_disk_equal_the_simulator(tiny_dirs, one_thread, native):
    """The layer-cycle order of the cross-layer policies (``ProbabilisticBelady(layer_cycle=True)``), its victims
    ranked in numpy or by the native kernel, reading its misses from disk while the forecasts are made: the same
    hits and misses as the simulator's replay; the time breakdown charges the forecasts to the predictor and
    the planning to the management (an engine without observers charges nothing to the predictor)."""
    from moe_offload.core.prob_belady import ProbabilisticBelady
    from moe_offload.generation.generate import run
    from moe_offload.models.loader import load_offloaded
    from moe_offload.runtime.kernels import belady_victim_kernel
    from moe_offload.sim.forecasts import xl_stream
    from moe_offload.sim.simulator import replay
    from moe_offload.trace.collect import TraceRecorder

    if native and belady_victim_kernel() is None:
        pytest.skip("the native kernels are not built here")
    prompts = ["a b c", "hello there", "the cat sat on the mat"]
    bare = load_offloaded(tiny_dirs["mixtral"], residency=0.4, policy="lru", progress=False, host_store="disk")
    run(bare, prompts[:1], 4)
    sec = bare.engine.breakdown.seconds  # the planning is management; without observers nothing is the predictor's
    assert sec["predictor"] == 0.0 and sec["management"] > 0.0
    bare.close()
    lm = load_offloaded(tiny_dirs["mixtral"], residency=0.4, policy="seqmoe-cacheonly", progress=False,
                        host_store="disk")
    pol = lm.engine.table.policy
    pol.layer_cycle = True
    pol.victim_kernel = belady_victim_kernel() if native else None
    with TraceRecorder(lm, xl_depth=3) as tracer:
        _attach_xl(lm, None)
        _, st = run(lm, prompts, 10, recorder=tracer)
        tr = tracer.trace()
    assert lm.engine._overlap.layers > 0 and lm.engine.breakdown.seconds["predictor"] > 0
    sim_pol = ProbabilisticBelady(tr.num_experts, horizon=8, lam=0.5, layer_cycle=True)
    sim = replay(tr, lm.engine.pool.num_slots, sim_pol, forecasts=xl_stream(tr, None))
    assert (sim.hits, sim.misses) == (st.offload.hits, st.offload.misses) and sim.misses > 0
    lm.close()


@pytest.mark.parametrize("policy", ["xl", "seqmoe-xl"])
def test_xl_prefetching_lossless_and_close_to_simulator(tiny_dirs, random_pset, policy, tmp_path):
    """The ``xl`` / ``seqmoe-xl`` pipelines (``attach_forecasts``: JSD prefetching + probabilistic Belady) over an
    emulated link: tokens equal FullLoad's, prefetches happen, the hits are within 5% of all accesses of the
    simulator's replay up to the landing times of the asynchronous copies (8% of all accesses: on the shared 2-core
    machine a starved copy worker lands some copies a layer later than the link model), and the cross-layer router
    calls are charged to the breakdown's predictor share."""
    from moe_offload.generation.generate import run
    from moe_offload.models.loader import load_full, load_offloaded
    from moe_offload.predictor.cross_layer import attach_forecasts
    from moe_offload.sim.forecasts import xl_stream
    from moe_offload.sim.prefetch_sim import replay_policy
    from moe_offload.trace.collect import TraceRecorder

    d = tiny_dirs["mixtral"]
    prompts = ["hello world how are you", "the cat sat on the mat", "a b c d e"]
    ref, _ = run(load_full(d), prompts, 12)
    lm = load_offloaded(d, residency=0.5, policy=policy, progress=False, link_epl=2.0, seconds_per_expert=1e-4)
    pset = random_pset(lm, seed=5) if policy == "seqmoe-xl" else None
    with TraceRecorder(lm, xl_depth=3) as tracer:
        attach_forecasts(lm, policy, pset)
        outs, st = run(lm, prompts, 12, recorder=tracer)
        tr = tracer.trace()
    pf = lm.engine.prefetcher
    pf.close()
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    res, _ = replay_policy(tr, policy, lm.engine.pool.num_slots, 2.0, forecasts=xl_stream(tr, pset),
                           prefill_popularity=pset.header.prefill_popularity if pset else None)
    o = st.offload
    assert o.hits + o.misses == res.hits + res.misses
    assert abs(o.hits - res.hits) <= 0.08 * res.accesses, (o.hits, res.hits, res.accesses)
    assert pf.prefetches > 0 and res.prefetches > 0
    assert lm.engine.breakdown.seconds["predictor"] > 0
    tr.save(tmp_path / "t.trace")  # the cross-layer forecasts survive a save / load
    from moe_offload.trace.format import load_trace

    back = load_trace(tmp_path / "t.trace")
    assert back.header["xl_depth"] == 3 and np.array_equal(back.xl_probs, tr.xl_probs)
    assert back.xl_probs.shape == (int((tr.step > 0).sum()), tr.num_moe_layers, 3, tr.num_experts)


def test_cross_layer_tasks_replace_queued_tasks_of_their_deadlines():
    """A cross-layer forecast's tasks replace every queued task of its layers' deadlines in the current step (a
    SeqMoE forecast's, or an earlier layer's cross-layer forecast's); other deadlines keep theirs. Its first layer
    (the next one, due at the position after the one it was made at) gets no tasks: they would expire unselected."""
    from moe_offload.core.jsd import JSDScheduler
    from moe_offload.core.prefetch import position, submit_forecast
    from moe_offload.predictor.runtime import Forecast

    L, E, k = 4, 8, 1
    sched = JSDScheduler(b_avg=1.0)
    seq = torch.zeros(1, L, E)
    seq[0, :, 0] = 0.9   # expert 0 everywhere, then expert 1
    seq[0, :, 1] = 0.1
    submit_forecast(sched, Forecast(0, 2, (0, L), seq), L, E, k)         # for step 3, all layers
    assert {(t.eid, t.ddl) for t in sched.pending()} == {(p * E + q, position(3, p, L)) for p in range(L)
                                                          for q in range(E)} - {(p * E + q, position(3, p, L))
                                                                                for p in range(L) for q in range(4, E)}
    xl = torch.zeros(1, 2, E)
    xl[0, :, 5] = 1.0                                                    # layers 1, 2 of step 3: expert 5 first
    submit_forecast(sched, Forecast(0, 2, (1, 3), xl, cross_layer=True), L, E, k)
    by_ddl = {}
    for t in sched.pending():
        by_ddl.setdefault(t.ddl, set()).add(t.expert)
    assert position(3, 1, L) not in by_ddl                                      # dropped, none queued
    assert by_ddl[position(3, 2, L)] == {5, 0, 1, 2}                            # k + 3 = 4, ties by index
    assert by_ddl[position(3, 0, L)] == by_ddl[position(3, 3, L)] == {0, 1, 2, 3}
    assert next(t.conf for t in sched.pending() if t.ddl == position(3, 2, L) and t.expert == 5) == 1.0
    # made at layer 0: a task due at layer 1 would be discarded by the first selection there (ddl <= pos + 1)
    sched.advance(position(3, 0, L))
    assert all(t.ddl > position(3, 1, L) for t in sched.pending())
    # a forecast of the next layer only queues nothing (and still drops that deadline's tasks)
    submit_forecast(sched, Forecast(0, 2, (3, 4), xl[:, :1], cross_layer=True), L, E, k)
    assert position(3, 3, L) not in {t.ddl for t in sched.pending()}


def test_blend_hand_worked():
    """``mix``: w_j * XL + (1 - w_j) * Seq per layer distance j; ``blend_forecast`` without a current SeqMoE
    forecast gives the cross-layer forecast alone, as a cross-layer Forecast of the next layers."""
    from moe_offload.predictor.blend import blend_forecast, mix

    xl = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 0.0]])
    seq = torch.tensor([[0.0, 1.0], [1.0, 0.0], [0.0, 1.0]])
    out = mix(xl, seq, (0.3, 0.25))
    assert torch.allclose(out, torch.tensor([[0.3, 0.7], [0.75, 0.25], [0.25, 0.75]]))
    f = blend_forecast(2, 5, 3, xl, None)
    assert (f.request, f.step, f.layers, f.cross_layer) == (2, 4, (4, 7), True) and np.array_equal(f.probs[0], xl.numpy())


def test_eval_rows_xl_and_blend(tmp_path, capsys):
    """``predictor eval`` on a trace with cross-layer forecasts: rows XL-1..XL-d and Seq-1+XL-j; forecasts equal to
    the truth give 100% recall."""
    from moe_offload.cli import main
    from moe_offload.predictor.evaluate import evaluate_predictor
    from moe_offload.predictor.features import trace_sequences
    from test_predictor import planted_trace

    from moe_offload.predictor.model import PredictorHeader, PredictorSet, PredictorSpec

    tr = planted_trace(requests=3, length=10, L=3, E=8, k=2, prompt=4)
    dec = tr.step > 0
    xl = np.zeros((int(dec.sum()), 3, 2, 8), np.float32)
    ids = tr.expert_ids[dec].astype(np.int64)
    for j in range(2):
        for layer in range(3 - 1 - j):
            np.put_along_axis(xl[:, layer, j], ids[:, layer + 1 + j], 0.5, axis=-1)
    tr.xl_probs = xl
    h = PredictorHeader(model_id=tr.header["model_id"], model_type="x", num_moe_layers=3, num_experts=8, top_k=2,
                        specs=[PredictorSpec(layers=(0, 3), hidden_size=8, state_size=8, head_dim=8)])
    torch.manual_seed(0)
    res = evaluate_predictor(PredictorSet(h).eval(), trace_sequences(tr))
    assert res.rows["XL-1"].wide == res.rows["XL-1"].narrow == 1.0 and res.rows["XL-2"].narrow == 1.0
    assert res.rows["XL-1"].pairs == 2 * int(dec.sum()) and res.rows["XL-2"].pairs == int(dec.sum())
    assert {"Seq-1+XL-1", "Seq-1+XL-2"} <= set(res.rows)
    tr.save(tmp_path / "t.trace")
    back = load_trace_ok(tmp_path / "t.trace")
    assert np.array_equal(back.xl_probs, xl)


def load_trace_ok(p):
    from moe_offload.trace.format import load_trace

    return load_trace(p)


def test_cli_xl_policies_and_errors(tiny_dirs, tmp_path, capsys):
    """``generate --policy xl`` needs no predictor; ``seqmoe-xl`` does; ``simulate --policy xl`` needs a trace
    collected with ``--xl-forecasts``, which ``trace collect`` records; bad input is a one-line error."""
    from moe_offload.cli import main

    d = str(tiny_dirs["mixtral"])
    assert main(["generate", "--model", d, "--prompt", "hi", "--max-new-tokens", "3", "--quiet", "--policy", "xl",
                 "--residency", "0.5", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["stats"]["hits"] >= 0
    for argv, needle in (
            (["generate", "--model", d, "--prompt", "hi", "--quiet", "--policy", "seqmoe-xl", "--residency", "0.5"],
             "needs --predictor"),
            (["trace", "collect", "--model", d, "--prompt", "hi", "--quiet", "--xl-depth", "2", "--out",
              str(tmp_path / "x.trace")], "--xl-depth needs --xl-forecasts")):
        assert main(argv) == 2
        err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
        assert len(err) == 1 and needle in err[0], err
    assert main(["trace", "collect", "--model", d, "--prompt", "hi", "--max-new-tokens", "3", "--quiet",
                 "--out", str(tmp_path / "plain.trace")]) == 0
    assert main(["trace", "collect", "--model", d, "--prompt", "hi", "--max-new-tokens", "3", "--quiet",
                 "--xl-forecasts", "--xl-depth", "2", "--out", str(tmp_path / "xl.trace")]) == 0
    capsys.readouterr()
    assert main(["simulate", "--trace", str(tmp_path / "plain.trace"), "--policy", "lru,xl", "--residency", "0.5",
                 "--link-epl", "2", "--out", str(tmp_path / "o1")]) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert "--xl-forecasts" in err[-1]
    assert main(["simulate", "--trace", str(tmp_path / "xl.trace"), "--policy", "lru,xl", "--residency", "0.5",
                 "--link-epl", "2", "--out", str(tmp_path / "o2")]) == 0
    assert "| xl |" in capsys.readouterr().out
    assert main(["simulate", "--trace", str(tmp_path / "xl.trace"), "--policy", "xl", "--residency", "0.5",
                 "--link-epl", "2", "--xl-depth", "3", "--out", str(tmp_path / "o3")]) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 1 and "recorded cross-layer forecasts 2 deep" in err[0], err
    assert not (tmp_path / "o3").exists()


def test_trace_xl_replays_a_shallower_depth_than_recorded():
    """``sim.forecasts.TraceXL`` of a trace recorded 3 deep, at depth 2: each forecast is the recorded one's first
    two rows (a row does not depend on the depth), fewer near the last layer, none at it; at its recorded depth by
    default; deeper than recorded: a one-line error."""
    from types import SimpleNamespace

    from moe_offload.sim.forecasts import TraceXL

    xl = np.arange(2 * 5 * 3 * 4, dtype=np.float32).reshape(2, 5, 3, 4)   # [decode rows, L, depth, E]
    tr = SimpleNamespace(xl_probs=xl, num_moe_layers=5, decode_rows=lambda: np.array([-1, 0, 1]))
    src = TraceXL(tr, depth=2)
    src.row = 1
    assert np.array_equal(src.probs(0), xl[1, 0, :2]) and np.array_equal(src.probs(3), xl[1, 3, :1])
    assert src.probs(4) is None
    full = TraceXL(tr)
    full.row = 1
    assert np.array_equal(full.probs(1), xl[1, 1])
    with pytest.raises(MoeOffloadError, match="recorded cross-layer forecasts 3 deep; --xl-depth 4"):
        TraceXL(tr, depth=4)


def test_xl_oracle_forecasts_are_the_truth_and_every_prefetch_is_used(tmp_path, capsys):
    """``xl-oracle`` (simulator only): ``xl``'s cross-layer forecasts with their probabilities replaced by the true
    next layers' experts, 1/k each, so the prefetch queue's chance of use is exactly 1 for the experts each layer
    then uses and 0 for the rest; replayed, every prefetch it makes is used, it misses less than ``xl`` fed noise,
    and ``simulate`` runs it from a trace collected with cross-layer forecasts, without a predictor."""
    from moe_offload.cli import main
    from moe_offload.core.policy_spec import parse_policy
    from moe_offload.core.prefetch_tasks import chance_of_use
    from moe_offload.sim.forecasts import oracle_stream, xl_stream
    from moe_offload.sim.prefetch_sim import replay_policy
    from test_predictor import planted_trace

    tr = planted_trace(requests=3, length=12, L=4, E=16, k=2, prompt=4)
    dec = tr.step > 0
    rng = np.random.default_rng(1)
    xl = rng.dirichlet(np.ones(16), size=(int(dec.sum()), 4, 3)).astype(np.float32)  # forecasts of no use
    tr.xl_probs = xl
    spec = parse_policy("xl-oracle")
    assert spec.oracle and spec.cross_layer and spec.simulator_only and spec.prefetch == "jsd"
    truth = oracle_stream(xl_stream(tr), tr, weighted=False)
    rows_of = {(r, s): a for r, s, a, _ in tr.steps()}
    checked = 0
    for events in truth:
        for _, f in events:
            lo, hi = f.layers
            row = rows_of[(f.request, f.step + 1)]
            c = chance_of_use(np.asarray(f.probs[0], np.float64), tr.top_k)
            want = np.zeros((hi - lo, 16))
            for p in range(lo, hi):
                want[p - lo, tr.expert_ids[row, p].astype(np.int64)] = 1.0
            assert np.array_equal(c, want)
            checked += 1
    assert checked > 0
    oracle, _ = replay_policy(tr, spec, 16, 1.0, forecasts=truth)
    noise, _ = replay_policy(tr, parse_policy("xl"), 16, 1.0, forecasts=xl_stream(tr))
    assert oracle.prefetches > 0 and oracle.prefetch_accuracy == 1.0
    assert oracle.decode_misses < noise.decode_misses
    tr.save(tmp_path / "xl.trace")
    assert main(["simulate", "--trace", str(tmp_path / "xl.trace"), "--policy", "lru,xl,xl-oracle",
                 "--residency", "0.25", "--hardware", "rtx4090", "--link-epl", "1.0", "--out",
                 str(tmp_path / "sim")]) == 0
    report = (tmp_path / "sim" / "results.md").read_text()
    assert "xl-oracle" in report
