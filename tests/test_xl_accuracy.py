"""What-if cross-layer forecasts (``trace xl-accuracy``): the true routing with experts swapped at chosen rates."""

import numpy as np
import pytest

from moe_offload.cli import main
from moe_offload.errors import MoeOffloadError
from moe_offload.trace.format import load_trace
from moe_offload.trace.synthetic import synthetic_trace
from moe_offload.trace.xl_accuracy import with_xl_accuracy

L, E, K = 4, 16, 2


@pytest.fixture(scope="module")
def trace():
    return synthetic_trace(num_moe_layers=L, num_experts=E, top_k=K, steps=200, requests=2, prompt_tokens=3, seed=1)


def _truth(tr):
    return tr.expert_ids[tr.step > 0].astype(np.int64)          # [D, L, k]


def _top(p):
    return np.sort(np.argsort(-p, axis=-1, kind="stable")[..., :K], axis=-1)


def test_no_swap_gives_the_true_routing(trace):
    out = with_xl_accuracy(trace, [0.0, 0.0], seed=3)
    xl, truth = out.xl_probs, _truth(trace)
    assert xl.shape == (400, L, 2, E) and xl.dtype == np.float32
    for j in range(2):
        for layer in range(L):
            if layer + 1 + j >= L:
                assert not xl[:, layer, j].any()           # past the last MoE layer: zeros, as recorded
                continue
            assert np.array_equal(_top(xl[:, layer, j]), np.sort(truth[:, layer + 1 + j], axis=1))
            np.testing.assert_allclose(xl[:, layer, j].sum(axis=1), 1.0, rtol=1e-6)   # uniform tail: sums to 1
    assert out.header["synthetic"] is True and "0,0" in out.header["xl_forecasts"]
    assert out.expert_ids is trace.expert_ids and trace.xl_probs is None and "xl_forecasts" not in trace.header


def test_full_swap_gives_k_wrong_experts(trace):
    xl, truth = with_xl_accuracy(trace, [1.0]).xl_probs, _truth(trace)
    eps = 1.0 / (2 * (K + 1))
    for layer in range(L - 1):
        top = _top(xl[:, layer, 0])
        assert not (top[:, :, None] == truth[:, layer + 1][:, None, :]).any()      # disjoint from the truth
        np.testing.assert_allclose(np.sort(xl[:, layer, 0], axis=1)[:, -K:], (1 - eps) / K + eps / E, rtol=1e-6)


def test_swap_rate_and_seed(trace):
    a = with_xl_accuracy(trace, [0.25, 0.5], seed=7).xl_probs
    b = with_xl_accuracy(trace, [0.25, 0.5], seed=7).xl_probs
    assert np.array_equal(a, b)
    truth = _truth(trace)
    for j, q in enumerate((0.25, 0.5)):
        top = np.stack([_top(a[:, layer, j]) for layer in range(L - 1 - j)], axis=1)          # [D, L-1-j, k]
        true = np.sort(truth[:, 1 + j:], axis=2)
        kept = (top[..., :, None] == true[..., None, :]).any(-1).mean()
        assert abs((1 - kept) - q) < 0.03, (j, kept)


def test_recorded_tail_keeps_its_ranking(trace):
    rec = with_xl_accuracy(trace, [0.5, 0.5, 0.5], seed=11)        # a "recorded" forecast with some ranking
    out = with_xl_accuracy(rec, [0.0, 0.0, 0.0], seed=2)
    assert "recorded tail: yes" in out.header["xl_forecasts"]
    eps = 1.0 / (2 * (K + 1))
    truth = _truth(trace)
    r, layer = 17, 0
    p, tail = out.xl_probs[r, layer, 0], rec.xl_probs[r, layer, 0]
    np.testing.assert_allclose(p, eps * tail + np.isin(np.arange(E), truth[r, 1]) * (1 - eps) / K, rtol=1e-6)


def test_refusals(trace):
    with pytest.raises(MoeOffloadError, match="at least one rate"):
        with_xl_accuracy(trace, [])
    with pytest.raises(MoeOffloadError, match=r"in \[0, 1\], got -0.1"):
        with_xl_accuracy(trace, [0.1, -0.1])
    small = synthetic_trace(num_moe_layers=2, num_experts=3, top_k=2, steps=4)
    with pytest.raises(MoeOffloadError, match="at least 2k = 4 experts"):
        with_xl_accuracy(small, [0.1])


def test_cli_writes_a_marked_trace_and_never_overwrites(trace, tmp_path, capsys):
    src = tmp_path / "t.trace"
    trace.save(src)
    out = tmp_path / "w.trace"
    assert main(["trace", "xl-accuracy", str(src), "--swap", "0.1,0.2", "--out", str(out)]) == 0
    got = load_trace(out)
    assert got.xl_probs.shape == (400, L, 2, E) and got.header["synthetic"] is True
    assert got.header["xl_depth"] == 2
    before = out.read_bytes()
    for argv, needle in ((["--swap", "0.1", "--out", str(out)], "already exists"),
                         (["--swap", "0.1,x", "--out", str(tmp_path / "n.trace")], "comma-separated numbers"),
                         (["--swap", "2", "--out", str(tmp_path / "n.trace")], "in [0, 1], got 2.0"),
                         (["--swap", "0.1,,0.2", "--out", str(tmp_path / "n.trace")], "--swap has an empty entry"),
                         (["--swap", "0.1,0.1,0.1,0.1", "--out", str(tmp_path / "n.trace")],
                          "at most 3 layer distances")):
        capsys.readouterr()
        assert main(["trace", "xl-accuracy", str(src), *argv]) == 2
        err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
        assert len(err) == 1 and needle in err[0], err
    assert out.read_bytes() == before and not (tmp_path / "n.trace").exists()
    capsys.readouterr()
    assert main(["trace", "info", str(out)]) == 0
    info = capsys.readouterr().out
    assert "(SYNTHETIC)" in info and "cross-layer forecasts: depth 2, what-if" in info


def test_a_diffusion_trace_is_named_as_such(tmp_path):
    from moe_offload.trace.diffusion_synthetic import synthetic_diffusion_trace
    from moe_offload.trace.format import load_trace

    synthetic_diffusion_trace(2, 8, 2, requests=1, blocks=1, block_length=4).save(tmp_path / "d.trace")
    with pytest.raises(MoeOffloadError, match="is a moe-offload diffusion trace, not a moe-offload trace"):
        load_trace(tmp_path / "d.trace")
