"""First use of the built-in models (issue 15): only the asked-for testbed is built, once even when several processes
ask at the same time (the others wait and say so), stale temporary build folders are removed, a first line says
what is built and about how long it takes, and every long phase shows progress. The builders are replaced by fakes
here (the real build is covered by test_testbed.py)."""

import argparse
import json
import threading
import time

import pytest
import torch
from filelock import FileLock

from moe_offload.common import cache, progress, threads
from moe_offload.models import tiny
from moe_offload.testbed import build, llada2_medium


def _fake_builder(calls: list):
    def fake(out, top_k=24, eval_tokens=None, progress=True, **kw):
        calls.append((top_k, eval_tokens))
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.json").write_text("{}")
        ppl = {"dense": 5.0, "moe": 9.0} if eval_tokens else None
        (out / "testbed.json").write_text(json.dumps({"top_k": top_k, "perplexity": ppl}))
        return out
    return fake


@pytest.fixture
def fake_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("MOE_OFFLOAD_CACHE", str(tmp_path))
    monkeypatch.setattr(progress, "_slowdown", 1.0)  # no probe: the estimate is the reference timing
    calls: list = []
    monkeypatch.setattr(build, "build_testbed", _fake_builder(calls))
    return tmp_path, calls


def test_first_use_builds_only_the_asked_variant_without_evaluation(fake_cache, capsys):
    root, calls = fake_cache
    assert build.ensure_testbed("testbed-sparse", progress=False) == root / "testbed-sparse"
    assert calls == [(8, 0)]  # top-8 only, held-out evaluation skipped
    assert not (root / "testbed").exists()
    err = capsys.readouterr().err
    first = [ln for ln in err.splitlines() if "first use of testbed-sparse" in ln]
    expected = progress.fmt_duration(sum(build.estimate_seconds().values()))
    assert len(first) == 1 and f"about {expected} on this machine" in first[0]
    assert str(root / "testbed-sparse") in first[0]
    assert build.ensure_testbed("testbed-sparse") == root / "testbed-sparse"  # cached: no second build, no line
    assert calls == [(8, 0)] and "first use" not in capsys.readouterr().err


def test_concurrent_first_uses_build_once_and_the_second_waits(tmp_path):
    started, release = threading.Event(), threading.Event()
    built, logs, results = [], {"a": [], "b": []}, {}

    def is_built(p):
        return (p / "done").is_file()

    def builder(who):
        def b(tmp):
            built.append(who)
            started.set()
            assert release.wait(30)
            (tmp / "done").write_text(who)
        return b

    def run(who):
        results[who] = cache.build_once("entry", is_built, builder(who), what="the entry", cache=tmp_path,
                                        log=logs[who].append)

    ta = threading.Thread(target=run, args=("a",))
    ta.start()
    assert started.wait(30)
    tb = threading.Thread(target=run, args=("b",))
    tb.start()
    t0 = time.monotonic()
    while not logs["b"] and time.monotonic() - t0 < 30:
        time.sleep(0.01)
    assert logs["b"] and "another moe-offload process is building the entry; waiting" in logs["b"][0]
    release.set()
    ta.join(30)
    tb.join(30)
    assert built == ["a"]  # built once
    assert results["a"] == results["b"] == tmp_path / "entry"
    assert (tmp_path / "entry" / "done").read_text() == "a"
    assert "the entry is ready" in logs["b"][-1]
    assert not list(tmp_path.glob(".entry.*.tmp"))


_OTHER_PROCESS = """
import sys, time
from pathlib import Path
from moe_offload.common import cache
root = Path(sys.argv[1])
def build(tmp):
    (root / "started").write_text("1")
    while not (root / "release").exists():
        time.sleep(0.01)
    (tmp / "done").write_text("other process")
cache.build_once("entry", lambda p: (p / "done").is_file(), build, what="the entry", cache=root / "cache")
"""


def test_a_first_use_in_another_process_is_waited_for(tmp_path):
    import os
    import subprocess
    import sys
    from pathlib import Path

    src = str(Path(__file__).resolve().parents[1] / "src")
    env = dict(os.environ, PYTHONPATH=src + os.pathsep + os.environ.get("PYTHONPATH", ""))
    other = subprocess.Popen([sys.executable, "-c", _OTHER_PROCESS, str(tmp_path)], env=env)
    try:
        t0 = time.monotonic()
        while not (tmp_path / "started").exists():
            assert other.poll() is None and time.monotonic() - t0 < 60
            time.sleep(0.01)
        logs, result = [], {}

        def mine():
            result["path"] = cache.build_once("entry", lambda p: (p / "done").is_file(),
                                              lambda tmp: pytest.fail("built twice"), what="the entry",
                                              cache=tmp_path / "cache", log=logs.append)

        th = threading.Thread(target=mine)
        th.start()
        while not logs and time.monotonic() - t0 < 60:
            time.sleep(0.01)
        (tmp_path / "release").write_text("1")
        th.join(60)
        assert other.wait(60) == 0
    finally:
        if other.poll() is None:
            other.kill()
    assert "another moe-offload process is building the entry; waiting" in logs[0]
    assert result["path"] == tmp_path / "cache" / "entry"
    assert (result["path"] / "done").read_text() == "other process"


def test_stale_temporary_folders_are_removed_unless_their_build_runs(tmp_path):
    stale = tmp_path / ".testbed.k1ll3d.tmp"
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"half")
    running = tmp_path / ".testbed-sparse.ab_c12.tmp"
    running.mkdir()
    other = tmp_path / "not-a-temp"
    other.mkdir()
    lock = FileLock(tmp_path / ".testbed-sparse.lock")
    lock.acquire()  # another process is building testbed-sparse
    try:
        removed = cache.remove_stale_temps(tmp_path)
    finally:
        lock.release()
    assert removed == [stale] and not stale.exists() and running.exists() and other.exists()
    assert cache.remove_stale_temps(tmp_path) == [running]  # its build is over (lock free)


def test_testbed_build_command_evaluates_in_the_same_build_or_afterwards(fake_cache, monkeypatch, capsys):
    from moe_offload.cli import main

    root, calls = fake_cache
    evaluated = []
    monkeypatch.setattr(build, "evaluate_testbed", lambda path, progress=True, eval_tokens=0: evaluated.append(path))
    assert main(["testbed", "build", "--quiet"]) == 0  # not built yet: one build with the evaluation
    assert calls == [(24, build.EVAL_TOKENS)] and evaluated == []
    assert main(["testbed", "build", "--sparse", "--no-eval", "--quiet"]) == 0
    assert calls[-1] == (8, 0)
    assert main(["testbed", "build", "--sparse", "--quiet"]) == 0  # built on first use without: evaluate it now
    assert len(calls) == 2 and evaluated == [root / "testbed-sparse"]
    assert capsys.readouterr().out.splitlines()[-1] == f"testbed-sparse checkpoint: {root / 'testbed-sparse'}"


def test_a_killed_builds_leftovers_go_when_the_entry_is_built(fake_cache):
    root, calls = fake_cache
    left = root / ".testbed.zz9x_y.tmp"
    left.mkdir()
    build.ensure_testbed("testbed", progress=False)
    assert not left.exists() and calls == [(24, 0)]
    assert [p.name for p in root.iterdir() if p.name.endswith(".tmp")] == []


def test_estimates_scale_with_the_machine():
    ref = build.estimate_seconds()
    assert set(ref) == {"load", "layers", "write"}
    assert ref["layers"] == 30 * build.REFERENCE_S["layer"]
    slow = build.estimate_seconds(scale=2.5, eval_tokens=16384)
    assert slow["eval"] == pytest.approx(2.5 * build.REFERENCE_S["eval_per_1k"] * 16.384)
    assert slow["load"] == pytest.approx(2.5 * ref["load"])
    assert build.estimate_seconds(num_layers=2, load=False) == {"layers": 2 * build.REFERENCE_S["layer"],
                                                                 "write": build.REFERENCE_S["write"]}
    assert [progress.fmt_duration(s) for s in (3, 42, 100, 150, 900)] == ["3 s", "40 s", "1.7 min", "2.5 min",
                                                                           "15 min"]


def test_every_long_phase_gets_a_line_and_a_bar(capsys):
    ph = progress.Phases(3)
    with ph.phase("short one", 0.5):
        pass
    with ph.phase("counted", 30, total=4, unit="layer") as update:
        for _ in range(4):
            update(1)
    with ph.phase("one long call", 12):
        pass
    err = capsys.readouterr().err
    assert "moe-offload: [1/3] short one (about 1 s)" in err
    assert "moe-offload: [2/3] counted (about 30 s)" in err and "4/4" in err
    assert "moe-offload: [3/3] one long call (about 10 s)" in err and "100%" in err and "expected ~12 s" in err
    quiet = progress.Phases(1, enabled=False)
    with quiet.phase("nothing", 100, total=2) as update:
        update(2)
    assert capsys.readouterr().err == ""


def test_more_threads_only_when_clearly_faster():
    assert threads.choose_threads({1: [1.0, 1.0, 1.0], 2: [0.9, 0.85, 0.95]}) == 1  # within the margin: 1
    assert threads.choose_threads({1: [1.0, 1.1, 0.9], 2: [0.5, 0.6, 3.0]}) == 2  # median 0.6 < 0.8
    assert threads.choose_threads({1: [0.04] * 3, 2: [0.16] * 3}) == 1  # the busy-core case measured here
    assert threads.choose_threads({1: [1.0], 2: [0.7], 4: [0.6]}) == 2  # 0.6 is not below 0.8 * 0.7


def test_best_thread_count_is_a_candidate_and_restores_the_setting():
    before = torch.get_num_threads()
    n = threads.best_num_threads([1, max(1, before)], rounds=1)
    assert n in (1, before) and torch.get_num_threads() == before
    with threads.build_threads() as used:
        assert torch.get_num_threads() == used
    assert torch.get_num_threads() == before


def test_llada2_medium_first_use_announces_and_builds_once(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("MOE_OFFLOAD_CACHE", str(tmp_path))
    monkeypatch.setattr(progress, "_slowdown", 1.0)
    calls = []

    def fake(out, texts, overwrite=False, on_pass=None, **kw):
        calls.append(len(texts))
        (out / "config.json").write_text("{}")
        for _ in range(tiny.BALANCE_PASSES):
            on_pass(1)
        return out, [1.0]

    monkeypatch.setattr(tiny, "make_llada2_medium", fake)
    path = llada2_medium.ensure_llada2_medium(progress=True)
    assert path == tmp_path / "llada2-medium" and (path / "balance.json").is_file() and calls == [32]
    err = capsys.readouterr().err
    assert err.count("first use of llada2-medium") == 1
    assert f"about {progress.fmt_duration(llada2_medium.LLADA2_MEDIUM_REFERENCE_S)} on this machine" in err
    assert "[1/1] balancing the routers" in err and f"{tiny.BALANCE_PASSES}/{tiny.BALANCE_PASSES}" in err
    assert llada2_medium.ensure_llada2_medium() == path and calls == [32]


def test_commands_keep_the_default_threads_unless_one_is_clearly_faster(monkeypatch, capsys):
    """generate / serve from the shell (common.threads.command_threads): the default count unless one thread's probe
    is below MARGIN of it (a core held by another process: 0.46-0.82 vs 12.7-13.2 tok/s measured here); the user's
    OMP_NUM_THREADS is kept; the choice is said on stderr and shown in the stats."""
    assert threads.choose_threads({1: [1.0] * 3, 2: [0.9] * 3}, prefer_most=True) == 2
    assert threads.choose_threads({1: [1.0] * 3, 2: [0.95, 1.2, 1.4]}, prefer_most=True) == 2  # 1.0 !< 0.8 * 1.2
    assert threads.choose_threads({1: [0.04] * 3, 2: [0.9] * 3}, prefer_most=True) == 1  # the busy-core case
    assert threads.command_threads({"OMP_NUM_THREADS": "2"}) is None
    from moe_offload.cli import entry as cli

    before = torch.get_num_threads()
    monkeypatch.setattr(threads, "command_threads", lambda: (1, 2))
    try:
        cli._command_threads(argparse.Namespace(quiet=False))
        assert torch.get_num_threads() == 1
        assert "1 intra-op thread instead of 2" in capsys.readouterr().err
    finally:
        torch.set_num_threads(before)
