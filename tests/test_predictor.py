"""SeqMoE predictor (SeqMoE §5): Psi, execution modes, training on a planted rule, baselines, persistence, runtime."""

import numpy as np
import pytest
import torch

from moe_offload.errors import MoeOffloadError
from moe_offload.predictor.baselines import MarkovPredictor, OracleForecaster
from moe_offload.predictor.evaluate import Recall, evaluate_predictor
from moe_offload.predictor.features import Sequence, psi, psi_from_logits, psi_topk, split_requests, trace_sequences
from moe_offload.predictor.model import (PredictorHeader, PredictorSet, PredictorSpec, SeqPredictor, default_ranges,
                                         load_predictor, snapshot_state)
from moe_offload.predictor.train import TrainConfig, predictor_loss, train_predictors
from moe_offload.trace.format import FORMAT, VERSION, Trace


def test_psi_hand_made():
    # one position, 2 layers, e = 4, k = 2
    ids = torch.tensor([[[0, 2], [3, 1]]])
    w = torch.tensor([[[0.3, 0.1], [0.2, 0.2]]])
    out = psi(ids, w, 4)
    assert out.shape == (1, 8)
    assert torch.allclose(out, torch.tensor([[0.75, 0, 0.25, 0, 0, 0.5, 0, 0.5]]))
    # the definition: inactive experts at -inf, softmax over experts; equal for a softmax router's weights
    logits = torch.tensor([[[2.0, -1.0, 0.5, 0.0], [0.1, 1.0, -3.0, 1.0]]])
    active = torch.tensor([[[0, 2], [3, 1]]])
    probs = logits.softmax(-1)
    by_def = psi_from_logits(logits, active)
    assert torch.allclose(by_def, psi(active, probs.gather(-1, active), 4), atol=1e-6)
    e0 = torch.exp(torch.tensor(2.0)) / (torch.exp(torch.tensor(2.0)) + torch.exp(torch.tensor(0.5)))
    assert by_def[0, 0] == pytest.approx(float(e0), abs=1e-6)
    assert torch.equal(psi_topk(logits, 2), by_def)  # the top-2 of these logits are exactly `active`


def _tiny_predictor(layers=(0, 2), E=6, k=2, m=32, seed=0):
    torch.manual_seed(seed)
    return SeqPredictor(PredictorSpec(layers=layers, hidden_size=m, state_size=16, head_dim=16, chunk_size=8),
                        E, k).eval()


def test_recurrent_equals_parallel_and_rollout_restores_state():
    p = _tiny_predictor()
    x = torch.softmax(torch.randn(1, 21, 12), -1)
    with torch.no_grad():
        full, _ = p(x)
        nxt, state = p.prefill(x[0, :5])
        outs = [nxt]
        for t in range(5, 21):
            before = snapshot_state(state)
            roll = p.rollout(outs[-1], state, 4)
            assert roll.shape == (4, 2, 6)
            after = snapshot_state(state)
            for (c0, r0), (c1, r1) in zip(before, after):  # exactly as it was
                assert all(torch.equal(c0[i], c1[i]) for i in c0) and all(torch.equal(r0[i], r1[i]) for i in r0)
            outs.append(p.step(x[0, t], state))
    rec = torch.stack(outs)          # rec[j] forecasts position 5 + j, like full[0, 4 + j]
    assert torch.allclose(rec, full[0, 4:], atol=1e-5)


def test_rollout_feeds_psi_of_own_output():
    p = _tiny_predictor()
    x = torch.softmax(torch.randn(7, 12), -1)
    with torch.no_grad():
        nxt, state = p.prefill(x)
        roll = p.rollout(nxt, state, 2)
        manual = torch.cat([x, psi_topk(nxt, 2).view(1, -1), psi_topk(roll[0], 2).view(1, -1)])
        full, _ = p(manual.unsqueeze(0))
    assert torch.allclose(roll, full[0, -2:], atol=1e-5)


def test_numpy_step_equals_torch_step():
    """A CPU float32 predictor's step / rollout run in numpy (``predictor.host_step``) outside autograd; the torch
    path (taken with autograd on) gives the same logits to float32 rounding, the same recursive top-k sets, and the
    same recurrent state afterwards."""
    torch.manual_seed(1)
    p = SeqPredictor(PredictorSpec(layers=(0, 3), hidden_size=32, num_mamba_layers=2, state_size=16, head_dim=16,
                                   chunk_size=8), 8, 3).eval()
    x = torch.softmax(torch.randn(12, 24), -1)
    runs = []
    for grad in (False, True):
        with torch.no_grad():
            _, state = p.prefill(x[:6])
        with torch.set_grad_enabled(grad):
            outs = [p.step(x[t], state).detach() for t in range(6, 12)]
            roll = p.rollout(outs[-1], state, 5).detach()
        runs.append((torch.stack(outs), roll, snapshot_state(state)))
    (a, ra, sa), (b, rb, sb) = runs
    assert a.dtype == ra.dtype == torch.float32 and ra.shape == (5, 3, 8)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ra, rb, rtol=1e-5, atol=1e-5)
    assert torch.equal(ra.topk(3, -1).indices.sort(-1).values, rb.topk(3, -1).indices.sort(-1).values)
    for (c0, r0), (c1, r1) in zip(sa, sb):
        for i in c0:
            torch.testing.assert_close(c0[i], c1[i].detach(), rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(r0[i], r1[i].detach(), rtol=1e-5, atol=1e-5)


def test_numpy_step_is_dropped_when_parameters_move():
    """The numpy views (``predictor.host_step``) are rebuilt after ``.to()`` / ``load_state_dict``; a float64
    predictor takes the torch path."""
    from moe_offload.predictor.host_step import host_step_for

    p = _tiny_predictor()
    x = torch.zeros(12)
    with torch.no_grad():
        first = host_step_for(p, x)
        assert first is not None and host_step_for(p, x) is first
        p.double()
        assert host_step_for(p, x) is None and host_step_for(p, x.double()) is None
        p.float()
        second = host_step_for(p, x)
        assert second is not None and second is not first
        assert np.shares_memory(second.w_inp, p.inp.weight.numpy())
        p.load_state_dict({k: v.clone() for k, v in p.state_dict().items()}, assign=True)
        assert np.shares_memory(host_step_for(p, x).w_inp, p.inp.weight.numpy())


def test_loss_hand_worked():
    logits = torch.tensor([[[[3.0, 1.0, 0.0]]]])            # [B=1, T=1, n=1, e=3]
    target = torch.tensor([[[[1.0, 0.0, 0.0]]]])
    ids = torch.tensor([[[[0]]]])
    total, rank, kl = predictor_loss(logits, target, ids, torch.ones(1, 1, dtype=torch.bool), margin=1.0,
                                     hard_negatives=1)
    assert float(rank) == pytest.approx(0.0)                 # 3 - 1 >= margin
    assert float(kl) == pytest.approx(float(-torch.log_softmax(logits, -1)[0, 0, 0, 0]), abs=1e-6)
    _, rank2, _ = predictor_loss(torch.tensor([[[[1.5, 1.0, 0.0]]]]), target, ids,
                                 torch.ones(1, 1, dtype=torch.bool), margin=1.0, hard_negatives=2)
    assert float(rank2) == pytest.approx((0.5 + 0.0) / 2)    # negatives 1.0 (violates by 0.5) and 0.0


def planted_trace(requests=120, length=40, L=2, E=16, k=2, seed=0, prompt=8) -> Trace:
    """Expert set at t+1 = the set at t shifted by +1 (mod E), per layer; random start sets and weights."""
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(requests):
        start = np.stack([rng.choice(E, k, replace=False) for _ in range(L)])      # [L, k]
        rows.append(np.stack([(start + t) % E for t in range(length)]))            # [T, L, k]
    ids = np.concatenate(rows).astype(np.int16)
    n = len(ids)
    w = rng.uniform(0.2, 1.0, size=(n, L, k)).astype(np.float16)
    req = np.repeat(np.arange(requests, dtype=np.int32), length)
    step = np.tile(np.concatenate([np.zeros(prompt, np.int32), np.arange(1, length - prompt + 1, dtype=np.int32)]),
                   requests)
    header = {"format": FORMAT, "version": VERSION, "model_id": f"planted-{L}x{E}x{k}", "model_type": "synthetic",
              "num_moe_layers": L, "num_experts": E, "top_k": k, "synthetic": True, "router_probs": False,
              "requests": [{"prompt_tokens": prompt, "decode_steps": length - prompt}] * requests,
              "source": "tests: planted shift rule"}
    return Trace(header, ids, w, req, step, np.zeros(requests * prompt, dtype=np.int32))


def _header(tr, ranges, m=32, shuffled=False):
    h = tr.header
    return PredictorHeader(model_id=h["model_id"], model_type="synthetic", num_moe_layers=h["num_moe_layers"],
                           num_experts=h["num_experts"], top_k=h["top_k"], shuffled_control=shuffled,
                           specs=[PredictorSpec(layers=r, hidden_size=m, state_size=16, head_dim=16, chunk_size=16)
                                  for r in ranges])


def test_planted_rule_learned_and_shuffled_control_at_chance():
    tr = planted_trace()
    seqs = trace_sequences(tr)
    assert len(seqs) == 120 and seqs[0].prompt_len == 8
    train_idx, test_idx = split_requests([s.key for s in seqs], 0.1, 0)
    assert len(test_idx) == 12 and not set(train_idx) & set(test_idx)
    train, test = [seqs[i] for i in train_idx], [seqs[i] for i in test_idx]
    cfg = TrainConfig(epochs=8, ss_epochs=2, lr=1e-2, batch_tokens=1024, seed=0)
    pset = train_predictors(_header(tr, default_ranges(2, 2)), train, cfg)
    control = train_predictors(_header(tr, default_ranges(2, 2), shuffled=True),
                               [s.shuffled(i) for i, s in enumerate(train)], cfg)
    markov = MarkovPredictor(2, 16).fit(train)
    res = evaluate_predictor(pset, test, horizon=4, long_threshold=30, markov=markov, control=control)
    assert res.rows["Seq-1"].wide > 0.95
    assert res.rows["Seq-4"].wide > 0.95          # the rule composes: recursive prediction stays right
    assert res.rows["Seq-L1"].pairs == res.rows["Seq-1"].pairs   # every request has 40 >= 30 positions
    assert res.rows["Markov"].wide > 0.95         # a first-order rule is within Markov's reach too
    chance = (2 + 3) / 16
    assert res.rows["Shuffled control (all positions)"].wide < chance + 0.15
    assert res.rows["Seq-1 (all positions)"].wide > 0.9


def test_markov_hand_worked():
    # one layer, e = 3, k = 1: 0 -> 1 -> 0 -> 1 ... ; and 2 -> 2
    ids = torch.tensor([0, 1, 0, 1, 2, 2]).view(6, 1, 1)
    s = Sequence(ids, torch.ones(6, 1, 1), 1, (0, 0))
    m = MarkovPredictor(1, 3, alpha=0.0).fit([s])
    # transitions: 0->1 (x2), 1->0 (x1), 1->2 (x1), 2->2 (x1)
    assert torch.allclose(m.transition[0], torch.tensor([[0, 1, 0], [0.5, 0, 0.5], [0, 0, 1.0]]))
    pred = m.predict(torch.tensor([[[1]]]), torch.ones(1, 1, 1))
    assert torch.allclose(pred, torch.tensor([[[0.5, 0, 0.5]]]))


def test_recall_metric():
    r = Recall()
    scores = torch.tensor([[[0.9, 0.8, 0.1, 0.0, 0.05, 0.02]]])   # order 0,1,2,4,5,3
    r.add(scores, torch.tensor([[[1, 3]]]), k=2, extra=3)          # top-5 = {0,1,2,4,5}: finds 1 of {1,3}
    assert r.wide == pytest.approx(0.5) and r.narrow == pytest.approx(0.5)


def test_oracle_forecaster():
    tr = planted_trace(requests=2, length=10)
    o = OracleForecaster(tr)
    f = o.forecast(1, 3, 8)
    assert f.shape == (8, 2, 16)
    true = tr.expert_ids[10 + 4]
    assert set(np.flatnonzero(f[0, 0].numpy())) == set(true[0].tolist())
    assert float(f[6:].abs().sum()) == 0.0          # past the request's end


def test_save_load_round_trip_and_errors(tmp_path):
    tr = planted_trace(requests=4, length=12)
    pset = PredictorSet(_header(tr, [(0, 1), (1, 2)]))
    pset.save(tmp_path / "p")
    back = load_predictor(tmp_path / "p", model_id=tr.header["model_id"])
    for a, b in zip(pset.state_dict().values(), back.state_dict().values()):
        assert torch.equal(a, b)
    with pytest.raises(MoeOffloadError, match="trained for model"):
        load_predictor(tmp_path / "p", model_id="mixtral-000000000000")
    with pytest.raises(MoeOffloadError, match="already holds a predictor"):
        pset.save(tmp_path / "p")
    with pytest.raises(MoeOffloadError, match="not a predictor directory"):
        load_predictor(tmp_path / "nothing")
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "predictor.json").write_text("{not json")
    (tmp_path / "bad" / "predictor.safetensors").write_bytes(b"xx")
    with pytest.raises(MoeOffloadError, match="unreadable predictor config"):
        load_predictor(tmp_path / "bad")
    with pytest.raises(MoeOffloadError, match="overlap"):
        PredictorSet(_header(tr, [(0, 2), (1, 2)]))
    assert default_ranges(30, 2) == [(0, 15), (15, 30)]
    with pytest.raises(MoeOffloadError):
        default_ranges(2, 3)


def test_runner_rolls_the_horizon_forward_between_rollouts():
    """rollout_every = 3: a recursive rollout at the prefill and at decode steps 3, 6, ...; in between a forecast is
    the fresh one-step row followed by the last rollout's rows still ahead (row j of a rollout made d steps earlier
    forecasts the step this forecast's row j - d + 1 does)."""
    from moe_offload.predictor.runtime import PredictorRunner

    hdr = PredictorHeader(model_id="m", model_type="t", num_moe_layers=2, num_experts=6, top_k=2,
                          specs=[PredictorSpec(layers=(0, 2), hidden_size=32, state_size=16, head_dim=16,
                                               chunk_size=8)])
    torch.manual_seed(0)
    pset = PredictorSet(hdr).eval()
    every = PredictorRunner(pset, rollout=4, rollout_every=3)
    rolled = PredictorRunner(pset, rollout=4, rollout_every=1)
    gen = torch.Generator().manual_seed(1)
    ids = [torch.stack([torch.randperm(6, generator=gen)[:2] for _ in range(3 if s == 0 else 1)]) for s in range(8)]
    w = [torch.full(i.shape, 0.5) for i in ids]
    made = {}
    for step in range(8):
        for r in (every, rolled):
            r.begin_step(0, step)
            for layer in range(2):
                r(layer, ids[step], w[step])
        got, full = every.forecasts[0].probs, rolled.forecasts[0].probs
        assert torch.allclose(got[0], full[0], atol=1e-6)        # the one-step row is always fresh
        if step % 3 == 0:                                         # a rollout step: every row fresh
            assert got.shape == (5, 2, 6) and torch.allclose(got, full, atol=1e-6)
            made = {step: full}
        else:                                                     # the rows of the rollout made d steps ago
            d = step % 3
            old = made[step - d]
            assert got.shape == (5 - d, 2, 6) and torch.allclose(got[1:], old[1 + d:], atol=1e-6)
    with pytest.raises(MoeOffloadError, match="rollout_every"):
        PredictorRunner(pset, rollout=4, rollout_every=0)


def test_runtime_runner_matches_trace_features_and_keeps_tokens(tiny_dirs, random_pset):
    """With a predictor attached the tokens are unchanged, and its prefill forecast equals the predictor applied
    (parallel mode) to the trace of the same run: the runtime feeds exactly the training features."""
    from moe_offload.generation.generate import run
    from moe_offload.models.loader import load_offloaded
    from moe_offload.predictor.runtime import PredictorRunner
    from moe_offload.trace.collect import TraceRecorder

    lm = load_offloaded(tiny_dirs["qwen3_moe"], residency=0.5, progress=False)
    ref, _ = run(lm, ["hello world", "the cat"], 6)
    pset = random_pset(lm, seed=0)
    runner = PredictorRunner(pset, rollout=3, rollout_every=1)
    lm.engine.observers.append(runner)
    with TraceRecorder(lm) as rec:
        outs, _ = run(lm, ["hello world", "the cat"], 6, recorder=rec)
        tr = rec.trace()
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    assert runner.stats.decode_steps == sum(len(o.token_ids) - 1 for o in outs)
    state_tensors = [t for st in runner._states for conv, rec in snapshot_state(st) for t in (*conv.values(),
                                                                                           *rec.values())]
    assert sum(t.numel() * t.element_size() for t in state_tensors) == pset.state_bytes()
    last = trace_sequences(tr)[-1]
    for i, p in enumerate(pset.predictors):
        f = runner.forecasts[i]
        assert f is not None and f.request == 1 and f.probs.shape == (4, p.spec.num_layers, lm.num_experts)
        # the runner consumed every position of request 1 except the last generated token (never fed back)
        with torch.no_grad():
            full, _ = p(last.features(p.spec.layers, lm.num_experts).unsqueeze(0))
        assert torch.allclose(f.probs[0], full[0, -1].softmax(-1), atol=2e-3)


def test_cli_train_eval_generate_and_errors(tmp_path, capsys, tiny_dirs):
    """End to end through the CLI on a small planted trace; bad input gives one-line errors and overwrites nothing."""
    from moe_offload.cli import main

    def assert_one_line_error(code, err, needle):
        lines = [ln for ln in err.splitlines() if ln.strip()]
        assert code == 2 and len(lines) == 1 and lines[0].startswith("moe-offload: error: ") and needle in lines[0], err

    tr = planted_trace(requests=30, length=20)
    tr.save(tmp_path / "t.trace")
    out = tmp_path / "pred"
    assert main(["predictor", "train", "--traces", str(tmp_path / "t.trace"), "--out", str(out), "--epochs", "1",
                 "--ss-epochs", "1", "--hidden-size", "32", "--quiet"]) == 0
    assert "2 predictors (layers 0-0, 1-1)" in capsys.readouterr().out
    before = (out / "predictor.safetensors").read_bytes()
    assert main(["predictor", "eval", "--predictor", str(out), "--traces", str(tmp_path / "t.trace"), "--horizon", "3",
                 "--quiet"]) == 0
    printed = capsys.readouterr().out
    assert "held-out 3 of 30 requests" in printed and "| Seq-3 |" in printed and "| Markov |" in printed
    assert_one_line_error(main(["predictor", "train", "--traces", str(tmp_path / "t.trace"), "--out", str(out),
                                "--quiet"]), capsys.readouterr().err, "not an empty directory")
    assert (out / "predictor.safetensors").read_bytes() == before
    assert_one_line_error(main(["predictor", "train", "--traces", str(tmp_path / "missing.trace"), "--out",
                                str(tmp_path / "p2")]), capsys.readouterr().err, "trace file not found")
    assert_one_line_error(main(["predictor", "eval", "--predictor", str(tmp_path), "--traces",
                                str(tmp_path / "t.trace")]), capsys.readouterr().err, "not a predictor directory")
    # a predictor of another model is refused by generate
    assert_one_line_error(main(["generate", "--model", str(tiny_dirs["mixtral"]), "--prompt", "hi",
                                "--max-new-tokens", "2", "--quiet", "--predictor", str(out)]),
                          capsys.readouterr().err, "was trained for model")


def test_seqmoe_cacheonly_runtime_equals_simulator(tiny_dirs, random_pset):
    """Probabilistic Belady fed by a predictor: the runtime's hits/misses equal the simulator's replay of the
    trace recorded in the same run (forecasts recomputed from the trace by ``forecast_stream``)."""
    from moe_offload.generation.generate import run
    from moe_offload.models.loader import load_offloaded
    from moe_offload.predictor.runtime import ForecastFeed, PredictorRunner
    from moe_offload.sim.forecasts import forecast_stream
    from moe_offload.sim.simulator import replay
    from moe_offload.trace.collect import TraceRecorder

    lm = load_offloaded(tiny_dirs["mixtral"], residency=0.5, policy="seqmoe-cacheonly", progress=False)
    pset = random_pset(lm, seed=1)
    ref, _ = run(load_offloaded(tiny_dirs["mixtral"], residency=1.0, progress=False), ["a b c", "hello"], 8)
    with TraceRecorder(lm) as rec:
        lm.engine.observers.append(ForecastFeed(PredictorRunner(pset, rollout=7), lm.engine.table.policy))
        outs, st = run(lm, ["a b c", "hello"], 8, recorder=rec)
        tr = rec.trace()
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]          # lossless
    sim = replay(tr, lm.engine.pool.num_slots, "seqmoe-cacheonly", forecasts=forecast_stream(pset, tr))
    assert (sim.hits, sim.misses) == (st.offload.hits, st.offload.misses)
    assert st.offload.misses > 0
    with pytest.raises(MoeOffloadError, match="needs a predictor"):
        replay(tr, 4, "seqmoe-cacheonly")


def test_cli_forecast_policy_needs_predictor(tiny_dirs, tmp_path, capsys):
    from moe_offload.cli import main

    code = main(["generate", "--model", str(tiny_dirs["mixtral"]), "--prompt", "hi", "--max-new-tokens", "2",
                 "--quiet", "--policy", "seqmoe-cacheonly", "--residency", "0.5"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "needs --predictor" in err[0]
    code = main(["bench", "decode", "--model", str(tiny_dirs["mixtral"]), "--prompt", "hi", "--max-new-tokens", "2",
                 "--quiet", "--policy", "lru,seqmoe", "--residencies", "0.5"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "needs --predictor" in err[0]
    tr = planted_trace(requests=3, length=6)
    tr.save(tmp_path / "t.trace")
    code = main(["simulate", "--trace", str(tmp_path / "t.trace"), "--policy", "lru,seqmoe-cacheonly",
                 "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and "needs --predictor" in err[-1] and not (tmp_path / "out").exists()


@pytest.mark.parametrize("policy", ["seqmoe", "seqmoe-infinity"])
def test_seqmoe_prefetching_is_lossless_on_every_architecture(tiny_dirs, policy, random_pset):
    """Forecasts -> JSD/MoE-Infinity tasks -> asynchronous prefetch copies over an emulated slow link: the tokens
    equal FullLoad's for every architecture, and prefetches happened (some landed, some were waited for)."""
    from moe_offload.generation.generate import run
    from moe_offload.models.loader import load_full, load_offloaded
    from moe_offload.predictor.runtime import ForecastFeed, PredictorRunner
    from moe_offload.runtime.prefetcher import lookup_is_consistent

    prompts = ["hello world", "the cat sat"]
    for arch, d in tiny_dirs.items():
        ref, _ = run(load_full(d), prompts, 8)
        lm = load_offloaded(d, residency=0.5, policy=policy, progress=False, link_epl=2.0, seconds_per_expert=2e-4)
        pf = lm.engine.prefetcher
        lm.engine.observers.append(ForecastFeed(PredictorRunner(random_pset(lm, seed=2), rollout=7),
                                                lm.engine.table.policy, pf))
        outs, st = run(lm, prompts, 8)
        assert [o.token_ids for o in outs] == [o.token_ids for o in ref], arch
        assert pf.prefetches > 0, arch
        pf.land_ready()
        assert lookup_is_consistent(lm.engine.pool, lm.engine.table), arch
        pf.close()


@pytest.mark.parametrize("residency", [0.5, 0.75])
def test_seqmoe_async_runtime_close_to_simulator(tiny_dirs, residency, random_pset):
    """Asynchronous prefetching (JSD) with prefill offloading (SeqMoE §8.4): the runtime's hits/misses are within
    5% of all accesses of the simulator's replay of the trace recorded in the same run (same forecasts, same
    scheduler, policy and slot table objects; the simulator's link moves 2 experts per layer time, the runtime's
    copies take 0.1 ms each, so landing times differ only by timing noise), and the tokens stay FullLoad's."""
    from moe_offload.generation.generate import run
    from moe_offload.models.loader import load_full, load_offloaded
    from moe_offload.predictor.runtime import ForecastFeed, PredictorRunner
    from moe_offload.sim.forecasts import forecast_stream
    from moe_offload.sim.prefetch_sim import replay_with_prefetch
    from moe_offload.trace.collect import TraceRecorder

    d = tiny_dirs["mixtral"]
    prompts = ["hello world how are you", "the cat sat on the mat", "a b c d e"]
    ref, _ = run(load_full(d), prompts, 12)
    lm = load_offloaded(d, residency=residency, policy="seqmoe", progress=False, link_epl=2.0, seconds_per_expert=1e-4)
    pset = random_pset(lm, seed=3)
    pop = [[float(e + layer) for e in range(lm.num_experts)] for layer in range(lm.num_moe_layers)]
    pf = lm.engine.prefetcher
    pf.set_prefill_popularity(pop)
    with TraceRecorder(lm) as rec:
        lm.engine.observers.append(ForecastFeed(PredictorRunner(pset, rollout=7), lm.engine.table.policy, pf))
        outs, st = run(lm, prompts, 12, recorder=rec)
        tr = rec.trace()
    pf.close()
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    sim = replay_with_prefetch(tr, lm.engine.pool.num_slots, "seqmoe-cacheonly", 2.0,
                               forecasts=forecast_stream(pset, tr), scheduler="jsd", prefill_popularity=pop)
    o = st.offload
    assert o.hits + o.misses == sim.hits + sim.misses
    assert abs(o.hits - sim.hits) <= 0.05 * sim.accesses, (o.hits, sim.hits)
    assert pf.prefetches > 0 and sim.prefetches > 0
    if residency == 0.75:  # 36 slots: room for prefill prefetches besides a layer's experts and the reserve e = 16
        assert pf.prefill_prefetches > 0 and sim.prefill_prefetches > 0


def test_predictor_saves_prefill_popularity(tmp_path):
    """``predictor train`` stores the training requests' prefill expert counts (SeqMoE §8.4's offline profile)."""
    from moe_offload.cli import main
    from moe_offload.predictor.features import prefill_popularity
    from moe_offload.predictor.model import load_predictor

    tr = planted_trace(requests=10, length=12, prompt=4)
    tr.save(tmp_path / "t.trace")
    assert main(["predictor", "train", "--traces", str(tmp_path / "t.trace"), "--out", str(tmp_path / "p"),
                 "--epochs", "1", "--ss-epochs", "0", "--hidden-size", "16", "--quiet"]) == 0
    pop = np.array(load_predictor(tmp_path / "p").header.prefill_popularity)
    assert pop.shape == (2, 16) and (pop.sum(1) == 9 * 4 * 2).all()   # 9 training requests x 4 prompt tokens x k
    hand = np.zeros((2, 16), int)
    for row in tr.expert_ids[(tr.step == 0) & (tr.request == 0)]:
        for layer in range(2):
            for e in row[layer]:
                hand[layer, e] += 1
    assert (np.array(prefill_popularity([tr], [(0, 0)], 2, 16)) == hand).all()
