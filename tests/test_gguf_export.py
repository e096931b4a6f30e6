"""``export gguf`` (issue 36): refusals as one-line errors, and (where llama.cpp's converter is found through
LLAMA_CPP_DIR) a real conversion of the tiny Mixtral."""

from __future__ import annotations

import os

import pytest

from moe_offload.cli import main
from moe_offload.errors import MoeOffloadError
from moe_offload.models.gguf_export import export_gguf, find_converter


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


@pytest.mark.skipif(not os.environ.get("LLAMA_CPP_DIR"), reason="LLAMA_CPP_DIR (a llama.cpp source tree) not set")
def test_converts_testbed_sparse(tmp_path):
    """testbed-sparse (its tokenizer is one llama.cpp's converter knows): every expert tensor stacked per layer
    (``*_exps``, 3 per layer), 32 experts each; about a minute."""
    import json

    from gguf import GGUFReader

    from moe_offload.models.resolve import resolve_model

    model = resolve_model("testbed-sparse", progress=False)
    out = export_gguf(model, tmp_path / "ts.gguf")
    cfg = json.loads((model / "config.json").read_text())
    exps = [t for t in GGUFReader(out).tensors if "_exps" in t.name]
    assert len(exps) == 3 * cfg["num_hidden_layers"]
    assert all(cfg["num_local_experts"] in [int(x) for x in t.shape] for t in exps)
