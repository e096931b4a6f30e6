"""The disk tier (``--host-store disk``, issue 35): experts read from the safetensors files with direct I/O.

Tokens equal FullLoad's for every policy family over the disk store (greedy, one thread), the reads are planned into
aligned spans as hand-worked here, the page cache holds no expert page after a run, the buffered fallback behaves
the same, and bad situations (a filesystem refusing both direct I/O and fadvise, a shard truncated while running)
are one-line errors. The quantized layouts (FP8, MXFP4, shard-spanning bf16) over the disk store are in
test_quantized.py."""

import os

import numpy as np
import pytest
import torch

from moe_offload.errors import MoeOffloadError
from moe_offload.generation.generate import encode_prompt, generate_ids
from moe_offload.models.checkpoint import Checkpoint
from moe_offload.generation.diffusion import diffusion_generate_ids
from moe_offload.models.loader import load_full, load_offloaded
from moe_offload.runtime import direct_io
from moe_offload.runtime.disk_store import IO_ALIGN, plan_spans
from moe_offload.runtime.page_cache import PAGE, drop, resident_pages

PROMPT = "The slot pool is shared by all MoE layers; a lookup table maps each expert to its slot."
NEW = 10


@pytest.fixture(scope="module")
def refs(tiny_dirs):
    torch.set_num_threads(1)
    out = {}
    for arch in ("qwen3_moe", "gpt_oss", "llada2_moe"):
        full = load_full(tiny_dirs[arch], device="cpu")
        ids = encode_prompt(full.tokenizer, PROMPT)
        out[arch] = (diffusion_generate_ids(full, ids, 16, block_length=8).token_ids if arch == "llada2_moe" else
                     generate_ids(full, ids, NEW)[0])
    return out


def test_plan_spans_hand_worked():
    """Segments ``(dst_offset, file, file_offset, nbytes)``: two ranges 1000 bytes apart in file 0 share one read,
    from 8192 (8200 rounded down to 4 KiB) for 4096 bytes, of which 2508 (up to byte 10700) are wanted; a range
    100 KiB further (113100..113400) is its own read from 110592; file 1's range its own from 0."""
    segs = [(0, 0, 8200, 1000), (1008, 0, 10200, 500), (1520, 0, 113100, 300), (1824, 1, 5, 10)]
    spans = plan_spans(segs, merge_gap=64 * 1024, align=IO_ALIGN)
    assert [(s.file, s.start, s.length, s.need) for s in spans] == [
        (0, 8192, 4096, 2508), (0, 110592, 4096, 2808), (1, 0, 4096, 15)]
    assert spans[0].pieces == ((0, 8, 1000), (1008, 2008, 500))
    assert spans[1].pieces == ((1520, 2508, 300),)
    assert spans[2].pieces == ((1824, 5, 10),)
    assert all(s.start % IO_ALIGN == 0 and s.length % IO_ALIGN == 0 for s in spans)


@pytest.mark.parametrize("arch,policy", [("qwen3_moe", "lru"), ("qwen3_moe", "lfu"), ("qwen3_moe", "auto"),
                                         ("qwen3_moe", "prefill-hot"), ("gpt_oss", "lru")])
def test_history_policies_tokens_equal_full_load(tiny_dirs, refs, arch, policy):
    lm = load_offloaded(tiny_dirs[arch], device="cpu", residency=0.3, policy=policy, progress=False,
                        host_store="disk")
    try:
        got = generate_ids(lm, encode_prompt(lm.tokenizer, PROMPT), NEW)[0]
        assert got == refs[arch]
        st, ds = lm.engine.stats, lm.engine.store.stats
        assert st.misses > 0 and ds.experts == st.misses  # every miss read once from disk, nothing else
        assert ds.expert_bytes == st.misses * sum(f.nbytes for f in lm.engine.store.layout.fields)
        assert lm.engine.store.nbytes == 0 and lm.host_store == "disk"
    finally:
        lm.close()


@pytest.mark.parametrize("policy", ["seqmoe", "xl", "seqmoe-xl"])
def test_forecast_policies_tokens_equal_full_load(tiny_dirs, refs, random_pset, policy):
    """SeqMoE (JSD prefetching over the disk link, read on a worker thread: the native prefetch queue's when the
    kernels are built, else the transfer engine's), cross-layer and blended forecasts: prefetches race real reads
    and tokens stay FullLoad's."""
    from moe_offload.predictor.cross_layer import attach_cross_layer
    from moe_offload.predictor.attach import attach_predictor
    from moe_offload.runtime.kernels import native
    from moe_offload.runtime.native_prefetch import NativePrefetchQueue
    from moe_offload.runtime.transfer import TransferEngine

    lm = load_offloaded(tiny_dirs["qwen3_moe"], device="cpu", residency=0.4, policy=policy, progress=False,
                        host_store="disk")
    try:
        transfer = lm.engine.prefetcher.transfer  # a real link: a real worker thread
        assert isinstance(transfer, NativePrefetchQueue if native() else TransferEngine) and transfer.worker_alive
        if policy == "seqmoe":
            attach_predictor(lm.engine, random_pset(lm, 1), rollout=7)
        else:
            attach_cross_layer(lm, random_pset(lm, 1) if policy == "seqmoe-xl" else None)
        got = generate_ids(lm, encode_prompt(lm.tokenizer, PROMPT), NEW)[0]
        assert got == refs["qwen3_moe"]
        assert lm.engine.prefetcher.prefetches > 0
        st = lm.engine.store.stats
        assert st.experts >= lm.engine.stats.misses and st.bytes_read > 0
    finally:
        lm.close()


def test_tide_on_llada2_tokens_equal_full_load(tiny_dirs, refs):
    lm = load_offloaded(tiny_dirs["llada2_moe"], device="cpu", residency=0.4, policy="tide", progress=False,
                        host_store="disk")
    try:
        ids = encode_prompt(lm.tokenizer, PROMPT)
        assert diffusion_generate_ids(lm, ids, 16, block_length=8).token_ids == refs["llada2_moe"]
        assert lm.engine.store.stats.experts > 0
    finally:
        lm.close()


def _expert_pages(d) -> dict:
    """``{file: [page ids]}`` of pages lying wholly inside routed-expert tensors of checkpoint ``d``."""
    ckpt = Checkpoint(d)
    out = {}
    for key in ckpt.keys():
        if ".experts." not in key:
            continue
        info = ckpt.info(key)
        first, last = -(-info.start // PAGE), (info.start + info.nbytes) // PAGE
        out.setdefault(info.file, []).extend(range(first, last))
    ckpt.close()
    return out


def test_page_cache_holds_no_expert_page(tiny_dirs, refs):
    d = tiny_dirs["qwen3_moe"]
    pages = _expert_pages(d)
    assert sum(map(len, pages.values())) > 50
    for f in pages:
        drop(f)
    lm = load_offloaded(d, device="cpu", residency=0.3, progress=False, host_store="disk")
    try:
        assert generate_ids(lm, encode_prompt(lm.tokenizer, PROMPT), NEW)[0] == refs["qwen3_moe"]
        assert lm.engine.store.stats.experts > 50
        for f, ids in pages.items():
            assert not resident_pages(f)[ids].any(), f
    finally:
        lm.close()


def test_buffered_fallback_drops_what_it_reads(tiny_dirs, refs, monkeypatch, capsys):
    """A filesystem without O_DIRECT: reads go through the page cache and are dropped after each (said once)."""
    monkeypatch.setattr(direct_io, "_O_DIRECT", 0)
    d = tiny_dirs["qwen3_moe"]
    pages = _expert_pages(d)
    for f in pages:
        drop(f)
    lm = load_offloaded(d, device="cpu", residency=0.3, progress=False, host_store="disk")
    try:
        assert lm.engine.store.buffered_reason is not None
        assert generate_ids(lm, encode_prompt(lm.tokenizer, PROMPT), NEW)[0] == refs["qwen3_moe"]
        for f, ids in pages.items():
            assert not resident_pages(f)[ids].any(), f
    finally:
        lm.close()
    err = capsys.readouterr().err
    assert err.count("posix_fadvise DONTNEED") == 1


def test_filesystem_refusing_direct_io_and_fadvise_is_one_line_error(tiny_dirs, monkeypatch):
    monkeypatch.setattr(direct_io, "_O_DIRECT", 0)

    def refuse(*a):
        raise OSError(95, "Operation not supported")

    monkeypatch.setattr(os, "posix_fadvise", refuse)
    with pytest.raises(MoeOffloadError, match="refuses both direct I/O .* and posix_fadvise") as e:
        load_offloaded(tiny_dirs["qwen3_moe"], device="cpu", residency=0.3, progress=False, host_store="disk")
    assert "\n" not in str(e.value)


def test_truncated_shard_is_one_line_error(tiny_dirs, tmp_path, capsys):
    """A shard cut short while the model runs: the next read of an expert past the cut is a one-line error
    (a shard deleted while running stays readable through its open descriptor, so that one keeps working)."""
    import shutil

    from moe_offload.cli import main

    d = tmp_path / "m"
    shutil.copytree(tiny_dirs["qwen3_moe"], d)
    lm = load_offloaded(d, device="cpu", residency=0.3, progress=False, host_store="disk")
    try:
        shard = lm.engine.store.files[0]
        os.unlink(shard)  # deleted: still readable
        assert generate_ids(lm, encode_prompt(lm.tokenizer, PROMPT), 3)[0] == refs_first(tiny_dirs, 3)
    finally:
        lm.close()
    shutil.copytree(tiny_dirs["qwen3_moe"], d, dirs_exist_ok=True)
    lm = load_offloaded(d, device="cpu", residency=0.3, progress=False, host_store="disk")
    try:
        f = lm.engine.store.files[0]
        os.truncate(f, 4096 * 2)
        with pytest.raises(MoeOffloadError, match="truncated or replaced while running") as e:
            generate_ids(lm, encode_prompt(lm.tokenizer, PROMPT), 3)
        assert "\n" not in str(e.value)
    finally:
        lm.close()


def refs_first(tiny_dirs, n):
    full = load_full(tiny_dirs["qwen3_moe"], device="cpu")
    return generate_ids(full, encode_prompt(full.tokenizer, PROMPT), n)[0]


def test_copy_many_reads_concurrently_equal_bytes(tiny_dirs):
    """``copy_many`` with four readers and ``copy_to`` one at a time give the same bytes as the private store."""
    pinned = load_offloaded(tiny_dirs["gpt_oss"], device="cpu", residency=0.3, progress=False)
    disk = load_offloaded(tiny_dirs["gpt_oss"], device="cpu", residency=0.3, progress=False, host_store="disk")
    try:
        n = disk.engine.store.num_experts_total
        eb = disk.engine.store.layout.expert_bytes
        got = np.zeros((n, eb), dtype=np.uint8)
        disk.engine.store.copy_many(list(range(n)), [got[i] for i in range(n)])
        want = pinned.engine.store.buf.numpy()
        for f in disk.engine.store.layout.fields:  # padding bytes between fields are not read
            assert np.array_equal(got[:, f.offset:f.offset + f.nbytes], want[:, f.offset:f.offset + f.nbytes])
        one = np.zeros(eb, dtype=np.uint8)
        disk.engine.store.copy_to(n - 1, one)
        assert np.array_equal(one, got[n - 1])
    finally:
        pinned.close()
        disk.close()


def test_measure_disk_table(tmp_path):
    from moe_offload.bench.disk_link import measure_disk

    e = measure_disk(tmp_path, file_mb=8, seconds=0.02, sizes_kib=(4, 64), depths=(1, 2))
    assert list(tmp_path.iterdir()) == []  # the scratch file is gone
    assert set(e["table_gbps"]) == {"4", "64"} and set(e["table_gbps"]["4"]) == {"1", "2"}
    assert all(v > 0 for row in e["table_gbps"].values() for v in row.values())
    assert e["best"]["64"][1] == max(e["table_gbps"]["64"].values())


def test_over_disk_replaces_the_link_by_the_disk():
    """``simulate --link disk``: the profile's link becomes its disk at one expert's read size (QD 1)."""
    import dataclasses

    from moe_offload.core.disk_link import over_disk
    from moe_offload.core.profiles import load_hardware
    from moe_offload.sim.timemodel import OnDemandTimeModel

    hw = over_disk(load_hardware("rtx4090"), 4 * 2**20)
    assert hw.link_gbps == 7.45 and hw.link.startswith("disk (PCIe 4.0 x4 NVMe")
    tm = OnDemandTimeModel(hw, "qwen3-30b-a3b-fp8")
    assert tm.t_load_s == pytest.approx(tm.model.expert_bytes / 7.45e9)
    measured = dataclasses.replace(hw, extra={"disk": {"directory": "/x", "table_gbps": {"64": {"1": 1.0},
                                                                                         "256": {"1": 2.0}}}})
    assert over_disk(measured, 128 * 1024).link_gbps == pytest.approx(1.5)


def test_disk_gbps_interpolates_on_log_size_and_picks_readers(monkeypatch):
    """Hand-worked: 64 KiB -> 1.0 GB/s and 256 KiB -> 2.0 GB/s at QD 1; 128 KiB lies halfway on a log scale: 1.5.
    At 128 KiB QD 2 gives 1.9, QD 4 gives 2.0: the smallest depth within 5% of the best is 2."""
    from moe_offload.core import disk_link

    disk = {"table_gbps": {"64": {"1": 1.0, "2": 1.6, "4": 1.8}, "256": {"1": 2.0, "2": 2.2, "4": 2.2}},
            "best": {"64": [4, 1.8], "256": [2, 2.2]}, "gbps": 2.2}
    assert disk_link.disk_gbps(disk, 128 * 1024, 1) == pytest.approx(1.5)
    assert disk_link.disk_gbps(disk, 16 * 1024, 1) == 1.0 and disk_link.disk_gbps(disk, 1 << 30, 1) == 2.0
    assert disk_link.disk_gbps(disk, 128 * 1024, None) == pytest.approx(2.0)
    assert disk_link.disk_gbps({"gbps": 7.45}, 4096) == 7.45
    monkeypatch.setattr(disk_link, "this_machine_disk", lambda: disk)
    assert disk_link.readers_for(128 * 1024, 4) == 2
    monkeypatch.setattr(disk_link, "this_machine_disk", lambda: None)
    assert disk_link.readers_for(128 * 1024, 4) == 4


def test_cli_disk_store_and_memory_budget(tiny_dirs, refs, capsys, monkeypatch, tmp_path):
    """``generate --host-store disk --memory-budget`` through the CLI: FullLoad's tokens, the plan and the disk's
    counters in ``--json``; refusals are one line (exit 2)."""
    import json

    from moe_offload.cli import main
    from moe_offload.core import disk_link

    d = str(tiny_dirs["qwen3_moe"])
    args = ["generate", "--model", d, "--prompt", PROMPT, "--max-new-tokens", str(NEW), "--quiet"]
    assert main(args + ["--host-store", "disk", "--memory-budget", "0.0016", "--max-context", "64", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    st = out["stats"]
    assert out["outputs"][0]["token_ids"] == refs["qwen3_moe"]
    assert st["host_store"] == "disk" and st["host_store_bytes"] == 0
    assert st["memory_plan"]["budget_bytes"] == 1_600_000 and st["memory_plan"]["total_bytes"] <= 1_600_000
    assert st["slots"] == st["memory_plan"]["slots"] < st["routed_experts"] and st["misses"] > 0
    assert st["disk"]["experts"] == st["misses"] and st["disk"]["direct_io"]

    def one_line(argv, needle):
        try:
            code = main(argv)
        except SystemExit as e:  # argparse's own one-line errors
            code = e.code
        assert code == 2
        lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
        assert len(lines) == 1 and needle in lines[0], lines

    one_line(args + ["--host-store", "disk", "--link-gbps", "5", "--residency", "0.5"],
             "with --host-store disk the link is the disk itself")
    one_line(args + ["--memory-budget", "0.001"], "--memory-budget 0.001 GB is too small")
    one_line(args + ["--memory-budget", "inf"], "expected a finite number")
    one_line(args + ["--memory-budget", "0.5", "--full-load"], "--full-load has none")
    one_line(args + ["--memory-budget", "0.5", "--graph"], "not --memory-budget")
    one_line(args + ["--host-store", "disk", "--graph"], "with --host-store pinned (not disk)")
    one_line(args + ["--host-store", "disk", "--full-load"], "--full-load keeps every weight in memory")
    one_line(["trace", "collect", "--model", str(tiny_dirs["llada2_moe"]), "--prompt", "hi", "--host-store", "disk",
              "--out", str(tmp_path / "d.trace"), "--quiet"], "--host-store, --host-cache and --residency do not apply")
    out = tmp_path / "t.trace"  # a routing trace recorded from disk with a small pool: the same routing
    assert main(["trace", "collect", "--model", d, "--prompt", PROMPT, "--max-new-tokens", "4", "--host-store", "disk",
                 "--residency", "0.3", "--out", str(out), "--quiet"]) == 0 and out.is_file()
    capsys.readouterr()
    sim = ["simulate", "--trace", str(out), "--residency", "0.5", "--policy", "lru", "--link", "disk",
           "--model-profile", "qwen3-30b-a3b-fp8"]
    one_line(sim + ["--hardware", "h200", "--out", str(tmp_path / "s1")], "hardware profile h200 has no disk entry")
    assert main(sim + ["--hardware", "rtx4090", "--out", str(tmp_path / "s2")]) == 0
    assert "link: disk (PCIe 4.0 x4 NVMe SSD (Samsung 990 PRO)), 4.50 MiB reads at 7.45 GB/s" in capsys.readouterr().out
    monkeypatch.setattr(disk_link, "this_machine_disk", lambda: None)
    one_line(["bench", "decode", "--model", d, "--host-store", "disk", "--residencies", "0.5", "--quiet",
              "--max-new-tokens", "2", "--prompt", "hi"], "run `moe-offload bench link --disk DIR` first")


def test_a_disk_store_shortens_the_interpreters_switch_interval(tiny_dirs, monkeypatch):
    """Its reader threads get the interpreter lock between requests within 0.5 ms (``common.threads``); a shorter
    interval the user set is kept."""
    import sys

    from moe_offload.common.threads import IO_SWITCH_INTERVAL_S, short_switch_interval

    monkeypatch.setattr(sys, "getswitchinterval", lambda: 0.005)
    got = []
    monkeypatch.setattr(sys, "setswitchinterval", got.append)
    lm = load_offloaded(tiny_dirs["qwen3_moe"], device="cpu", residency=0.5, progress=False, host_store="disk")
    lm.close()
    assert got and got[0] == IO_SWITCH_INTERVAL_S
    monkeypatch.setattr(sys, "getswitchinterval", lambda: 1e-4)
    got.clear()
    short_switch_interval()
    assert got == []
