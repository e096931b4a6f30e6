"""The aligned expert pack (``moe-offload pack``, ``models.expert_pack``): ``--host-store disk`` reads it straight
into the slots and generates FullLoad's tokens; a pack that no longer matches its checkpoint, a missing model and
an occupied ``--out`` are one-line errors that touch nothing."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from moe_offload.cli import main
from moe_offload.errors import MoeOffloadError
from moe_offload.generation.generate import run
from moe_offload.models.expert_pack import DEFAULT_DIR, META_FILE, PACK_FILE, find_pack, stride_for
from moe_offload.models.loader import load_full, load_offloaded
from moe_offload.models.tiny import make_tiny

PROMPTS = ["hello there", "the sea and the wind"]


def assert_one_line_error(code, err, needle):
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("moe-offload: error: "), err
    assert needle in lines[0], err


@pytest.fixture
def model(tmp_path):
    """A tiny Mixtral of our own (its files get edited), with experts of a whole number of 4 KiB pages."""
    return make_tiny("mixtral", tmp_path / "m", config_overrides=dict(intermediate_size=64))


def test_pack_reads_in_place_and_equals_full_load(model, one_thread, capsys):
    assert main(["pack", str(model), "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "by itself (it lies beside the model)" in out
    pack = find_pack(model, None)
    assert pack is not None and pack.folder == model / DEFAULT_DIR
    ref = [o.token_ids for o in run(load_full(model, device="cpu"), PROMPTS, 8)[0]]
    lm = load_offloaded(model, device="cpu", residency=0.5, host_store="disk")  # finds the pack beside the model
    st = lm.engine.store
    assert st.pack == model / DEFAULT_DIR and lm.expert_bytes % 4096 == 0
    assert (model / DEFAULT_DIR / PACK_FILE).stat().st_size == st.num_experts_total * stride_for(lm.expert_bytes)
    outs, stats = run(lm, PROMPTS, 8)
    assert [o.token_ids for o in outs] == ref
    assert stats.offload.misses > 0 and st.stats.in_place == st.stats.experts > 0  # no staging copy at all
    lm.close()
    plain = load_offloaded(model, device="cpu", residency=0.5, host_store="disk", pack=False)
    outs, _ = run(plain, PROMPTS, 8)
    assert [o.token_ids for o in outs] == ref and plain.engine.store.stats.in_place == 0
    plain.close()


def test_stale_pack_is_refused(model, tmp_path, capsys):
    assert main(["pack", str(model), "--out", str(tmp_path / "p"), "--quiet"]) == 0
    capsys.readouterr()
    shard = sorted(model.glob("*.safetensors"))[0]
    st = shard.stat()
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))  # edited after packing
    with pytest.raises(MoeOffloadError, match=f"no longer matches .*{shard.name} changed"):
        load_offloaded(model, device="cpu", residency=0.5, host_store="disk", pack=tmp_path / "p")
    code = main(["generate", "--model", str(model), "--prompt", "hi", "--max-new-tokens", "2", "--quiet",
                 "--residency", "0.5", "--host-store", "disk", "--pack", str(tmp_path / "p")])
    assert_one_line_error(code, capsys.readouterr().err, "no longer matches")


def test_pack_bad_input(model, tmp_path, capsys):
    code = main(["pack", str(tmp_path / "nothing"), "--quiet"])
    assert_one_line_error(code, capsys.readouterr().err, "not found")
    occupied = tmp_path / "occupied"
    occupied.mkdir()
    (occupied / "mine.txt").write_text("keep me")
    code = main(["pack", str(model), "--out", str(occupied), "--quiet"])
    assert_one_line_error(code, capsys.readouterr().err, "already exists and is not an empty folder")
    assert [p.name for p in occupied.iterdir()] == ["mine.txt"] and (occupied / "mine.txt").read_text() == "keep me"
    code = main(["generate", "--model", str(model), "--prompt", "hi", "--quiet", "--pack", str(tmp_path / "none"),
                 "--host-store", "disk"])
    assert_one_line_error(code, capsys.readouterr().err, f"no {META_FILE} there")
    code = main(["generate", "--model", str(model), "--prompt", "hi", "--quiet", "--pack", str(occupied)])
    assert_one_line_error(code, capsys.readouterr().err, "--pack needs --host-store disk")


def test_pack_of_another_layout_is_refused(model, tmp_path, capsys):
    assert main(["pack", str(model), "--out", str(tmp_path / "p"), "--quiet"]) == 0
    meta = json.loads((tmp_path / "p" / META_FILE).read_text())
    meta["layout"]["expert_bytes"] += 16
    (tmp_path / "p" / META_FILE).write_text(json.dumps(meta))
    with pytest.raises(MoeOffloadError, match="another expert layout"):
        load_offloaded(model, device="cpu", residency=0.5, host_store="disk", pack=tmp_path / "p")
    shutil.rmtree(tmp_path / "p")


def test_pack_prefetches_in_place(model, one_thread):
    """``xl`` prefetches from the pack (chunked reads that yield to on-demand ones) land in place: FullLoad's
    tokens."""
    from moe_offload.predictor.cross_layer import attach_forecasts

    assert main(["pack", str(model), "--quiet"]) == 0
    ref = [o.token_ids for o in run(load_full(model, device="cpu"), PROMPTS, 10)[0]]
    lm = load_offloaded(model, device="cpu", residency=0.5, policy="xl", host_store="disk")
    attach_forecasts(lm, "xl", None)
    outs, _ = run(lm, PROMPTS, 10)
    pf, st = lm.engine.prefetcher, lm.engine.store.stats
    pf.close()
    assert [o.token_ids for o in outs] == ref
    assert pf.prefetches > 0 and st.in_place == st.experts
    lm.close()


def test_failed_pack_leaves_nothing(model, tmp_path, monkeypatch):
    """A write that fails (a full disk) is a one-line error and leaves neither a partial pack file nor the folder
    the pack would have made."""
    import moe_offload.models.pack_writer as pw

    monkeypatch.setattr(pw.os, "pwrite", lambda fd, data, offset: 0)
    with pytest.raises(MoeOffloadError, match="disk full"):
        pw.write_pack(model, tmp_path / "new" / "p", progress=False)
    assert not (tmp_path / "new" / "p").exists()
