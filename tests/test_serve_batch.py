"""``serve`` with continuous batching (issue 18): concurrent streaming clients decode together; tokens equal
``generate`` alone (greedy; near ties reported as in tests/test_batching.py), the plan reserves the batch's KV
cache within the budget, /v1/stats reports the batch, and a client that goes away frees its KV rows."""

import asyncio
import json
import time
import urllib.request

import openai
import pytest
import torch

from moe_offload.generation.generate import generate_ids
from moe_offload.models.loader import load_offloaded
from moe_offload.serve.batch_memory import DEFAULT_MAX_BATCH, choose_max_batch
from moe_offload.serve.memory import non_expert_bytes
from moe_offload.serve.server import ServeConfig, ServerThread, load_for_serving

BUDGET_GB = 0.0048  # tiny Qwen3-MoE: as tests/test_serve.py, now with the batch's KV cache in the plan
CONTEXT = 128


def _stats(srv):
    with urllib.request.urlopen(srv.base_url + "/v1/stats") as r:
        return json.loads(r.read())


def _wait_idle(srv, timeout=30.0):
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        st = _stats(srv)
        if st["requests_running"] == 0 and st["queue_length"] == 0:
            return st
        time.sleep(0.05)
    raise AssertionError("the server did not become idle")


@pytest.fixture(scope="module")
def batched(tiny_dirs):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    d = tiny_dirs["qwen3_moe"]
    state = load_for_serving(ServeConfig(d, model_name="tiny", memory_budget_gb=BUDGET_GB, max_context=CONTEXT,
                                         track_memory=True), log=lambda m: None)
    ref = load_offloaded(d, slots=state.plan.slots, device="cpu", progress=False)
    with ServerThread(state) as srv:
        yield state, srv, ref
    torch.set_num_threads(threads)


async def _clients(srv, prompts, max_tokens):
    async with openai.AsyncOpenAI(base_url=srv.base_url + "/v1", api_key="none", max_retries=0, timeout=120) as c:
        async def one(p):
            ids = []
            stream = await c.completions.create(model="tiny", prompt=p, max_tokens=max_tokens, temperature=0,
                                                stream=True, extra_body={"return_token_ids": True})
            async for ch in stream:
                for choice in ch.choices:
                    ids += getattr(choice, "token_ids", None) or []
            return ids
        return await asyncio.gather(*[one(p) for p in prompts])


def test_plan_reserves_the_batch_kv_cache(batched, tiny_dirs):
    """Default max batch from the plan: the KV cache of the batch at max context takes at most half of what the
    weights and activations leave; the whole plan stays within the budget."""
    state, _, _ = batched
    cfg = json.load(open(tiny_dirs["qwen3_moe"] / "config.json"))
    head_dim = cfg.get("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"])
    plan = state.plan
    budget = int(BUDGET_GB * 1e9)
    kv1 = plan.kv_cache_bytes // plan.batch
    assert plan.batch > 1 and plan.kv_cache_bytes == plan.batch * kv1
    assert kv1 == 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim * 4 * CONTEXT  # K, V float32
    assert 1 < plan.batch <= 32 and plan.kv_cache_bytes <= (budget - plan.non_expert_bytes - plan.lookup_bytes) // 2
    assert plan.total_bytes <= budget and state.worker.max_batch == plan.batch


def test_concurrent_clients_decode_together_and_equal_generate(batched):
    """Eight streaming clients at once: decode steps with several sequences happen, every client's tokens equal
    ``generate_ids`` alone, the KV cache is empty once they are done and the measured peak is within budget."""
    state, srv, ref = batched
    prompts = [" ".join(["word"] * n) + f" {n}" for n in (3, 7, 2, 11, 5, 9, 4, 6)]
    got = asyncio.run(_clients(srv, prompts, 12))
    tok = state.lm.tokenizer
    refs = [generate_ids(ref, tok(p)["input_ids"], 12)[0] for p in prompts]
    assert got == refs
    st = _wait_idle(srv)
    b = st["batching"]
    assert b["kv_cache_bytes"] == 0 and b["running"] == 0 and b["max_batch"] == state.plan.batch
    assert max(int(k) for k in b["by_batch_size"]) > 1
    assert all(0 <= v["hit_rate"] <= 1 and v["distinct_experts_per_layer"] >= 1 for v in b["by_batch_size"].values())
    mem = st["memory"]["measured"]
    assert mem["within_budget"] is True and mem["device_peak_bytes"] <= int(BUDGET_GB * 1e9)


def test_disconnect_frees_kv_rows(batched):
    """A streaming client that goes away mid-generation is cancelled after its current token; its KV rows leave."""
    state, srv, _ = batched
    before = _stats(srv)["requests_cancelled"]
    req = urllib.request.Request(srv.base_url + "/v1/completions", headers={"Content-Type": "application/json"},
                                 data=json.dumps({"model": "tiny", "prompt": "hello there", "max_tokens": 100,
                                                  "stream": True}).encode())
    resp = urllib.request.urlopen(req)
    resp.readline()
    resp.close()
    st = _wait_idle(srv)
    assert st["requests_cancelled"] == before + 1 and st["batching"]["kv_cache_bytes"] == 0


def test_choose_max_batch():
    assert choose_max_batch(None, 10, 5) == DEFAULT_MAX_BATCH
    assert choose_max_batch(1000, 200, 100) == 4  # (1000 - 200) / 2 / 100
    assert choose_max_batch(1000, 990, 100) == 1 and choose_max_batch(10 ** 9, 0, 1) == DEFAULT_MAX_BATCH


def test_diffusion_runs_batch_one_and_says_why(tiny_dirs):
    state = load_for_serving(ServeConfig(tiny_dirs["llada2_moe"], model_name="d", block_length=8, steps=4,
                                         max_context=64, max_batch=4), log=lambda m: None)
    st = state.stats()
    assert st["batch_size"] == 1 and state.plan.batch == 1 and "diffusion" in st["batching"]["note"]
    assert st["scheduling"].startswith("queued")


@pytest.mark.parametrize("argv,msg", [
    (["serve", "--residencies", "1.0,x"], "--residencies must be a comma-separated list of numbers"),
    (["serve", "--residencies", "1.5"], "--residencies must be fractions in (0, 1]"),
    (["serve", "--residencies", "1.0", "--max-batch", "4"], "replace --residency"),
    (["serve", "--batches", "0,4"], "--batches must be positive integers"),
    (["replicas", "--replicas", "0"], "--replicas must be positive integers"),
])
def test_bench_compare_bad_options_are_one_line_errors(tiny_dirs, capsys, argv, msg):
    """``bench serve --residencies/--batches`` and ``bench replicas``: bad lists are one-line errors, exit 2."""
    from moe_offload.cli import main

    assert main(["bench", *argv, "--model", str(tiny_dirs["qwen3_moe"]), "--clients", "2", "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert msg in err[-1] and "Traceback" not in "".join(err)


def test_bench_compare_table(tiny_dirs):
    """One run, one table: batch 1 and batch 4 at two residencies; every configuration's tokens equal the batch-1
    server's (``generate_ids`` alone), 0 errors, and the batched / batch-1 ratio line for each residency."""
    from moe_offload.bench.serve_compare import run_compare

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        cfg = ServeConfig(tiny_dirs["qwen3_moe"], model_name="tiny", max_context=64, progress=False)
        prompts = [" ".join(["word"] * n) for n in (3, 7, 2, 5)]
        report = run_compare(cfg, [1.0, 0.5], [1, 4], prompts, 6, track_memory=False, log=lambda m: None)
    finally:
        torch.set_num_threads(threads)
    rows = [line.split(" | ") for line in report.splitlines() if line.startswith("| 1 |") or line.startswith("| 0.5 |")]
    assert [(r[0].strip("| "), r[1], r[3], r[4], r[5]) for r in rows] == [
        ("1", "1", "4", "0", "reference"), ("1", "4", "4", "0", "yes"), ("0.5", "1", "4", "0", "yes"),
        ("0.5", "4", "4", "0", "yes")]
    assert "residency 1: max batch 4 / batch 1 =" in report and "residency 0.5: max batch 4 / batch 1 =" in report


@pytest.mark.parametrize("max_batch", [1, 4])
def test_seqmoe_serves_with_a_predictor(tiny_dirs, random_pset, tmp_path, max_batch):
    """``serve --policy seqmoe --predictor DIR``: the forecasts drive prefetching and eviction (per sequence,
    combined for the batch), the predictor's bytes are in the plan, and every client's tokens equal
    ``generate_ids`` alone on a fully loaded engine."""
    d = tiny_dirs["qwen3_moe"]
    probe = load_offloaded(d, residency=1.0, device="cpu", progress=False)
    pset = random_pset(probe, seed=3)
    pset.save(tmp_path / "pred")
    state = load_for_serving(ServeConfig(d, model_name="tiny", residency=0.5, max_context=CONTEXT, policy="seqmoe",
                                         predictor=str(tmp_path / "pred"), max_batch=max_batch), log=lambda m: None)
    assert state.plan.non_expert_bytes == non_expert_bytes(state.lm) + pset.parameter_bytes()
    prompts = [" ".join(["word"] * n) + f" {n}" for n in (3, 7, 2, 5)]
    with ServerThread(state) as srv:
        got = asyncio.run(_clients(srv, prompts, 10))
        _wait_idle(srv)
    refs = [generate_ids(probe, probe.tokenizer(p)["input_ids"], 10)[0] for p in prompts]
    assert got == refs
    pf = state.lm.engine.prefetcher
    assert pf is not None and pf.prefetches > 0 and state.lm.engine.stats.misses > 0
