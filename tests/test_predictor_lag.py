"""The predictor beside the decode step (``predictor.lagged``): forecasts handed over ``lag`` MoE layers after their
trigger layer, computed inline (the simulator) or in a worker process (the runtime), with the same decisions."""

import json

import numpy as np
import pytest
import torch

from moe_offload.errors import MoeOffloadError
from moe_offload.predictor.lagged import InlinePredictions, LaggedFeed, PredictorProcess
from moe_offload.predictor.model import PredictorHeader, PredictorSet, PredictorSpec
from moe_offload.predictor.runtime import ForecastFeed, PredictorRunner

L, E, K = 4, 6, 2


def _pset(seed=0):
    torch.manual_seed(seed)
    h = PredictorHeader(model_id="m", model_type="t", num_moe_layers=L, num_experts=E, top_k=K,
                        specs=[PredictorSpec(layers=r, hidden_size=32, state_size=16, head_dim=16, chunk_size=8)
                               for r in [(0, 2), (2, 4)]])
    return PredictorSet(h).eval()


class _Sink:
    def __init__(self):
        self.at, self.got = None, []

    def observe(self, f):
        self.got.append((self.at, f))


def _drive(feed, sink, steps, seed=0):
    """Run ``feed`` over ``steps`` [(request, step, tokens)] of random routing; the sink records each hand-over's
    (request, step, layer)."""
    g = torch.Generator().manual_seed(seed)
    for req, step, t in steps:
        feed.begin_step(req, step)
        for layer in range(L):
            sink.at = (req, step, layer)
            ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(t)])
            feed(layer, ids, torch.rand(t, K, generator=g))


STEPS = [(0, 0, 3), (0, 1, 1), (0, 2, 1), (1, 0, 2), (1, 1, 1)]


def test_lagged_feed_hands_over_lag_layers_after_the_trigger_hand_worked():
    """Triggers at layers 1 and 3 (positions step * 4 + 1, + 3). Lag 3: the prefill's forecasts reach the consumers
    at step 1 layers 0 and 2, step 1's at step 2 layers 0 and 2; step 2's would be due at step 3, which request 0
    never runs: dropped when request 1 starts. The forecasts are ForecastFeed's, probs for probs."""
    pset = _pset()
    sink, ref = _Sink(), _Sink()
    _drive(LaggedFeed(InlinePredictions(PredictorRunner(pset, rollout=3)), pset, sink, lag=3, rollout=3), sink, STEPS)
    _drive(ForecastFeed(PredictorRunner(_pset(), rollout=3), ref), ref, STEPS)
    assert [at for at, _ in sink.got] == [(0, 1, 0), (0, 1, 2), (0, 2, 0), (0, 2, 2), (1, 1, 0), (1, 1, 2)]
    assert [at for at, _ in ref.got] == [(r, s, x) for r, s, _ in STEPS for x in (1, 3)]
    made = {(f.request, f.step, f.layers): f for _, f in ref.got}
    assert [(f.request, f.step, f.layers) for _, f in sink.got] == \
        [(0, 0, (0, 2)), (0, 0, (2, 4)), (0, 1, (0, 2)), (0, 1, (2, 4)), (1, 0, (0, 2)), (1, 0, (2, 4))]
    for _, f in sink.got:
        want = made[(f.request, f.step, f.layers)].probs
        assert isinstance(f.probs, np.ndarray) and np.array_equal(f.probs, want.numpy())


def test_lag_zero_hands_over_at_the_trigger_layer():
    pset = _pset()
    sink = _Sink()
    _drive(LaggedFeed(InlinePredictions(PredictorRunner(pset)), pset, sink, lag=0, rollout=0), sink, STEPS)
    assert [at for at, _ in sink.got] == [(r, s, x) for r, s, _ in STEPS for x in (1, 3)]
    with pytest.raises(MoeOffloadError, match="lag must be >= 0"):
        LaggedFeed(InlinePredictions(PredictorRunner(pset)), pset, sink, lag=-1, rollout=0)


def test_predictor_process_computes_what_the_inline_runner_computes():
    """The worker process's forecasts equal the inline runner's bit for bit (same numpy path, same weights), over
    four requests (two of them numbered 0 again, one with a prefill only, as when ``generate.run`` is called
    twice), with answers dropped at a request's end; a closed worker says so in one line."""
    pset = _pset(seed=4)
    inline, proc = _Sink(), _Sink()
    steps = STEPS + [(0, 0, 2), (0, 0, 3), (0, 1, 1)]
    _drive(LaggedFeed(InlinePredictions(PredictorRunner(pset, rollout=7)), pset, inline, lag=2, rollout=7), inline,
           steps, seed=5)
    src = PredictorProcess(pset, rollout=7, rollout_every=4)
    try:
        _drive(LaggedFeed(src, pset, proc, lag=2, rollout=7), proc, steps, seed=5)
    finally:
        src.close()
    assert [at for at, _ in proc.got] == [at for at, _ in inline.got] and len(proc.got) == 12
    for (_, a), (_, b) in zip(inline.got, proc.got):
        assert np.array_equal(a.probs, b.probs)
    with pytest.raises(MoeOffloadError, match="the predictor process is closed"):
        src.result(0)


def test_runtime_with_the_predictor_process_equals_the_simulator(tiny_dirs, random_pset):
    """seqmoe-cacheonly with the predictor in its process, forecasts used 2 layers after their trigger: the runtime's
    hits / misses equal the simulator's replay of the trace recorded in the same run with the same lag (and differ
    from the replay without it); tokens are FullLoad's; closing the model stops the worker."""
    from moe_offload.generation.generate import run
    from moe_offload.models.loader import load_offloaded
    from moe_offload.predictor.attach import attach_predictor
    from moe_offload.sim.forecasts import forecast_stream
    from moe_offload.sim.simulator import replay
    from moe_offload.trace.collect import TraceRecorder

    prompts = ["a b c", "hello", "the cat sat on the mat"]
    ref, _ = run(load_offloaded(tiny_dirs["mixtral"], residency=1.0, progress=False), prompts, 10)
    lm = load_offloaded(tiny_dirs["mixtral"], residency=0.5, policy="seqmoe-cacheonly", progress=False)
    pset = random_pset(lm, seed=1)
    feed = attach_predictor(lm.engine, pset, lag=2)
    assert isinstance(feed, LaggedFeed) and feed.rollout == 7
    with TraceRecorder(lm) as rec:
        outs, st = run(lm, prompts, 10, recorder=rec)
        tr = rec.trace()
    proc = feed.source._proc
    lm.close()
    assert not proc.is_alive()
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    assert feed.stats.prefill_calls == 2 * len(prompts) and feed.stats.decode_calls == 2 * feed.stats.decode_steps > 0
    sim = replay(tr, lm.engine.pool.num_slots, "seqmoe-cacheonly", forecasts=forecast_stream(pset, tr, lag=2))
    assert (sim.hits, sim.misses) == (st.offload.hits, st.offload.misses) and st.offload.misses > 0
    inline = replay(tr, lm.engine.pool.num_slots, "seqmoe-cacheonly", forecasts=forecast_stream(pset, tr))
    assert [e for events in forecast_stream(pset, tr, lag=2) for e in events] != \
        [e for events in forecast_stream(pset, tr) for e in events] and inline.accesses == sim.accesses


def test_cli_predictor_lag_errors(tiny_dirs, capsys):
    from moe_offload.cli import main

    d = str(tiny_dirs["mixtral"])
    for argv in (["generate", "--model", d, "--prompt", "hi", "--predictor-lag", "2"],
                 ["bench", "decode", "--model", d, "--prompt", "hi", "--policy", "lru", "--predictor-lag", "1"]):
        code = main(argv + ["--quiet", "--max-new-tokens", "2"])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(err) == 1 and "needs --predictor" in err[0], (argv, err)
    with pytest.raises(SystemExit) as e:
        main(["generate", "--model", d, "--prompt", "hi", "--predictor-lag", "-1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and "--predictor-lag: expected an integer in [0, 64]" in err[0]


def test_bench_decode_with_the_predictor_process(tiny_dirs, random_pset, tmp_path, capsys):
    """``bench decode --predictor-lag``: seqmoe with its predictor in a process, FullLoad's tokens, the simulator's
    fraction beside the measured one, and the footer says how the predictor ran."""
    from moe_offload.cli import main
    from moe_offload.models.loader import load_offloaded

    d = tiny_dirs["mixtral"]
    lm = load_offloaded(d, residency=0.5, progress=False)
    random_pset(lm, seed=2).save(tmp_path / "pred")
    lm.close()
    assert main(["bench", "decode", "--model", str(d), "--prompt", "hi there", "--max-new-tokens", "6", "--quiet",
                 "--residencies", "0.5", "--policy", "seqmoe", "--predictor", str(tmp_path / "pred"),
                 "--predictor-lag", "2", "--link-regime", "rtx4090", "--emulated-waits", "skip"]) == 0
    out = capsys.readouterr().out
    row = next(ln.split(" | ") for ln in out.splitlines() if ln.startswith("| seqmoe"))
    assert row[9] == "yes" and 0 < float(row[5]) <= 1
    assert "forecasts used 2 MoE layers after their trigger layer" in out
    # generate --json reports the lag; a policy that does not use forecasts, or xl, refuses it in one line
    gen = ["generate", "--model", str(d), "--prompt", "hi", "--max-new-tokens", "3", "--quiet", "--residency", "0.5",
           "--predictor", str(tmp_path / "pred"), "--predictor-lag", "1"]
    assert main(gen + ["--policy", "seqmoe-cacheonly", "--json"]) == 0
    p = json.loads(capsys.readouterr().out)["stats"]["predictor"]
    assert p["lag_layers"] == 1 and p["rollout"] == 7 and p["ms_receiving_per_decode_step"] >= 0
    # as a user runs it: the process exits without a word from the worker on stderr
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "moe_offload.cli", *gen, "--policy", "seqmoe"], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0 and r.stderr.strip() == "", r.stderr
    assert "in its own process, forecasts used 1 MoE layers late" in r.stdout
    for policy, msg in [("lru", "needs a policy that uses the forecasts"), ("xl", "not --policy xl")]:
        assert main(gen + ["--policy", policy]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and msg in err[0], err
