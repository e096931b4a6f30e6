"""The widened benchmark model (issue 36, testbed/widen.py): zero neurons keep the function; the widened bf16
checkpoint streamed from disk gives its own FullLoad's tokens."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from moe_offload.errors import MoeOffloadError
from moe_offload.generation.generate import encode_prompt, generate_ids
from moe_offload.models.loader import load_full, load_offloaded
from moe_offload.testbed.widen import widen_checkpoint, widen_expert

PROMPT = "Experts widened with zero neurons compute the same function."


def test_widen_expert_appends_zero_neurons():
    w1 = torch.arange(6.0).reshape(2, 3)   # [I=2, H=3]
    w2 = torch.arange(6.0).reshape(3, 2)   # [H=3, I=2]
    a = widen_expert("model.layers.0.block_sparse_moe.experts.5.w1.weight", w1, 4)
    b = widen_expert("model.layers.0.block_sparse_moe.experts.5.w2.weight", w2, 4)
    assert a.shape == (4, 3) and torch.equal(a[:2], w1) and not a[2:].any()
    assert b.shape == (3, 4) and torch.equal(b[:, :2], w2) and not b[:, 2:].any()
    gate = torch.ones(2, 3)
    assert widen_expert("model.layers.0.block_sparse_moe.gate.weight", gate, 4) is gate
    with pytest.raises(MoeOffloadError, match="more than the requested 1"):
        widen_expert("model.layers.0.block_sparse_moe.experts.0.w3.weight", w1, 1)


def test_widened_checkpoint_keeps_the_function(tiny_dirs, tmp_path, one_thread):
    """float32, 3 shards: the widened model's greedy tokens are the original's (zero neurons add exact zeros)."""
    src = tiny_dirs["mixtral"]
    wide = widen_checkpoint(src, tmp_path / "wide", intermediate_size=64, dtype=torch.float32,
                            shard_bytes=200_000)
    cfg = json.loads((wide / "config.json").read_text())
    index = json.loads((wide / "model.safetensors.index.json").read_text())
    assert cfg["intermediate_size"] == 64 and cfg["dtype"] == "float32"
    assert len(set(index["weight_map"].values())) >= 3
    shard = wide / index["weight_map"]["model.layers.0.block_sparse_moe.experts.0.w2.weight"]
    with safe_open(shard, "pt") as f:
        assert f.get_slice("model.layers.0.block_sparse_moe.experts.0.w2.weight").get_shape()[1] == 64
    a, b = load_full(src, device="cpu"), load_full(wide, device="cpu")
    assert b.model_id == a.model_id  # the same routers: the source's traces and predictors apply
    ids = encode_prompt(a.tokenizer, PROMPT)
    assert generate_ids(b, ids, 12)[0] == generate_ids(a, ids, 12)[0]


def test_widened_bf16_from_disk_equals_its_full_load(tiny_dirs, tmp_path, one_thread):
    """bfloat16 (the built-in variant's dtype), shard-spanning: --host-store disk at residency 0.3 with LRU gives
    the widened model's own FullLoad tokens."""
    wide = widen_checkpoint(tiny_dirs["mixtral"], tmp_path / "wide16", intermediate_size=64, shard_bytes=100_000)
    full = load_full(wide, device="cpu")
    ids = encode_prompt(full.tokenizer, PROMPT)
    ref = generate_ids(full, ids, 12)[0]
    off = load_offloaded(wide, device="cpu", residency=0.3, policy="lru", host_store="disk", progress=False)
    try:
        assert generate_ids(off, ids, 12)[0] == ref
        assert off.engine.store.stats.experts > 0
    finally:
        off.close()


def test_widen_refuses_other_layouts(tiny_dirs, tmp_path):
    with pytest.raises(MoeOffloadError, match="Mixtral-layout"):
        widen_checkpoint(tiny_dirs["qwen3_moe"], tmp_path / "x")
