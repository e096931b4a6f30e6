"""Simulator models: hardware/model profiles, the on-demand time model, synthetic traces, reports, replay speed."""

import json

import numpy as np
import pytest

from moe_offload.errors import MoeOffloadError
from moe_offload.core import profiles
from moe_offload.core.profiles import HardwareProfile, ModelProfile
from moe_offload.core.replay import StepCounts
from moe_offload.sim.simulator import replay
from moe_offload.sim.timemodel import OnDemandTimeModel, calibration_check
from moe_offload.trace.format import load_trace
from moe_offload.trace.synthetic import synthetic_trace

SHIPPED_HW = {"rtx4090", "rtx5090", "rtx-pro-6000", "h200", "apple-m4-max"}
SHIPPED_MODELS = {"qwen3-30b-a3b-fp8", "gpt-oss-120b-mxfp4", "qwen3.6-35b-a3b-bf16", "deepseek-v4-flash",
                  "llada2.0-mini", "testbed", "testbed-sparse"}


# ------------------------------------------------------------------------------------------------ profiles


def test_profiles_listed_and_loadable():
    assert SHIPPED_HW | {"this-machine"} == set(profiles.list_hardware())
    assert SHIPPED_MODELS == set(profiles.list_models())
    for name in SHIPPED_HW:
        hw = profiles.load_hardware(name)
        assert hw.name == name and hw.link_gbps > 0 and hw.device_memory_gb > 0
    for name in SHIPPED_MODELS:
        m = profiles.load_model_profile(name)
        assert m.name == name and m.expert_bytes > 0 and 1 <= m.top_k <= m.num_experts


def test_profile_numbers_have_sources():
    """Every number in a shipped profile is either sourced or listed as unsourced (never invented silently)."""
    root = profiles._data_dir("hardware").parent
    for kind in ("hardware", "models"):
        for path in root.joinpath(kind).iterdir():
            data = json.loads(path.read_text())
            for k, v in data.items():
                numeric = isinstance(v, (int, float)) and not isinstance(v, bool)
                if numeric or (isinstance(v, dict) and v and k != "sources"):
                    assert k in data["sources"] or k in data["unsourced"], f"{path.name}: {k} has no source"


def test_profile_values_from_the_paper():
    q = profiles.load_model_profile("qwen3-30b-a3b-fp8")
    assert (q.num_moe_layers, q.num_experts, q.top_k) == (48, 128, 8)
    assert q.expert_bytes == 3 * 2048 * 768 + 3 * 96 * 4
    assert round(q.total_expert_bytes / 1e9, 1) == 29.0  # SeqMoE fig. 1
    assert q.full_load_tok_s == {"rtx4090": 122.7}
    assert profiles.load_model_profile("qwen3.6-35b-a3b-bf16").full_load_tok_s == {"rtx5090": 156.3}
    assert profiles.load_model_profile("gpt-oss-120b-mxfp4").full_load_tok_s == {"rtx-pro-6000": 175.7}
    assert profiles.load_model_profile("deepseek-v4-flash").full_load_tok_s == {"rtx-pro-6000": 74.8}
    assert profiles.load_model_profile("llada2.0-mini").num_moe_layers == 19
    assert profiles.load_hardware("rtx4090").link == "PCIe 4.0 x16"


def test_unknown_profile_names_list_the_known_ones():
    with pytest.raises(MoeOffloadError, match="rtx4090"):
        profiles.load_hardware("rtx9090")
    with pytest.raises(MoeOffloadError, match="qwen3-30b-a3b-fp8"):
        profiles.load_model_profile("qwen9")


def test_this_machine_measured(tmp_path, monkeypatch):
    monkeypatch.setenv("MOE_OFFLOAD_CACHE", str(tmp_path))
    with pytest.raises(MoeOffloadError, match="bench link"):
        profiles.load_hardware("this-machine")
    from moe_offload.bench.link import measure_link

    out = measure_link(device="cpu", size_mb=4, repeats=2)
    assert (tmp_path / "hardware" / "this-machine.json").is_file()
    hw = profiles.load_hardware("this-machine")
    assert hw.name == "this-machine" and hw.link_gbps == out["link_gbps"] > 0
    assert len(out["measured"]["samples_gbps"]) == 2
    # the TIDE cost model's compute keys are measured too, so `--hardware this-machine` builds TideCosts
    from moe_offload.core.costs import HW_KEYS, TideCosts

    assert all(hw.extra.get(k, getattr(hw, k, None)) is not None for k in HW_KEYS)
    assert out["host_bf16_gflops"] > 0 and out["host_stream_gbps"] > 0
    c = TideCosts.from_profiles(hw, "llada2.0-mini")
    assert c.fallback_token_s == pytest.approx(6291456 / (out["host_bf16_gflops"] * 1e9))


# ------------------------------------------------------------------------------------------------ time model


def _tiny_profiles(full_load=0.25):
    hw = HardwareProfile(name="hw", device_memory_gb=1.0, link="test link", link_gbps=1.0)
    m = ModelProfile(name="m", num_moe_layers=2, num_experts=4, top_k=2, expert_bytes=10**9,
                     full_load_tok_s={"hw": full_load})
    return hw, m


def test_time_model_exact_hand_computed():
    hw, m = _tiny_profiles()
    tm = OnDemandTimeModel(hw, m)
    assert tm.t_layer_s == 2.0  # 1 / (0.25 tok/s * 2 layers)
    assert tm.t_load_s == 1.0  # 1e9 B / 1 GB/s
    counts = StepCounts(request=np.zeros(4, np.int32), step=np.array([0, 1, 2, 3], np.int32),
                        hits=np.array([3, 4, 2, 3]), misses=np.array([5, 0, 2, 1]))
    out = tm.decode_time(counts, (2, 2, 4))
    # prefill ignored; 3 decode steps x 2 layers x 2 s = 12 s compute; 0 + 2 + 1 misses x 1 s = 3 s stall
    assert out["projection"] == "exact"
    assert out["decode_steps"] == 3 and out["prefill_steps_ignored"] == 1
    assert out["compute_s"] == 12.0 and out["stall_s"] == 3.0 and out["decode_s"] == 15.0
    assert out["projected_tok_s"] == pytest.approx(0.2, abs=1e-15)
    assert out["fraction_of_full_load"] == pytest.approx(0.8, abs=1e-15)
    assert list(out["stall_s_steps"]) == [0.0, 2.0, 1.0]
    assert out["decode_miss_rate"] == 3 / 12


def test_time_model_miss_rate_projection_and_override():
    hw, m = _tiny_profiles()
    # a 1-layer top-2 trace: per-step miss fractions 1/2 and 0 -> 2 and 0 misses on the 2x2 profile
    counts = StepCounts(request=np.zeros(3, np.int32), step=np.array([0, 1, 2], np.int32),
                        hits=np.array([0, 1, 2]), misses=np.array([2, 1, 0]))
    out = OnDemandTimeModel(hw, m).decode_time(counts, {"num_moe_layers": 1, "top_k": 2})
    assert out["projection"] == "miss-rate"
    assert out["stall_s"] == 2.0 and out["compute_s"] == 8.0
    assert out["projected_tok_s"] == pytest.approx(0.2, abs=1e-15)
    out = OnDemandTimeModel(hw, m, full_load_tok_s=0.5).decode_time(counts, (1, 2))
    assert out["compute_s"] == 4.0 and out["projected_tok_s"] == pytest.approx(2 / 6, abs=1e-15)


def test_time_model_errors_and_subclass_hook():
    hw, m = _tiny_profiles()
    other = HardwareProfile(name="other", device_memory_gb=1.0, link="x", link_gbps=1.0)
    with pytest.raises(MoeOffloadError, match="full_load_tok_s"):
        OnDemandTimeModel(other, m)
    prefill_only = StepCounts(np.zeros(1, np.int32), np.zeros(1, np.int32), np.array([1]), np.array([3]))
    with pytest.raises(MoeOffloadError, match="no decode steps"):
        OnDemandTimeModel(hw, m).decode_time(prefill_only, (2, 2))

    class HalfHidden(OnDemandTimeModel):
        def step_seconds(self, hits, misses):
            compute, stall = super().step_seconds(hits, misses)
            return compute, stall / 2

    counts = StepCounts(np.zeros(2, np.int32), np.array([0, 1], np.int32), np.array([0, 2]), np.array([4, 2]))
    assert HalfHidden(hw, m).decode_time(counts, (2, 2))["stall_s"] == 1.0


def test_calibration_check_reports_the_paper_ratio():
    c = calibration_check()
    t_layer = 1 / (122.7 * 48)
    t_load = (3 * 2048 * 768 + 1152) / 25.6e9
    assert c["experts_per_layer"] == pytest.approx(t_layer / t_load)
    assert c["paper_experts_per_layer"] == 1.39
    assert c["implied_link_gbps"] == pytest.approx(1.39 * (3 * 2048 * 768 + 1152) / t_layer / 1e9)
    assert "1.39" in c["note"]


# ------------------------------------------------------------------------------------------------ synthetic traces


def test_synthetic_trace_shapes_and_header(tmp_path):
    tr = synthetic_trace(num_moe_layers=6, num_experts=32, top_k=4, steps=50, requests=2, prompt_tokens=3, seed=1)
    n = 2 * (3 + 50)
    assert tr.expert_ids.shape == (n, 6, 4) and tr.expert_ids.dtype == np.int16
    assert tr.expert_weights.shape == (n, 6, 4) and tr.expert_weights.dtype == np.float16
    assert tr.request.dtype == np.int32 and tr.step.dtype == np.int32 and tr.prompt_ids.shape == (6,)
    assert tr.header["synthetic"] is True and tr.header["model_id"] == "synthetic-6x32x4"
    assert len(tr.steps()) == 2 * 51
    ids = np.sort(tr.expert_ids, axis=2)
    assert (np.diff(ids, axis=2) > 0).all() and ids.min() >= 0 and ids.max() < 32
    back = load_trace(tr.save(tmp_path / "syn.safetensors"))  # the format accepts it
    assert np.array_equal(back.expert_ids, tr.expert_ids) and back.header["synthetic"] is True


def test_synthetic_trace_deterministic_and_reuse():
    kw = dict(num_moe_layers=4, num_experts=64, top_k=8, steps=2000, prompt_tokens=1)
    a, b = synthetic_trace(seed=3, **kw), synthetic_trace(seed=3, **kw)
    assert np.array_equal(a.expert_ids, b.expert_ids)
    assert not np.array_equal(a.expert_ids, synthetic_trace(seed=4, **kw).expert_ids)
    for reuse in (0.2, 0.7):
        ids = synthetic_trace(seed=0, reuse=reuse, **kw).expert_ids
        kept = (ids[:-1, :, :, None] == ids[1:, :, None, :]).any(-1).mean()
        assert kept == pytest.approx(reuse, abs=0.02)


def test_higher_reuse_gives_higher_lru_hit_rate():
    kw = dict(num_moe_layers=8, num_experts=32, top_k=4, steps=300, prompt_tokens=4, seed=0)
    slots = 8 * 32 // 4
    rates = [replay(synthetic_trace(reuse=r, **kw), slots, "lru").hit_rate for r in (0.1, 0.5, 0.9)]
    assert rates[0] < rates[1] < rates[2]


def test_synthetic_trace_bad_arguments():
    with pytest.raises(MoeOffloadError):
        synthetic_trace(num_experts=4, top_k=8)
    with pytest.raises(MoeOffloadError):
        synthetic_trace(reuse=1.5)


# ------------------------------------------------------------------------------------------------ reports


def _rows(synthetic=True):
    rows = []
    for pol, base in (("lru", 0.6), ("belady", 0.7)):
        for res in (0.15, 0.25, 0.45):
            hr = base + res / 2
            rows.append({"trace": "t1", "policy": pol, "residency": res, "slots": int(res * 100), "hit_rate": hr,
                         "decode_hit_rate": hr, "misses": 10, "projected_tok_s": 100 * hr, "full_load_tok_s": 122.7,
                         "fraction_of_full_load": hr * 100 / 122.7, "synthetic": synthetic})
    return rows


def test_write_report(tmp_path):
    from moe_offload.sim.report import write_report

    out = tmp_path / "rep"
    files = write_report(_rows(), out, "LRU vs Belady")
    assert {p.name for p in files} == {"results.csv", "results.md", "hit_rate.png", "decode_speed.png"}
    assert all(p.parent == out and p.stat().st_size > 0 for p in files)
    title = (out / "results.md").read_text().splitlines()[0]
    assert title.startswith("# LRU vs Belady") and "SYNTHETIC trace" in title
    assert (out / "results.csv").read_text().splitlines()[0].startswith("trace,synthetic,policy,residency")


def test_write_report_not_synthetic_and_refuses_non_empty(tmp_path):
    from moe_offload.sim.report import write_report

    write_report(_rows(synthetic=False), tmp_path / "r", "real")
    assert "SYNTHETIC" not in (tmp_path / "r" / "results.md").read_text()
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "keep.txt").write_text("user data")
    with pytest.raises(MoeOffloadError, match="not empty"):
        write_report(_rows(), busy, "x")
    assert (busy / "keep.txt").read_text() == "user data" and len(list(busy.iterdir())) == 1
    (tmp_path / "afile").write_text("x")
    with pytest.raises(MoeOffloadError):
        write_report(_rows(), tmp_path / "afile", "x")


# ------------------------------------------------------------------------------------------------ replay speed


def test_bench_replay_speed_runs():
    from moe_offload.bench.replay_speed import bench_replay_speed

    r = bench_replay_speed(seconds=0.2, num_moe_layers=8, num_experts=32, top_k=4)
    assert r["accesses"] > 0 and r["accesses_per_s"] > 0 and r["replay_s"] > 0
