"""``GET /metrics``: Prometheus metrics of servers started in-process on loopback ports (tiny random checkpoints),
scraped with plain HTTP and parsed with ``prometheus_client``'s own parser; values are checked against the
responses' usage and ``/v1/stats``."""

import json
import time
import urllib.error
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from moe_offload.models.loader import load_offloaded
from moe_offload.serve.app import create_app
from moe_offload.serve.server import ServeConfig, ServerThread, load_for_serving

PROMPT = "Hello there, how are you today?"


def _get(srv, path):
    with urllib.request.urlopen(srv.base_url + path) as r:
        return json.loads(r.read())


def _post(srv, path, body: dict):
    """POST JSON; returns (status, raw response text)."""
    req = urllib.request.Request(srv.base_url + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def _scrape(srv) -> tuple[str, dict]:
    """(content type, ``{family name: family}``) of ``GET /metrics``."""
    with urllib.request.urlopen(srv.base_url + "/metrics") as r:
        ctype, text = r.headers["Content-Type"], r.read().decode()
    return ctype, {f.name: f for f in text_string_to_metric_families(text)}


def _value(fams, family, sample=None, **labels):
    """The value of the one sample of ``family`` named ``sample`` (default: the counter's ``_total``, else the
    family's name) whose labels include ``labels``."""
    fam = fams[family]
    name = sample or (family + "_total" if fam.type == "counter" else family)
    got = [s.value for s in fam.samples if s.name == name and labels.items() <= s.labels.items()]
    assert len(got) == 1, (family, name, labels, fam.samples)
    return got[0]


def _wait_idle(srv, timeout=20.0):
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        st = _get(srv, "/v1/stats")
        if st["requests_running"] == 0 and st["queue_length"] == 0:
            return st
        time.sleep(0.05)
    raise AssertionError("the server did not become idle")


@pytest.fixture(scope="module")
def served(tiny_dirs):
    """A tiny Qwen3-MoE served batch 1 with a memory budget and the CPU tracker."""
    state = load_for_serving(ServeConfig(tiny_dirs["qwen3_moe"], model_name="tiny", memory_budget_gb=0.0048,
                                         track_memory=True, max_batch=1), log=lambda m: None)
    with ServerThread(state) as srv:
        yield state, srv


def _two_requests(srv) -> list[dict]:
    """A non-streamed chat completion and a streamed completion with usage; returns their usages."""
    st, text = _post(srv, "/v1/chat/completions", {"model": "tiny", "max_tokens": 6,
                                                    "messages": [{"role": "user", "content": PROMPT}]})
    assert st == 200
    usages = [json.loads(text)["usage"]]
    st, text = _post(srv, "/v1/completions", {"model": "tiny", "prompt": PROMPT, "max_tokens": 5, "stream": True,
                                              "stream_options": {"include_usage": True}})
    assert st == 200
    events = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
    usages.append(next(e["usage"] for e in events if e.get("usage")))
    return usages


def test_metrics_count_the_requests_tokens_and_experts(served):
    state, srv = served
    usages = _two_requests(srv)
    assert _post(srv, "/v1/chat/completions", {"model": "tiny", "messages": []})[0] == 400  # refused, never queued
    stats = _wait_idle(srv)
    ctype, fams = _scrape(srv)
    assert ctype.startswith("text/plain") and "version=" in ctype
    reqs = fams["moe_offload_requests"]
    assert sum(s.value for s in reqs.samples if s.name.endswith("_total")) == 2
    for endpoint in ("/v1/chat/completions", "/v1/completions"):
        assert sum(s.value for s in reqs.samples if s.name.endswith("_total")
                   and s.labels["endpoint"] == endpoint and s.labels["finish_reason"] in ("stop", "length")) == 1
        for hist in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_seconds"):
            assert _value(fams, "moe_offload_" + hist, f"moe_offload_{hist}_count", endpoint=endpoint) == 1
            assert _value(fams, "moe_offload_" + hist, f"moe_offload_{hist}_sum", endpoint=endpoint) > 0 or \
                hist == "request_queue_seconds"
    tpot = fams["moe_offload_time_per_output_token_seconds"]
    assert sum(s.value for s in tpot.samples if s.name.endswith("_count")) == sum(
        u["completion_tokens"] > 1 for u in usages)
    assert _value(fams, "moe_offload_generation_tokens") == sum(u["completion_tokens"] for u in usages)
    assert _value(fams, "moe_offload_prompt_tokens") == sum(u["prompt_tokens"] for u in usages)
    assert _value(fams, "moe_offload_http_requests", method="POST", endpoint="/v1/chat/completions",
                  status="200") == 1
    assert _value(fams, "moe_offload_http_requests", method="POST", endpoint="/v1/chat/completions",
                  status="400") == 1
    assert _value(fams, "moe_offload_http_requests", method="POST", endpoint="/v1/completions", status="200") == 1
    hits = _value(fams, "moe_offload_expert_hits", tier="device")
    misses = _value(fams, "moe_offload_expert_misses", tier="device")
    assert (hits, misses) == (stats["hits"], stats["misses"]) and hits + misses > 0
    assert _value(fams, "moe_offload_expert_loaded_bytes", tier="device") == stats["bytes_loaded"]
    assert _value(fams, "moe_offload_slots") == stats["slots"] == state.plan.slots
    assert _value(fams, "moe_offload_routed_experts") == stats["routed_experts"]
    assert 0 < _value(fams, "moe_offload_resident_experts") <= stats["slots"]
    assert _value(fams, "moe_offload_memory_budget_bytes") == state.plan.budget_bytes
    assert _value(fams, "moe_offload_process_resident_memory_bytes") > 0  # memory in use (the CPU: the process's)
    assert _value(fams, "moe_offload_memory_planned_bytes", part="slot_pool") == state.plan.slot_bytes
    assert sum(s.value for s in fams["moe_offload_memory_planned_bytes"].samples) == state.plan.total_bytes
    assert _value(fams, "moe_offload_memory_peak_bytes") == state.memory()["measured"]["device_peak_bytes"]
    assert _value(fams, "moe_offload_requests_running") == _value(fams, "moe_offload_requests_waiting") == 0
    assert _value(fams, "moe_offload_batch_size_max") == 1


def test_metric_names_follow_the_conventions(served):
    _, srv = served
    _two_requests(srv)
    _wait_idle(srv)
    _, fams = _scrape(srv)
    assert fams and all(name.startswith("moe_offload_") for name in fams)
    # prometheus_client adds a ``<name>_created`` gauge (creation time, in seconds) per counter and histogram
    created = {n for n in fams if n.endswith("_created") and n.removesuffix("_created") in fams}
    assert created == {n + "_created" for n, f in fams.items() if f.type == "histogram"} | {
        "moe_offload_requests_created", "moe_offload_http_requests_created"}
    for name, fam in ((n, f) for n, f in fams.items() if n not in created):
        assert fam.type in ("counter", "gauge", "histogram"), name
        if fam.type == "counter":
            assert all(s.name == name + "_total" for s in fam.samples), name
        if fam.type == "histogram":
            assert name.endswith("_seconds"), name
        if "bytes" in name or "seconds" in name:
            assert name.endswith(("_bytes", "_seconds")), name
    with urllib.request.urlopen(urllib.request.Request(srv.base_url + "/metrics", method="HEAD")) as r:
        assert r.status == 200 and r.read() == b""
    _, fams = _scrape(srv)
    assert _value(fams, "moe_offload_http_requests", method="GET", endpoint="/metrics", status="200") >= 2
    assert _value(fams, "moe_offload_http_requests", method="HEAD", endpoint="/metrics", status="200") == 1


def test_every_app_has_its_own_registry(served):
    """Two apps over one state in one process: no duplicate-timeseries error, separate request counters."""
    state, _ = served
    a, b = create_app(state), create_app(state)
    assert a.state.metrics.registry is not b.state.metrics.registry
    a.state.metrics.requests.labels("/v1/completions", "stop").inc()
    assert b.state.metrics.registry.get_sample_value(
        "moe_offload_requests_total", {"endpoint": "/v1/completions", "finish_reason": "stop"}) is None


def test_disk_tier_and_host_cache_metrics(tiny_dirs):
    """``--host-store disk --host-cache``: disk reads and the host cache's hits / misses equal ``/v1/stats``."""
    state = load_for_serving(ServeConfig(tiny_dirs["qwen3_moe"], model_name="tiny", residency=0.3, max_context=64,
                                         host_store="disk", host_cache_gb=20 * 24576 / 1e9, max_batch=1),
                             log=lambda m: None)
    with ServerThread(state) as srv:
        _two_requests(srv)
        stats = _wait_idle(srv)
        _, fams = _scrape(srv)
    disk, cache = stats["disk"], stats["host_cache"]
    assert _value(fams, "moe_offload_disk_reads") == disk["requests"]
    assert _value(fams, "moe_offload_disk_read_bytes") == disk["bytes_read"]
    assert _value(fams, "moe_offload_disk_experts_read") == disk["experts"] > 0
    assert _value(fams, "moe_offload_expert_loaded_bytes", tier="disk") == disk["expert_bytes"]
    assert _value(fams, "moe_offload_expert_hits", tier="host_cache") == cache["hits"]
    assert _value(fams, "moe_offload_expert_misses", tier="host_cache") == cache["misses"]
    assert _value(fams, "moe_offload_host_cache_bypasses") == cache["bypasses"]
    assert _value(fams, "moe_offload_host_cache_rows") == cache["rows"] == 20
    assert _value(fams, "moe_offload_host_cache_bytes") == cache["bytes"]
    # the store's counters are reset with the engine's after the start-up profile run: the tiers count the same
    # requests, so every device miss went through the host cache once (no prefetching here)
    assert cache["hits"] + cache["misses"] + cache["bypasses"] == stats["misses"] > 0
    assert disk["experts"] == cache["misses"] + cache["bypasses"]


def test_prefetch_and_predictor_metrics(tiny_dirs, random_pset, tmp_path):
    """``--policy seqmoe --predictor``: forecasts and prefetches issued / landed / waited equal the predictor's
    and the prefetcher's counters."""
    d = tiny_dirs["qwen3_moe"]
    probe = load_offloaded(d, residency=1.0, device="cpu", progress=False)
    random_pset(probe, seed=3).save(tmp_path / "pred")
    state = load_for_serving(ServeConfig(d, model_name="tiny", residency=0.5, max_context=64, policy="seqmoe",
                                         predictor=str(tmp_path / "pred"), max_batch=1), log=lambda m: None)
    with ServerThread(state) as srv:
        _two_requests(srv)
        _wait_idle(srv)
        _, fams = _scrape(srv)
    eng = state.lm.engine
    pf, runner = eng.prefetcher, eng.observers[-1].runner
    assert _value(fams, "moe_offload_predictor_forecasts") == runner.stats.prefill_calls + \
        runner.stats.decode_calls > 0
    assert _value(fams, "moe_offload_prefetches_issued", source="forecast") == pf.prefetches - pf.prefill_prefetches
    assert _value(fams, "moe_offload_prefetches_issued", source="prefill_popularity") == pf.prefill_prefetches
    assert pf.prefetches > 0
    assert _value(fams, "moe_offload_prefetches_landed") == pf.landed
    assert _value(fams, "moe_offload_prefetches_waited") == pf.waited
    assert _value(fams, "moe_offload_prefetches_wasted") == eng.table.prefetches_wasted
    assert _value(fams, "moe_offload_transfer_copies", outcome="ok") == pf.transfer.stats.copies


def test_continuous_batching_metrics(tiny_dirs):
    """``--max-batch 2``: the batch limit, and one decode step per token after the first of each request."""
    state = load_for_serving(ServeConfig(tiny_dirs["qwen3_moe"], model_name="tiny", residency=0.5, max_context=64,
                                         max_batch=2), log=lambda m: None)
    with ServerThread(state) as srv:
        usages = _two_requests(srv)
        _wait_idle(srv)
        _, fams = _scrape(srv)
    assert _value(fams, "moe_offload_batch_size_max") == 2 and _value(fams, "moe_offload_batch_size") == 0
    steps = {s.labels["batch_size"]: s.value for s in fams["moe_offload_decode_steps"].samples}
    assert steps == {"1": sum(u["completion_tokens"] - 1 for u in usages)}  # the requests ran one after the other
    assert _value(fams, "moe_offload_generation_tokens") == sum(u["completion_tokens"] for u in usages)
