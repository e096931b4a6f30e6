"""``bench disk`` (issue 36): llama.cpp's timing lines parsed, the table, and a whole run of our rows on a tiny
checkpoint in child memory cgroups (skipped where none can be made)."""

from __future__ import annotations

import json
import os
import sys

import pytest

from moe_offload.bench import disk as bench_disk
from moe_offload.bench import disk_report
from moe_offload.errors import MoeOffloadError
from moe_offload.runtime.host_memory import child_cgroup_problem

LLAMA_STDERR = """\
common_perf_print:    sampling time =      10.21 ms
common_perf_print:        load time =     812.33 ms
common_perf_print: prompt eval time =     401.00 ms /    37 tokens (   10.84 ms per token,    92.27 tokens per second)
common_perf_print:        eval time =    2540.00 ms /   127 runs   (   20.00 ms per token,    50.00 tokens per second)
common_perf_print:       total time =    3100.00 ms /   164 tokens
"""


def test_parse_llama_decode_takes_eval_not_prompt_eval():
    assert bench_disk.parse_llama_decode(LLAMA_STDERR) == (pytest.approx(50.0), 127)
    assert bench_disk.parse_llama_decode("no timings here") is None


def test_expert_bytes_of_checkpoint(tiny_dirs):
    """Mixtral tiny: every expert's w1, w2, w3 counted, one entry per (layer, expert)."""
    from safetensors import safe_open

    d = tiny_dirs["mixtral"]
    cfg = json.loads((d / "config.json").read_text())
    n_experts = cfg["num_hidden_layers"] * cfg["num_local_experts"]
    nbytes, count = bench_disk.expert_bytes_of_checkpoint(d)
    assert count == n_experts
    ranges = bench_disk.checkpoint_expert_ranges(d)  # where those bytes are: 3 tensors per expert
    assert sum(n for rs in ranges.values() for _, n in rs) == nbytes
    assert sum(len(rs) for rs in ranges.values()) == 3 * n_experts
    want = 0
    for p in d.glob("*.safetensors"):
        with safe_open(p, "pt") as f:
            want += sum(f.get_tensor(k).nbytes for k in f.keys() if ".experts." in k)
    assert nbytes == want


def test_markdown_and_files(tmp_path):
    cells = [bench_disk.Cell("FullLoad (ours, in memory)", None, None, decode_tok_s=10.0, vs_own_unlimited=1.0),
             bench_disk.Cell("disk lru (ours)", 0.25, 2_000_000_000, decode_tok_s=6.0, vs_own_unlimited=0.6,
                             hit_rate=0.7, mb_read_per_token=30.0, read_gbps=0.2, physical_limit_tok_s=10.0,
                             tokens_equal_full_load=True, slot_bytes=1_000_000_000, page_cached_expert_bytes=0),
             bench_disk.Cell("mmap (ours, half the share in slots)", 0.45, 2_000_000_000, decode_tok_s=1.0,
                             slot_bytes=900_000_000, page_cached_expert_bytes=1_500_000_000),
             bench_disk.Cell("llama.cpp (mmap)", 0.25, None, status="not installed"),
             bench_disk.Cell("mmap (ours, half the share in slots)", 0.25, 2_000_000_000,
                             status="timeout: not done in 900 s", mb_read_per_token_at_least=412.5)]
    from dataclasses import asdict

    result = {"cells": [asdict(c) for c in cells], "baselines": {"ours": 1e9, "llama.cpp": None},
              "expert_bytes": 4e9, "gguf_expert_bytes": None, "max_new_tokens": 8, "reverse": False}
    md = disk_report.markdown(result)
    assert "| disk lru (ours) | 25% | 25% | 2.00 | 6.00 | 0.600 | 0.700 | 30.0 | 0.200 | 10.00 | yes | ok |" in md
    assert "| mmap (ours, half the share in slots) | 45% | 60% | 2.00 | 1.00 |" in md  # slots + page cache held
    assert "| llama.cpp (mmap) | 25% |  | none |" in md and "not installed" in md
    assert "| mmap (ours, half the share in slots) | 25% |  | 2.00 |  |  |  | >= 412.5 |" in md  # a lower bound
    files = disk_report.write_results(result, tmp_path / "out")
    assert all(f.is_file() and f.stat().st_size > 0 for f in files)
    with pytest.raises(MoeOffloadError, match="already exists"):
        disk_report.write_results(result, tmp_path / "out")


@pytest.mark.skipif(child_cgroup_problem() is not None, reason=f"no child memory cgroup: {child_cgroup_problem()}")
def test_our_rows_run_in_cgroups_with_full_load_tokens(tiny_dirs, tmp_path):
    """The tiny Mixtral, one limit (50% + 64 MiB of headroom: its experts are a few MB, less than the spread of the
    interpreter's own peak), the lru disk row and the mmap row: both finish under their limits with FullLoad's
    tokens; llama.cpp's row says not installed."""
    bench = bench_disk.DiskBench(tiny_dirs["mixtral"], None, None, "Streaming experts from disk.",
                                 max_new_tokens=6, policies=("lru",), fractions=(0.5,), timeout_s=300,
                                 headroom_bytes=64 << 20)
    result = bench_disk.run_bench(bench, say=lambda m: None)
    n_ranges = sum(len(rs) for rs in bench_disk.checkpoint_expert_ranges(tiny_dirs["mixtral"]).values())
    rows = {c["row"]: c for c in result["cells"]}
    assert set(rows) == {"FullLoad (ours, in memory)", "disk lru (ours)", "mmap (ours, half the share in slots)",
                         "llama.cpp (mmap)"}
    for name in ("disk lru (ours)", "mmap (ours, half the share in slots)"):
        c = rows[name]
        assert c["status"] == "ok" and c["tokens_equal_full_load"] is True, c
        base = result["baselines"]["ours mmap" if name.startswith("mmap") else "ours"]
        assert c["limit_bytes"] == int(base + 0.5 * result["expert_bytes"] + (64 << 20))
        assert c["peak_bytes"] <= c["limit_bytes"]
        assert c["cached_before_bytes"] == 0  # the checkpoint was out of the page cache when the row started
        # what the kernel cached of the experts when it ended: counted in whole pages (2 at most per tensor extra)
        assert 0 <= c["page_cached_expert_bytes"] <= result["expert_bytes"] + 2 * 4096 * n_ranges
    assert rows["llama.cpp (mmap)"]["status"] == "not installed"
    # each configuration its own baseline (the mmap mode: less the expert pages it left in the page cache)
    assert result["baselines"]["ours mmap"] > 0


def test_cli_refusals(tmp_path, capsys):
    from moe_offload.cli import main

    (tmp_path / "exists").mkdir()
    assert main(["bench", "disk", "--out", str(tmp_path / "exists")]) == 2
    assert "already exists" in capsys.readouterr().err
    assert main(["bench", "disk", "--out", str(tmp_path / "n"), "--fractions", "0.5,1.5"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and ("--fractions" in err or "cgroup" in err)
    assert main(["bench", "disk", "--out", str(tmp_path / "n"), "--policies", "lru,seqmoe"]) == 2
    err = capsys.readouterr().err
    assert "--predictor" in err or "cgroup" in err
    assert sys.executable  # the rows run `python -m moe_offload.cli` with this interpreter


@pytest.mark.skipif(child_cgroup_problem() is not None, reason=f"no child memory cgroup: {child_cgroup_problem()}")
def test_peak_beside_a_files_page_cache(tmp_path):
    """A run that reads a 64 MiB file through the page cache, then holds 32 MiB of its own: the cgroup's peak counts
    both, the peak beside that file's cache only the run's own memory."""
    from moe_offload.bench.disk_measure import drop_files, run_limited

    f = tmp_path / "weights.bin"
    f.write_bytes(os.urandom(64 << 20))
    drop_files([f])
    code = (f"import time; open({str(f)!r}, 'rb').read(); x = bytearray(32 << 20); x[::4096] = b'1' * (8 << 10); "
            "time.sleep(0.5)")
    r = run_limited([sys.executable, "-c", code], None, 60, beside=[f])
    assert r["rc"] == 0, r["stderr"]
    assert r["peak_bytes"] >= (64 + 32) << 20
    assert (32 << 20) <= r["peak_beside_bytes"] <= r["peak_bytes"] - (48 << 20)
    assert run_limited([sys.executable, "-c", "pass"], None, 60)["peak_beside_bytes"] is None
