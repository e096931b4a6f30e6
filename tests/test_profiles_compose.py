"""Hardware profiles that compose (issue 48 part 3): `bench link --disk` and `bench link` each merge their own
section into the this-machine profile, a command that does not need a section never reads it, and one that does
gets one line naming the command that measures it."""

from __future__ import annotations

import json

import pytest

from moe_offload.cli.entry import main
from moe_offload.core import profiles
from moe_offload.core.disk_link import save_disk, this_machine_disk
from moe_offload.errors import MoeOffloadError
from moe_offload.trace.synthetic import synthetic_trace


def _trace(tmp_path) -> str:
    tr = synthetic_trace(30, 32, 8, steps=5, requests=2, prompt_tokens=3, seed=1)
    tr.header["synthetic"] = False
    tr.header["model_id"] = "mixtral-0123456789ab"
    return str(tr.save(tmp_path / "t.trace"))


def test_a_disk_measurement_alone_breaks_no_other_command(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MOE_OFFLOAD_CACHE", str(tmp_path / "cache"))
    t = _trace(tmp_path)
    save_disk({"time": "2026-12-05T00:00:00", "directory": str(tmp_path), "table_gbps": {"262144": {"1": 1.2}}})
    assert not profiles.this_machine_has_link()
    with pytest.raises(MoeOffloadError, match=r"no host->device link measurement \(it has: disk\): run "
                                              r"`moe-offload bench link` first") as e:
        profiles.load_hardware("this-machine")
    assert "\n" not in str(e.value)
    assert main(["simulate", "--trace", t, "--residency", "0.25", "--policy", "lru", "--out", str(tmp_path / "a")]) == 0
    assert "hardware rtx4090 (default; `moe-offload bench link` would measure" in capsys.readouterr().out
    # asked for by name: one line, exit 2, the command that measures it
    assert main(["simulate", "--trace", t, "--residency", "0.25", "--policy", "lru", "--hardware", "this-machine",
                 "--out", str(tmp_path / "b")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "run `moe-offload bench link` first" in err
    # the link measured: both sections kept, this machine used
    from moe_offload.bench.link import measure_link

    measure_link(device="cpu", size_mb=4, repeats=1)
    saved = json.loads(profiles.this_machine_path().read_text())
    assert saved["disk"]["table_gbps"] == {"262144": {"1": 1.2}} and "disk" in saved["sources"]
    assert profiles.this_machine_has_link() and profiles.load_hardware("this-machine").link_gbps > 0
    assert main(["simulate", "--trace", t, "--residency", "0.25", "--policy", "lru", "--full-load-tok-s", "20",
                 "--out", str(tmp_path / "c")]) == 0
    assert "hardware this-machine" in capsys.readouterr().out.splitlines()[0]
    # the disk measured again: the link's section kept
    save_disk({"time": "2026-12-05T01:00:00", "directory": str(tmp_path), "table_gbps": {"262144": {"1": 1.3}}})
    assert profiles.this_machine_has_link() and this_machine_disk()["table_gbps"] == {"262144": {"1": 1.3}}
    assert "link_gbps" in json.loads(profiles.this_machine_path().read_text())["sources"]


def test_the_measurements_in_any_order_on_a_fresh_cache(tiny_dirs, tmp_path, monkeypatch, capsys):
    """Issue 48's sequence on a fresh cache: `bench link --disk`, `simulate`, `bench decode --host-store disk`,
    `bench link`, `simulate` all succeed, and the profile ends with both sections."""
    monkeypatch.setenv("MOE_OFFLOAD_CACHE", str(tmp_path / "cache"))
    t = _trace(tmp_path)
    sim = ["simulate", "--trace", t, "--residency", "0.25", "--policy", "lru"]
    assert main(["bench", "link", "--disk", str(tmp_path), "--file-mb", "64"]) == 0
    assert main(sim + ["--out", str(tmp_path / "s1")]) == 0
    assert main(["bench", "decode", "--model", str(tiny_dirs["mixtral"]), "--host-store", "disk", "--residencies",
                 "0.5", "--max-new-tokens", "2", "--prompt", "hi", "--quiet", "--out", str(tmp_path / "d.md")]) == 0
    assert main(["bench", "link", "--device", "cpu", "--size-mb", "4"]) == 0
    assert main(sim + ["--full-load-tok-s", "20", "--out", str(tmp_path / "s2")]) == 0
    out = capsys.readouterr().out
    assert "hardware this-machine" in out
    saved = json.loads(profiles.this_machine_path().read_text())
    assert "disk" in saved and saved["link_gbps"] > 0
