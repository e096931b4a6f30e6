"""``export gguf`` (issue 36): refusals as one-line errors, and (where llama.cpp's converter is found through
LLAMA_CPP_DIR) a real conversion of the tiny Mixtral."""

from __future__ import annotations

import os

import pytest

from moe_offload.cli import main
from moe_offload.errors import MoeOffloadError
from moe_offload.bench.gguf_export import export_gguf, find_converter, first_difference, router_near_ties, router_ulp_control


def test_refusals(tiny_dirs, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("LLAMA_CPP_DIR", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))  # no converter on PATH
    (tmp_path / "have.gguf").write_bytes(b"x")
    with pytest.raises(MoeOffloadError, match="already exists"):
        export_gguf(tiny_dirs["mixtral"], tmp_path / "have.gguf")
    assert (tmp_path / "have.gguf").read_bytes() == b"x"  # untouched
    with pytest.raises(MoeOffloadError, match="Mixtral layout"):
        export_gguf(tiny_dirs["qwen3_moe"], tmp_path / "q.gguf")
    with pytest.raises(MoeOffloadError, match="was not found"):
        find_converter()
    with pytest.raises(MoeOffloadError, match="no convert_hf_to_gguf.py"):
        find_converter(tmp_path)
    assert main(["export", "gguf", "--model", str(tiny_dirs["mixtral"]), "--out", str(tmp_path / "m.gguf")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "was not found" in err
    assert not (tmp_path / "m.gguf").exists() and not (tmp_path / "m.gguf.partial").exists()
    assert main(["export", "gguf", "--model", str(tiny_dirs["mixtral"]), "--out", str(tmp_path / "m.gguf"),
                 "--check-controls", "-1"]) == 2
    assert "--check-controls must be 0 or more" in capsys.readouterr().err


@pytest.mark.skipif(not os.environ.get("LLAMA_CPP_DIR"), reason="LLAMA_CPP_DIR (a llama.cpp source tree) not set")
def test_converts_testbed_sparse(tmp_path):
    """testbed-sparse (its tokenizer is one llama.cpp's converter knows): every expert tensor stacked per layer
    (``*_exps``, 3 per layer), 32 experts each; about a minute."""
    import json

    from gguf import GGUFReader

    from moe_offload.testbed.resolve import resolve_model

    model = resolve_model("testbed-sparse", progress=False)
    out = export_gguf(model, tmp_path / "ts.gguf")
    cfg = json.loads((model / "config.json").read_text())
    exps = [t for t in GGUFReader(out).tensors if "_exps" in t.name]
    assert len(exps) == 3 * cfg["num_hidden_layers"]
    assert all(cfg["num_local_experts"] in [int(x) for x in t.shape] for t in exps)


def test_router_ulp_control_moves_only_near_ties():
    """The control of ``check_tokens``: an exact tie at the top-k boundary is broken one way or the other by the seed,
    a boundary two ulps or more apart never moves, and the scores stay those of the chosen experts (renormalised)."""
    import torch
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter

    cfg = MixtralConfig(hidden_size=4, num_local_experts=4, num_experts_per_tok=2)
    tied, apart = MixtralTopKRouter(cfg), MixtralTopKRouter(cfg)
    with torch.no_grad():  # logits [3, 1, 1, 0] (experts 1 and 2 tie for the second place) and [3, 2, 1, 0]
        tied.weight.copy_(torch.tensor([[3.0, 0, 0, 0], [1, 0, 0, 0], [1, 0, 0, 0], [0, 0, 0, 0]]))
        apart.weight.copy_(torch.tensor([[3.0, 0, 0, 0], [2, 0, 0, 0], [1, 0, 0, 0], [0, 0, 0, 0]]))
    x = torch.tensor([[1.0, 0, 0, 0]])
    container = torch.nn.ModuleList([tied, apart])
    picks = set()
    for seed in range(16):
        with router_ulp_control(container, seed):
            _, scores, idx = tied(x)
            picks.add(tuple(sorted(idx[0].tolist())))
            assert sorted(apart(x)[2][0].tolist()) == [0, 1]
            assert torch.allclose(scores.sum(-1), torch.ones(1))
    assert picks == {(0, 1), (0, 2)}
    assert sorted(tied(x)[2][0].tolist()) in ([0, 1], [0, 2])  # the hook is gone afterwards
    with pytest.raises(MoeOffloadError, match="no top-k router"):
        with router_ulp_control(torch.nn.Linear(2, 2), 0):
            pass
    with router_near_ties(container) as ties:
        tied(x), apart(x)
    assert ties == {"decisions": 2, "near": 1, "exact": 1}  # the tie for the second place; [3, 2, 1, 0] is far apart
    assert first_difference([1, 2, 3], [1, 2, 4]) == 2 and first_difference([1], [1]) == 1
