"""``moe-offload serve``: the OpenAI-compatible server, driven by the official ``openai`` client against servers
started in-process on free loopback ports (tiny random checkpoints).

Tokens are compared with ``generate``'s own loops (``generate_ids``, ``diffusion_generate_ids``) on a second load
of the same checkpoint with the same pool; the memory plan is recomputed by hand from the checkpoint and config."""

import glob
import json
import math
import time
import urllib.error
import urllib.request

import openai
import pytest
from safetensors import safe_open

from moe_offload.cli import main
from moe_offload.errors import MoeOffloadError
from moe_offload.generation.generate import encode_prompt, generate_ids
from moe_offload.generation.diffusion import diffusion_generate_ids
from moe_offload.models.loader import load_offloaded
from moe_offload.runtime.kernels import native
from moe_offload.serve.memory import GB, slots_for_budget
from moe_offload.serve.server import ServeConfig, ServerThread, load_for_serving
from moe_offload.serve.jobs import Detokenizer

#: tiny Qwen3-MoE at 512 tokens: a budget with room for 27 of its 48 experts on the native kernels, 28 on the
#: pure-torch path (their measured activation peaks differ: 2.03 MB and 3.40 MB)
BUDGET_GB, BUDGET_SLOTS = (0.0034, 27) if native() is not None else (0.0048, 28)
PROMPT = "Hello there, how are you today?"


def _get(srv, path):
    with urllib.request.urlopen(srv.base_url + path) as r:
        return json.loads(r.read())


def _post_raw(srv, path, data: bytes):
    """POST raw bytes as JSON; returns (status, parsed body)."""
    req = urllib.request.Request(srv.base_url + path, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _wait_idle(srv, timeout=20.0):
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        st = _get(srv, "/v1/stats")
        if st["requests_running"] == 0 and st["queue_length"] == 0:
            return st
        time.sleep(0.05)
    raise AssertionError("the server did not become idle")


@pytest.fixture(scope="module")
def qwen(tiny_dirs):
    """A served tiny Qwen3-MoE with a memory budget and the CPU tracker, a reference load, and a client."""
    d = tiny_dirs["qwen3_moe"]
    state = load_for_serving(ServeConfig(d, model_name="tiny-qwen", memory_budget_gb=BUDGET_GB, track_memory=True,
                                         max_batch=1),
                             log=lambda m: None)
    ref = load_offloaded(d, slots=state.plan.slots, device="cpu", progress=False)
    with ServerThread(state) as srv:
        client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="none", max_retries=0, timeout=60)
        yield state, srv, client, ref
        client.close()


def _chat(client, prompt=PROMPT, **kw):
    return client.chat.completions.create(model="tiny-qwen", messages=[{"role": "user", "content": prompt}],
                                          extra_body={"return_token_ids": True}, **kw)


def test_models_and_health(qwen):
    state, srv, client, _ = qwen
    assert [m.id for m in client.models.list().data] == ["tiny-qwen"]
    assert _get(srv, "/health")["status"] == "ok"


def test_chat_completion_equals_generate(qwen):
    state, srv, client, ref = qwen
    r = _chat(client, max_tokens=12)
    ids = encode_prompt(ref.tokenizer, PROMPT)
    want = generate_ids(ref, ids, 12)[0]
    c = r.choices[0]
    assert c.token_ids == want
    assert c.message.role == "assistant"
    assert c.message.content == ref.tokenizer.decode(want, skip_special_tokens=True)
    assert c.finish_reason == ("stop" if len(want) < 12 else "length")
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (len(ids), len(want),
                                                                                        len(ids) + len(want))


def test_stream_concatenates_to_the_non_streamed_text(qwen):
    state, srv, client, ref = qwen
    full = _chat(client, max_tokens=16)
    chunks = list(_chat(client, max_tokens=16, stream=True, stream_options={"include_usage": True}))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    ids = [t for ch in chunks if ch.choices for t in (getattr(ch.choices[0], "token_ids", None) or [])]
    assert text == full.choices[0].message.content
    assert ids == full.choices[0].token_ids
    assert chunks[0].choices[0].delta.role == "assistant"
    finals = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert finals == [full.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ids)
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_completions_with_sampling_settings_equal_generate(qwen):
    state, srv, client, ref = qwen
    kw = dict(temperature=0.8, top_p=0.9, seed=3)
    r = client.completions.create(model="tiny-qwen", prompt="The slot pool", max_tokens=10,
                                  extra_body={"return_token_ids": True}, **kw)
    want = generate_ids(ref, ref.tokenizer("The slot pool")["input_ids"], 10, **kw)[0]
    assert r.choices[0].token_ids == want
    assert r.choices[0].text == ref.tokenizer.decode(want, skip_special_tokens=True)
    streamed = client.completions.create(model="tiny-qwen", prompt="The slot pool", max_tokens=10, stream=True, **kw)
    assert "".join(ch.choices[0].text for ch in streamed if ch.choices) == r.choices[0].text


def test_stop_sequence_cuts_the_text(qwen):
    state, srv, client, ref = qwen
    full = _chat(client, max_tokens=24).choices[0].message.content
    # a two-character (else one-character) stop string without replacement characters, first occurring after the
    # start (random byte-level text has few clean windows)
    i, n = next((i, n) for n in (2, 1) for i in range(1, len(full) - n + 1)
                if "\ufffd" not in full[i:i + n] and full.find(full[i:i + n]) == i)
    stop = full[i:i + n]
    r = _chat(client, max_tokens=24, stop=[stop])
    assert r.choices[0].message.content == full[:i]
    assert r.choices[0].finish_reason == "stop"
    streamed = _chat(client, max_tokens=24, stop=stop, stream=True)
    assert "".join(ch.choices[0].delta.content or "" for ch in streamed if ch.choices) == full[:i]


def test_stats_move_after_requests(qwen):
    state, srv, client, _ = qwen
    before = _wait_idle(srv)
    r = _chat(client, max_tokens=8)
    after = _get(srv, "/v1/stats")
    assert after["requests_served"] == before["requests_served"] + 1
    assert after["completion_tokens"] == before["completion_tokens"] + r.usage.completion_tokens
    assert after["prompt_tokens"] == before["prompt_tokens"] + r.usage.prompt_tokens
    assert after["hits"] + after["misses"] > before["hits"] + before["misses"]
    assert after["decode_tokens"] == before["decode_tokens"] + r.usage.completion_tokens - 1
    assert after["decode_tokens_per_s"] > 0 and after["ttft_s"] > 0
    assert after["hit_rate"] == after["hits"] / (after["hits"] + after["misses"])
    assert after["queue_length"] == 0 and after["scheduling"].startswith("queued") and after["batch_size"] == 1
    assert after["policy"] == "lru" and after["slots"] == state.plan.slots
    assert after["residency"] == state.plan.slots / 48


@pytest.mark.parametrize("body,status,param", [
    ({"model": "nope", "messages": [{"role": "user", "content": "hi"}]}, 404, "model"),
    ({"model": "tiny-qwen", "messages": []}, 400, "messages"),
    ({"model": "tiny-qwen", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, 400, "max_tokens"),
    ({"model": "tiny-qwen", "messages": [{"role": "user", "content": "hi"}], "max_tokens": -3}, 400, "max_tokens"),
    ({"model": "tiny-qwen", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 511}, 400, "max_tokens"),
    ({"model": "tiny-qwen", "messages": [{"role": "user", "content": "hi"}], "max_tokens": "5"}, 400, "max_tokens"),
    ({"model": "tiny-qwen", "messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}, 400,
     "temperature"),
    ({"model": "tiny-qwen", "messages": "hi"}, 400, "messages"),
    ({"model": "tiny-qwen", "messages": [{"role": "user", "content": 5}]}, 400, None),
    ({"model": "tiny-qwen", "messages": [{"role": "user", "content": "hi"}], "stream": "yes"}, 400, "stream"),
    ({"model": "tiny-qwen", "messages": [{"role": "user", "content": "hi"}], "top_p": 1.5}, 400, "top_p"),
    ({"model": "tiny-qwen", "messages": [{"role": "user", "content": "hi"}], "top_p": -0.1}, 400, "top_p"),
    ({"model": "tiny-qwen", "messages": [{"role": "user", "content": "hi"}], "n": 2}, 400, "n"),
    ({"messages": [{"role": "user", "content": "hi"}]}, 400, "model"),
    # integers outside their ranges: refused before the request is queued (issue 15)
    ({"model": "tiny-qwen", "messages": [{"role": "user", "content": "hi"}], "seed": 2**64}, 400, "seed"),
    ({"model": "tiny-qwen", "messages": [{"role": "user", "content": "hi"}], "seed": -2}, 400, "seed"),  # -1: none
    ({"model": "tiny-qwen", "messages": [{"role": "user", "content": "hi"}], "seed": 2**32}, 400, "seed"),
    ({"model": "tiny-qwen", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2**64}, 400, "max_tokens"),
    ({"model": "tiny-qwen", "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": -(2**70)}, 400,
     "max_completion_tokens"),
    ({"model": "tiny-qwen", "messages": [{"role": "user", "content": "hi"}], "n": 2**64}, 400, "n"),
])
def test_bad_requests_get_openai_errors(qwen, body, status, param):
    state, srv, client, _ = qwen
    code, err = _post_raw(srv, "/v1/chat/completions", json.dumps(body).encode())
    assert code == status
    assert set(err["error"]) == {"message", "type", "param", "code"} and err["error"]["message"]
    assert err["error"]["type"] == "invalid_request_error"
    if param:
        assert err["error"]["param"] == param


@pytest.mark.parametrize("body,param", [
    ({"prompt": [1, 2**64]}, "prompt"),
    ({"prompt": [-1]}, "prompt"),
    ({"prompt": "hi", "seed": 18446744073709551616}, "seed"),
    ({"prompt": "hi", "max_tokens": 2**63}, "max_tokens"),
    ({"prompt": "hi", "best_of": 2**64}, "best_of"),
])
def test_out_of_range_integers_in_completions_are_400_and_never_queued(qwen, body, param):
    state, srv, client, _ = qwen
    before = _wait_idle(srv)
    code, err = _post_raw(srv, "/v1/completions", json.dumps(dict(body, model="tiny-qwen")).encode())
    assert code == 400 and err["error"]["type"] == "invalid_request_error" and err["error"]["param"] == param
    after = _get(srv, "/v1/stats")
    assert (after["requests_served"], after["requests_failed"]) == (before["requests_served"],
                                                                   before["requests_failed"])


def test_seed_mapping_edges(qwen):
    """The largest seed works; distinct seeds give distinct sampled sequences, equal seeds equal ones."""
    state, srv, client, ref = qwen
    kw = dict(max_tokens=12, temperature=1.0)
    top = _chat(client, seed=2**32 - 1, **kw).choices[0].token_ids
    assert top == _chat(client, seed=2**32 - 1, **kw).choices[0].token_ids
    assert top == generate_ids(ref, encode_prompt(ref.tokenizer, PROMPT), 12, temperature=1.0, seed=2**32 - 1)[0]
    assert _chat(client, seed=0, **kw).choices[0].token_ids != _chat(client, seed=1, **kw).choices[0].token_ids
    code, err = _post_raw(srv, "/v1/chat/completions", json.dumps(
        {"model": "tiny-qwen", "messages": [{"role": "user", "content": "hi"}], "seed": 2**32}).encode())
    assert code == 400 and err["error"]["message"] == ("seed must be an integer in [0, 4294967295], got 4294967296 "
                                                       "(or -1: no seed)")


def test_bad_requests_through_the_client_and_the_server_survives(qwen):
    state, srv, client, ref = qwen
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="tiny-qwen", messages=[])
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny-qwen", prompt="hi", max_tokens=0)
    with pytest.raises(openai.BadRequestError, match="maximum context length is 512"):
        client.completions.create(model="tiny-qwen", prompt="hi", max_tokens=600)
    for path in ("/v1/chat/completions", "/v1/completions"):
        code, err = _post_raw(srv, path, b'{"model": "tiny-qwen", "messages": [')  # malformed JSON
        assert code == 400 and "not valid JSON at character" in err["error"]["message"]
        assert err["error"]["param"] is None
        code, err = _post_raw(srv, path, b"[1, 2]")
        assert code == 400
    req = urllib.request.Request(srv.base_url + "/v1/completions", data=b'{"model": "tiny-qwen", "prompt": "hi"}',
                                 headers={"Content-Type": "application/x-www-form-urlencoded"})
    with pytest.raises(urllib.error.HTTPError) as no_json:
        urllib.request.urlopen(req)
    assert no_json.value.code == 400 and "Content-Type: application/json" in json.loads(no_json.value.read())[
        "error"]["message"]
    code, err = _post_raw(srv, "/v1/completions", json.dumps({"model": "tiny-qwen", "prompt": ["a", "b"]}).encode())
    assert code == 400 and err["error"]["param"] == "prompt"
    assert _get(srv, "/health")["status"] == "ok"
    assert _chat(client, max_tokens=6).choices[0].token_ids == generate_ids(
        ref, encode_prompt(ref.tokenizer, PROMPT), 6)[0]
    assert _get(srv, "/v1/stats")["requests_failed"] == 0


def test_client_disconnect_mid_stream_stops_generation(qwen):
    state, srv, client, ref = qwen
    before = _wait_idle(srv)
    live = state.tracker.live_bytes()  # device-tier tensors alive between requests
    long_prompt = "Tell me everything about slots."
    n = 512 - len(encode_prompt(ref.tokenizer, long_prompt))
    stream = _chat(client, prompt=long_prompt, max_tokens=n, stream=True)
    got = 0
    for ch in stream:
        got += len(getattr(ch.choices[0], "token_ids", None) or []) if ch.choices else 0
        if got >= 3:
            break
    stream.close()
    after = _wait_idle(srv)
    assert after["requests_cancelled"] == before["requests_cancelled"] + 1
    assert after["requests_served"] == before["requests_served"]
    assert state.worker.active is None
    assert state.tracker.live_bytes() == live  # its KV cache and activations are gone
    r = _chat(client, max_tokens=10)  # a normal request afterwards
    assert r.choices[0].token_ids == generate_ids(ref, encode_prompt(ref.tokenizer, PROMPT), 10)[0]


def test_queued_and_non_streamed_clients_that_leave_are_dropped(qwen):
    state, srv, client, ref = qwen
    before = _wait_idle(srv)
    n = 512 - len(encode_prompt(ref.tokenizer, PROMPT))
    running = _chat(client, max_tokens=n, stream=True)  # occupies the worker
    it = iter(running)
    next(it)
    queued = _chat(client, max_tokens=n, stream=True)  # waits behind it: its client leaves before it runs
    next(iter(queued))  # the role chunk is sent at once
    assert _get(srv, "/v1/stats")["queue_length"] == 1
    queued.close()
    t0 = time.monotonic()
    while _get(srv, "/v1/stats")["queue_length"] and time.monotonic() - t0 < 10:
        time.sleep(0.02)
    assert _get(srv, "/v1/stats")["queue_length"] == 0
    running.close()
    # a non-streamed client that gives up (timeout) is noticed while its request runs
    with pytest.raises(openai.APITimeoutError):
        _chat(client.with_options(timeout=0.15), max_tokens=n)
    after = _wait_idle(srv)
    assert after["requests_cancelled"] == before["requests_cancelled"] + 3
    assert after["requests_served"] == before["requests_served"]


def test_concurrent_clients_are_queued_and_exact(qwen):
    import asyncio

    state, srv, client, ref = qwen
    prompts = [f"Question {i}: what is a slot?" for i in range(5)]

    async def one(ac, p):
        s = await ac.chat.completions.create(model="tiny-qwen", messages=[{"role": "user", "content": p}],
                                             max_tokens=12, stream=True, extra_body={"return_token_ids": True})
        return [t for ch in [c async for c in s] if ch.choices for t in (getattr(ch.choices[0], "token_ids", None)
                                                                         or [])]

    async def all_at_once():
        async with openai.AsyncOpenAI(base_url=srv.base_url + "/v1", api_key="none", max_retries=0) as ac:
            return await asyncio.gather(*[one(ac, p) for p in prompts])

    got = asyncio.run(all_at_once())
    assert got == [generate_ids(ref, encode_prompt(ref.tokenizer, p), 12)[0] for p in prompts]


def test_memory_plan_by_hand_and_measured_peak(qwen, tiny_dirs):
    state, srv, client, _ = qwen
    plan = state.plan
    cfg = json.load(open(tiny_dirs["qwen3_moe"] / "config.json"))
    hidden, inter, layers = cfg["hidden_size"], cfg["moe_intermediate_size"], cfg["num_hidden_layers"]
    experts, kv_heads = cfg["num_local_experts"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim", hidden // cfg["num_attention_heads"])
    expert_bytes = 3 * inter * hidden * 4  # gate;up [2I, H] + down [H, I], float32
    f = safe_open(glob.glob(str(tiny_dirs["qwen3_moe"] / "*.safetensors"))[0], "pt")
    weights = sum(math.prod(f.get_slice(key).get_shape()) * 4 for key in f.keys() if ".experts." not in key)
    rotary = 2 * (head_dim // 2) * 4  # inv_freq and original_inv_freq buffers
    assert plan.expert_bytes == expert_bytes
    assert plan.non_expert_bytes == weights + rotary
    assert plan.lookup_bytes == 8 * layers * experts
    assert plan.kv_cache_bytes == 2 * layers * kv_heads * head_dim * 4 * 512  # K and V at max context 512
    assert plan.activation_bytes > 0
    budget = int(BUDGET_GB * GB)
    by_hand = (budget - plan.non_expert_bytes - plan.lookup_bytes - plan.kv_cache_bytes - plan.activation_bytes) \
        // expert_bytes
    assert plan.slots == min(by_hand, layers * experts) == BUDGET_SLOTS
    assert state.lm.engine.pool.num_slots == plan.slots
    assert state.lm.engine.pool.nbytes == plan.slots * expert_bytes
    assert plan.budget_bytes == budget and plan.total_bytes <= budget and plan.max_context == 512
    _chat(client, max_tokens=20)
    mem = _wait_idle(srv)["memory"]
    m = mem["measured"]
    assert m["static_bytes"] == plan.non_expert_bytes + plan.lookup_bytes + plan.slots * expert_bytes
    assert 0 < m["request_peak_bytes"] and m["device_peak_bytes"] == m["static_bytes"] + m["request_peak_bytes"]
    assert m["device_peak_bytes"] <= plan.total_bytes <= budget and m["within_budget"] is True
    assert mem["plan"]["slots"] == plan.slots and mem["plan"]["budget_bytes"] == budget


def test_slots_for_budget_by_hand():
    # 1000 B of budget, 300 B fixed, 100 B per expert -> 7 slots; capped at the routed experts; per-layer rounding
    assert slots_for_budget(1000, 300, 100, 64, 4) == 7
    assert slots_for_budget(10 ** 6, 300, 100, 64, 4) == 64
    assert slots_for_budget(1000, 300, 100, 64, 2, num_moe_layers=3) == 6
    with pytest.raises(MoeOffloadError, match="too small"):
        slots_for_budget(1000, 800, 100, 64, 4)
    with pytest.raises(MoeOffloadError, match="too small"):
        slots_for_budget(1000, 300, 100, 64, 3, num_moe_layers=3)  # 2 per layer < top-k 3
    # the early check (before the profile run) knows only the weights: it says so, and what comes on top
    with pytest.raises(MoeOffloadError, match=r"weights and lookup table alone take .* need at least 0\.001 GB plus "
                                              r"the KV cache and activations"):
        slots_for_budget(1000, 800, 100, 64, 4, weights_only=True)


def test_budget_too_small_is_a_clear_startup_error(tiny_dirs, capsys):
    d = tiny_dirs["qwen3_moe"]
    with pytest.raises(MoeOffloadError, match="too small.*need at least"):
        load_for_serving(ServeConfig(d, memory_budget_gb=0.001), log=lambda m: None)
    assert main(["serve", "--model", str(d), "--port", "0", "--memory-budget", "0.001", "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("moe-offload: error: --memory-budget 0.001 GB is too small")
    assert "Traceback" not in "".join(err)


@pytest.mark.parametrize("argv,msg", [
    (["--block-length", "8"], "only apply to diffusion models"),
    (["--max-context", "100000"], "exceeds the model's max_position_embeddings"),
    (["--policy", "seqmoe"], "needs --predictor DIR"),
    (["--predictor", "nowhere"], "--predictor is used by the forecast-driven policies"),
    (["--policy", "seqmoe-xl", "--predictor", "nowhere"], "--policy seqmoe-xl is not served"),
    (["--port", "70000"], "--port must be in"),
])
def test_cli_bad_options_are_one_line_errors(tiny_dirs, capsys, argv, msg):
    assert main(["serve", "--model", str(tiny_dirs["qwen3_moe"]), "--port", "0", "--quiet", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert msg in err[-1] and "Traceback" not in "".join(err)


def test_diffusion_streams_block_by_block(tiny_dirs):
    d = tiny_dirs["llada2_moe"]
    state = load_for_serving(ServeConfig(d, model_name="tiny-llada", block_length=8, steps=4, max_context=128,
                                         residency=0.5), log=lambda m: None)
    ref = load_offloaded(d, slots=state.plan.slots, device="cpu", progress=False)
    with ServerThread(state) as srv, openai.OpenAI(base_url=srv.base_url + "/v1", api_key="none",
                                                   max_retries=0) as client:
        kw = dict(model="tiny-llada", messages=[{"role": "user", "content": PROMPT}], max_tokens=30,
                  extra_body={"return_token_ids": True})
        full = client.chat.completions.create(**kw)
        chunks = [ch for ch in client.chat.completions.create(stream=True, **kw) if ch.choices]
        stats = _get(srv, "/v1/stats")
    ids = encode_prompt(ref.tokenizer, PROMPT)
    res = diffusion_generate_ids(ref, ids, 30, block_length=8, steps=4, threshold=0.95)
    assert full.choices[0].token_ids == res.token_ids
    pieces = [getattr(ch.choices[0], "token_ids", None) for ch in chunks]
    pieces = [p for p in pieces if p]
    # one chunk per block: the first holds the rest of the prompt's block, the others a whole block each
    first = 8 - len(ids) % 8
    assert [len(p) for p in pieces] == [first] + [8] * ((30 - first) // 8) + ([(30 - first) % 8] if (30 - first) % 8
                                                                              else [])
    assert [t for p in pieces for t in p] == res.token_ids
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == full.choices[0].message.content
    assert stats["diffusion"]["block_length"] == 8 and stats["requests_served"] == 2


def test_detokenizer_holds_back_stop_prefixes():
    class Tok:  # one character per token id
        def decode(self, ids, skip_special_tokens=True):
            return "".join(chr(i) for i in ids)

    d = Detokenizer(Tok(), ["END"])
    out = [d.add([ord(c)]) for c in "abcEN"]
    assert "".join(out) == "abc" and not d.stopped  # "EN" may start "END": held back
    assert d.add([ord("D")]) == "" and d.stopped and d.text == "abc"
    d = Detokenizer(Tok(), ["END"])
    out = [d.add([ord(c)]) for c in "abENx"] + [d.finish()]
    assert "".join(out) == d.text == "abENx" and not d.stopped


def test_bench_serve_runs_and_reports(tiny_dirs, capsys, tmp_path):
    out = tmp_path / "serve.md"
    assert main(["bench", "serve", "--model", str(tiny_dirs["qwen3_moe"]), "--clients", "3", "--max-tokens", "4",
                 "--memory-budget", str(BUDGET_GB), "--quiet", "--out", str(out)]) == 0
    report = out.read_text()
    assert report.strip() == capsys.readouterr().out.strip()
    rows = [ln for ln in report.splitlines() if ln.startswith("| concurrent")]
    assert len(rows) == 2 and all("| 3 | 3 | 0 | yes |" in r for r in rows)
    assert "within it" in report and "Command: `moe-offload bench serve" in report
