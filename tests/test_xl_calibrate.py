"""Calibrated ``seqmoe-xl`` blend weights (``predictor calibrate-xl``): the choice on hand-worked forecasts, the file
beside the predictor, and the weights reaching every user of the blend."""

import json

import numpy as np
import pytest
import torch

from moe_offload.cli import main
from moe_offload.errors import MoeOffloadError
from moe_offload.predictor.features import trace_sequences
from moe_offload.predictor.model import PredictorHeader, PredictorSet, PredictorSpec, load_predictor
from moe_offload.predictor.xl_calibrate import XL_GRID, calibrate_xl_weights
from moe_offload.predictor.xl_weights import XL_WEIGHTS_NAME, describe_xl_weights, read_xl_weights, write_xl_weights
from moe_offload.trace.xl_accuracy import with_xl_accuracy
from test_predictor import planted_trace

L, E, K = 4, 8, 2


@pytest.fixture(scope="module")
def trace():
    return planted_trace(requests=4, length=12, L=L, E=E, k=K, prompt=4)


@pytest.fixture(scope="module")
def pset(trace):
    h = PredictorHeader(model_id=trace.header["model_id"], model_type="x", num_moe_layers=L, num_experts=E, top_k=K,
                        specs=[PredictorSpec(layers=(0, L), hidden_size=8, state_size=8, head_dim=8)])
    torch.manual_seed(0)
    return PredictorSet(h).eval()


def test_true_forecasts_pick_the_smallest_weight_that_reaches_them(trace, pset):
    """Cross-layer forecasts equal to the truth: at weight 1 the blend is them (recall 1 at top-k and top-(k+3));
    the choice is the smallest grid weight whose top-k recall is 1 (ties: the smaller weight)."""
    seqs = trace_sequences(with_xl_accuracy(trace, [0.0, 0.0, 0.0]))
    weights, table = calibrate_xl_weights(pset, seqs)
    assert sorted(table) == [1, 2, 3] and len(weights) == 3
    for j, w in zip(sorted(table), weights):
        wide, narrow, pairs = table[j][1.0]
        assert wide == narrow == 1.0 and pairs == 4 * 8 * (L - j)            # 4 requests x 8 decode steps
        assert w == min(x for x in XL_GRID if table[j][x][1] == 1.0) and w > 0.0
        assert table[j][0.0][1] < 1.0                                         # Seq-1 alone misses some


def test_wrong_forecasts_get_weight_zero(trace, pset):
    """Cross-layer forecasts whose top-k are all wrong (the rest uniform): mixing them in can only raise wrong
    experts, so weight 0 (SeqMoE's forecast alone) is chosen at every distance."""
    seqs = trace_sequences(with_xl_accuracy(trace, [1.0, 1.0]))
    weights, table = calibrate_xl_weights(pset, seqs, grid=(0.0, 0.3, 1.0))
    assert weights == (0.0, 0.0) and table[1][1.0][1] == 0.0


def test_weights_file_and_its_refusals(trace, pset, tmp_path, capsys):
    d = tmp_path / "pred"
    pset.save(d)
    assert load_predictor(d).xl_weights is None and describe_xl_weights(load_predictor(d)) == "0.3, 0.25, 0.2 (default)"
    write_xl_weights(d, (0.6, 0.5), {"note": "hand"})
    assert read_xl_weights(d) == ((0.6, 0.5), str(d / XL_WEIGHTS_NAME))
    assert describe_xl_weights(load_predictor(d)) == f"0.6, 0.5 ({d / XL_WEIGHTS_NAME})"
    with pytest.raises(MoeOffloadError, match="already exists; pass --replace"):
        write_xl_weights(d, (0.1,), {})
    assert read_xl_weights(d)[0] == (0.6, 0.5)
    write_xl_weights(d, (0.1,), {"synthetic": True}, replace=True)
    assert read_xl_weights(d) == ((0.1,), f"{d / XL_WEIGHTS_NAME}, fitted on synthetic traces")
    for bad, needle in (({"weights": [0.2, 1.5]}, r"must be in \[0, 1\], got 1.5"), ({"weights": "0"}, "a list"),
                        ({"weights": []}, "is empty"), ([0.3], "a list")):
        (d / XL_WEIGHTS_NAME).write_text(json.dumps(bad))
        with pytest.raises(MoeOffloadError, match=needle):
            load_predictor(d)
    (d / XL_WEIGHTS_NAME).unlink()

    t_xl, t_plain, t_real = tmp_path / "xl.trace", tmp_path / "plain.trace", tmp_path / "real.trace"
    with_xl_accuracy(trace, [0.0, 0.0, 0.0]).save(t_xl)              # what-if forecasts: marked synthetic
    trace.save(t_plain)
    real = with_xl_accuracy(trace, [0.0, 0.0, 0.0])
    real.header = {k: v for k, v in real.header.items() if k != "xl_forecasts"} | {"synthetic": False}
    real.save(t_real)                                                 # as if recorded by trace collect
    assert main(["predictor", "calibrate-xl", "--predictor", str(d), "--traces", str(t_real), "--quiet"]) == 0
    out = capsys.readouterr().out
    stored = json.loads((d / XL_WEIGHTS_NAME).read_text())
    assert load_predictor(d).xl_weights == tuple(stored["weights"]) and "wrote" in out and "*" in out
    assert stored["synthetic"] is False and "synthetic" not in out
    before = (d / XL_WEIGHTS_NAME).read_bytes()
    for argv, needle in ((["--traces", str(t_real)], "pass --replace"),
                         (["--traces", str(t_plain), "--replace"], "has no cross-layer forecasts"),
                         (["--traces", str(t_real), str(t_plain), "--replace"], "has no cross-layer forecasts"),
                         (["--traces", str(t_real), str(t_real), "--replace"], "the same file twice"),
                         (["--traces", str(t_xl), "--replace"], "pass --allow-synthetic"),
                         (["--traces", str(t_real), "--replace", "--grid", "0.5,1.5"], "--grid must be in [0, 1]"),
                         (["--traces", str(t_real), "--replace", "--grid", "0.5,,1"], "--grid has an empty entry")):
        assert main(["predictor", "calibrate-xl", "--predictor", str(d), "--quiet", *argv]) == 2
        err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
        assert len(err) == 1 and needle in err[0], err
    assert (d / XL_WEIGHTS_NAME).read_bytes() == before
    assert main(["predictor", "calibrate-xl", "--predictor", str(d), "--traces", str(t_xl), "--replace",
                 "--allow-synthetic", "--grid", "1,0.5,0.5", "--quiet"]) == 0
    assert "fitted on synthetic traces" in capsys.readouterr().out
    stored = json.loads((d / XL_WEIGHTS_NAME).read_text())
    assert stored["synthetic"] is True and stored["grid"] == [0.5, 1.0]
    assert "fitted on synthetic traces" in describe_xl_weights(load_predictor(d))
    assert main(["predictor", "eval", "--predictor", str(d), "--traces", str(t_xl), "--quiet", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["xl_blend_weights"] == describe_xl_weights(load_predictor(d)) and "what-if" in got["synthetic"][0]


def test_calibrated_weights_reach_the_simulator_and_the_runtime_feed(tiny_dirs, random_pset):
    """``PredictorSet.xl_weights`` is what ``xl_stream`` (simulate, bench decode's simulated column) and
    ``attach_cross_layer`` (the runtime's ``seqmoe-xl``) blend with."""
    from moe_offload.generation.generate import run
    from moe_offload.models.loader import load_offloaded
    from moe_offload.predictor.cross_layer import attach_cross_layer
    from moe_offload.sim.forecasts import xl_stream
    from moe_offload.trace.collect import TraceRecorder

    lm = load_offloaded(tiny_dirs["mixtral"], residency=0.5, policy="seqmoe-cacheonly", progress=False)
    with TraceRecorder(lm, xl_depth=2) as tracer:
        run(lm, ["a b c"], 6, recorder=tracer)
        tr = tracer.trace()
    ps = random_pset(lm, seed=3)

    def probs(stream):
        return [np.asarray(f.probs) for ev in stream for _, f in ev if f.cross_layer]

    default = probs(xl_stream(tr, ps))
    explicit = probs(xl_stream(tr, ps, weights=(0.9, 0.1)))
    ps.xl_weights = (0.9, 0.1)
    stored = probs(xl_stream(tr, ps))
    assert len(stored) == len(default) > 0
    assert all(np.array_equal(a, b) for a, b in zip(stored, explicit))
    assert not all(np.array_equal(a, b) for a, b in zip(stored, default))
    feed = attach_cross_layer(lm, ps, depth=2)
    assert feed.weights == (0.9, 0.1)


def test_generate_names_the_blend_weights(tiny_dirs, random_pset, tmp_path, capsys):
    """``generate --policy seqmoe-xl --json`` says which blend weights it used and where they come from."""
    from moe_offload.models.loader import load_offloaded

    d = tmp_path / "pred"
    random_pset(load_offloaded(tiny_dirs["mixtral"], residency=0.5, progress=False), seed=2).save(d)
    write_xl_weights(d, (0.7, 0.2), {})
    assert main(["generate", "--model", str(tiny_dirs["mixtral"]), "--prompt", "hi", "--max-new-tokens", "3",
                 "--quiet", "--policy", "seqmoe-xl", "--predictor", str(d), "--residency", "0.5", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["stats"]["predictor"]["xl_blend_weights"] == f"0.7, 0.2 ({d / XL_WEIGHTS_NAME})"
