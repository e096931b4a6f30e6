"""``--threads`` on every computing command, and ``bench peers`` (issue 46): the cells run, the table is right."""

import json

import pytest
import torch

from moe_offload.bench.peers import FULL, FULL_GRAPH, HF, OFFLOADED, OFFLOADED_GRAPH, PeerBench, markdown
from moe_offload.cli import main


@pytest.mark.parametrize("threads", [1, 2])
def test_generate_runs_on_the_threads_asked_and_gives_them_back(tiny_dirs, capsys, threads):
    before = torch.get_num_threads()
    assert main(["generate", "--model", str(tiny_dirs["qwen3_moe"]), "--prompt", "hi", "--max-new-tokens", "3",
                 "--full-load", "--json", "--quiet", "--threads", str(threads)]) == 0
    assert json.loads(capsys.readouterr().out)["stats"]["threads"] == threads
    assert torch.get_num_threads() == before


@pytest.mark.parametrize("cmd", [["generate"], ["serve"], ["bench", "decode"], ["bench", "graph"], ["trace", "collect"]])
def test_threads_is_an_option_of_every_computing_command(cmd, capsys):
    with pytest.raises(SystemExit) as e:
        main(cmd + ["--help"])
    assert e.value.code == 0 and "--threads" in capsys.readouterr().out


def test_threads_must_be_positive(capsys):
    with pytest.raises(SystemExit) as e:
        main(["generate", "--threads", "0"])
    assert e.value.code == 2 and "--threads" in capsys.readouterr().err


def test_bench_peers_on_a_tiny_checkpoint(tiny_dirs, tmp_path, capsys):
    out = tmp_path / "peers.md"
    assert main(["bench", "peers", "--model", str(tiny_dirs["qwen3_moe"]), "--threads", "1", "--repeats", "1",
                 "--max-new-tokens", "4", "--prompt", "Hello there", "--out", str(out), "--quiet"]) == 0
    table = capsys.readouterr().out
    assert out.read_text().strip() == table.strip()
    rows = {line.split("|")[1].strip(): line.split("|") for line in table.splitlines() if line.startswith("| ours")
            or line.startswith("| transformers")}
    assert set(rows) == {FULL, OFFLOADED, HF}
    assert rows[FULL][6].strip() == "reference" and rows[OFFLOADED][6].strip() == "same (4)"  # lossless at 1.0
    assert rows[FULL][4].strip() == "1.00x"
    assert main(["bench", "peers", "--model", str(tiny_dirs["qwen3_moe"]), "--out", str(out)]) == 2  # not overwritten
    assert main(["bench", "peers", "--model", str(tiny_dirs["qwen3_moe"]), "--threads", "0,x"]) == 2


def test_peers_table_by_hand(tmp_path):
    bench = PeerBench(tmp_path / "m", "p", threads=(1, 2), repeats=2, transformers=True)
    result = {"cells": {(FULL, 1): [10.0, 12.0], (FULL, 2): [20.0, 22.0], (OFFLOADED, 1): [10.0, 11.0],
                        (OFFLOADED, 2): [21.0, 21.0], (HF, 1): [5.0, 6.0], (HF, 2): [8.0, 8.0]},
              "tokens": {(FULL, 1): [1, 2, 3], (OFFLOADED, 1): [1, 2, 3], (HF, 1): [1, 2, 4],
                         (FULL, 2): [1, 2, 3], (OFFLOADED, 2): [1, 2, 3], (HF, 2): [1, 2, 3]}}
    lines = {(r.split("|")[1].strip(), r.split("|")[2].strip()): [c.strip() for c in r.split("|")[3:7]]
             for r in markdown(bench, result).splitlines() if r.startswith("| ours") or r.startswith("| trans")}
    assert lines[(FULL, "1")] == ["11.00 [10.0, 12.0]", "1.00x", "1.91x", "reference"]  # 21 / 11
    assert lines[(HF, "1")] == ["5.50 [5.0, 6.0]", "2.00x", "1.45x", "differ from token 2"]  # 11 / 5.5; 8 / 5.5
    assert lines[(OFFLOADED, "2")] == ["21.00 [21.0, 21.0]", "1.00x", "2.00x", "same (3)"]  # 21 / 21; 21 / 10.5


def test_peers_compiled_rows_by_hand(tmp_path):
    """With ``graph``: the compiled rows, a column of compiled FullLoad over each engine, and the compiled offloaded
    row's tokens compared with the compiled FullLoad's (not the eager one's)."""
    bench = PeerBench(tmp_path / "m", "p", threads=(1,), repeats=1, transformers=False, graph=True)
    assert bench.engines() == [FULL, OFFLOADED, FULL_GRAPH, OFFLOADED_GRAPH]
    assert "--graph" in bench.command(FULL_GRAPH, 1) and "--full-load" in bench.command(FULL_GRAPH, 1)
    assert bench.command(OFFLOADED_GRAPH, 1).count("--prompt") == 2  # the first request compiles, the second is timed
    result = {"cells": {(FULL, 1): [10.0], (OFFLOADED, 1): [10.0], (FULL_GRAPH, 1): [15.0],
                        (OFFLOADED_GRAPH, 1): [12.0]},
              "tokens": {(FULL, 1): [1, 2, 3], (OFFLOADED, 1): [1, 2, 3], (FULL_GRAPH, 1): [1, 2, 4],
                         (OFFLOADED_GRAPH, 1): [1, 2, 4]}}
    lines = {r.split("|")[1].strip(): [c.strip() for c in r.split("|")[3:8]]
             for r in markdown(bench, result).splitlines() if r.startswith("| ours")}
    assert lines[FULL_GRAPH] == ["15.00 [15.0]", "0.67x", "1.00x", "-", "reference (compiled)"]
    assert lines[OFFLOADED_GRAPH] == ["12.00 [12.0]", "0.83x", "1.25x", "-", "same (3)"]


def test_compute_threads_partitions_the_cores(tiny_dirs, capsys):
    """``--compute-threads N`` (issue 47): the compute on the first N cores with N intra-op threads, the expert
    readers on the rest; FullLoad's tokens from disk; the process's cores and threads given back to the caller."""
    import os
    import threading

    from moe_offload.common import threads as th

    assert th.partition_cores(1, [0, 1]) == ({0}, {1}) and th.partition_cores(2, [0, 1]) == ({0, 1}, {0, 1})
    for bad in (0, -1, 3):
        with pytest.raises(Exception, match="between 1 and the 2 cores"):
            th.partition_cores(bad, [0, 1])
    cpus, before = os.sched_getaffinity(0), torch.get_num_threads()
    path = str(tiny_dirs["qwen3_moe"])
    common = ["generate", "--model", path, "--prompt", "hello there", "--max-new-tokens", "6", "--json", "--quiet"]
    assert main(common + ["--full-load"]) == 0
    ref = json.loads(capsys.readouterr().out)["outputs"][0]["token_ids"]
    assert main(common + ["--residency", "0.3", "--host-store", "disk", "--compute-threads", "1"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["outputs"][0]["token_ids"] == ref and got["stats"]["threads"] == 1
    assert os.sched_getaffinity(0) == cpus and torch.get_num_threads() == before and "io" not in th._IO_CPUS
    if len(cpus) >= 2:  # a reader started under the partition runs on the I/O cores only
        th.set_compute_threads(1)
        seen = []
        try:
            t = threading.Thread(target=lambda: (th.pin_io_thread(), seen.append(os.sched_getaffinity(0))))
            t.start()
            t.join()
            assert seen == [set(sorted(cpus)[1:])] and os.sched_getaffinity(0) == {min(cpus)}
        finally:
            th.undo_partition(cpus)
            torch.set_num_threads(before)


@pytest.mark.parametrize("args, message", [(["--compute-threads", "0"], "--compute-threads"),
                                           (["--compute-threads", "-1"], "--compute-threads"),
                                           (["--compute-threads", "999"], "between 1 and the"),
                                           (["--compute-threads", "1", "--threads", "1"], "not both")])
def test_compute_threads_bad_input_is_one_line(tiny_dirs, capsys, args, message):
    import os

    cpus = os.sched_getaffinity(0)
    try:
        code = main(["generate", "--model", str(tiny_dirs["qwen3_moe"]), "--prompt", "hi", "--quiet"] + args)
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err.strip()
    assert code == 2 and message in err and "Traceback" not in err and len(err.splitlines()) <= 3
    assert os.sched_getaffinity(0) == cpus


def test_io_priority_realtime(tiny_dirs, capsys):
    """``--io-priority realtime`` (issue 47): the expert readers run under the real-time scheduler, FullLoad's tokens
    from disk, the setting given back to the caller; a reader started under it is SCHED_FIFO, a polling worker
    (``realtime=False``) is not. Where the process may not use the scheduler it is a one-line error."""
    import os
    import threading

    from moe_offload.common import threads as th

    path = str(tiny_dirs["qwen3_moe"])
    common = ["generate", "--model", path, "--prompt", "hello there", "--max-new-tokens", "6", "--json", "--quiet"]
    assert main(common + ["--full-load"]) == 0
    ref = json.loads(capsys.readouterr().out)["outputs"][0]["token_ids"]
    code = main(common + ["--residency", "0.3", "--host-store", "disk", "--io-priority", "realtime"])
    out, err = capsys.readouterr()
    if code == 2:  # no CAP_SYS_NICE here: refused in one line
        assert "may not use the real-time scheduler" in err and len(err.strip().splitlines()) == 1
        return
    got = json.loads(out)
    assert code == 0 and got["outputs"][0]["token_ids"] == ref and got["stats"]["io_priority"] == "realtime"
    assert "priority" not in th._IO_CPUS and th.io_priority() == "normal"
    th.set_io_priority("realtime")
    seen = []
    try:
        for rt in (True, False):
            t = threading.Thread(target=lambda rt=rt: (th.pin_io_thread(realtime=rt),
                                                       seen.append((os.sched_getscheduler(0), th.io_thread_realtime()))))
            t.start()
            t.join()
        assert seen == [(os.SCHED_FIFO, True), (os.SCHED_OTHER, False)]
        assert os.sched_getscheduler(0) == os.SCHED_OTHER  # the calling thread itself is left as it was
    finally:
        th.undo_partition(os.sched_getaffinity(0))
    with pytest.raises(Exception, match="--io-priority must be one of normal, realtime"):
        th.set_io_priority("high")
