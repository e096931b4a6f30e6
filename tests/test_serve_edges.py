"""Request edges of ``moe-offload serve`` (issue 34), through both servers (batch 1 and continuous batching) and
both endpoints: sampling settings at their edges (a tiny temperature is greedy, never a 500; top_p 0 / tiny / 1;
top_k), non-finite numbers, optional fields sent as null, ``seed: -1``, lone UTF-16 surrogates, unsupported OpenAI
fields, HEAD and CORS preflight; and the start-up options ``--memory-budget inf`` and a huge ``--max-batch``."""

import asyncio
import json
import urllib.error
import urllib.request

import pytest
import torch

from moe_offload.generation.batching import BatchDecoder, Sequence
from moe_offload.cli import main
from moe_offload.generation.generate import GREEDY_TEMPERATURE, encode_prompt, generate_ids
from moe_offload.models.loader import load_offloaded
from moe_offload.serve.app import create_app
from moe_offload.serve.server import ServeConfig, ServerThread, load_for_serving

SLOTS = 24  # of the tiny Qwen3-MoE's 48 routed experts
CONTEXT = 128
PROMPT = "Hello there, how are you today?"
ENDPOINTS = ("/v1/chat/completions", "/v1/completions")


def _body(path, **kw):
    base = {"model": "tiny", "max_tokens": 6, "return_token_ids": True}
    base |= {"messages": [{"role": "user", "content": PROMPT}]} if "chat" in path else {"prompt": PROMPT}
    return base | kw


def _request(srv, method, path, data: bytes | None = None, headers=None):
    """(status, headers, body bytes) of one HTTP request."""
    req = urllib.request.Request(srv.base_url + path, data=data, method=method,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req) as r:
            return r.status, r.headers, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.headers, e.read()


def _post(srv, path, body) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()  # NaN / Infinity as Python writes them
    code, _, raw = _request(srv, "POST", path, data)
    return code, json.loads(raw)


def _ids(srv, path, **kw) -> list[int]:
    code, r = _post(srv, path, _body(path, **kw))
    assert code == 200, r
    return r["choices"][0]["token_ids"]


def _refused(srv, path, body, param):
    code, r = _post(srv, path, body)
    assert code == 400, r
    assert r["error"]["type"] == "invalid_request_error" and r["error"]["param"] == param, r
    return r["error"]["message"]


def _served(tiny_dirs, **cfg):
    state = load_for_serving(ServeConfig(tiny_dirs["qwen3_moe"], model_name="tiny", slots=SLOTS, max_context=CONTEXT,
                                         **cfg), log=lambda m: None)
    return state, ServerThread(state)


@pytest.fixture(scope="module")
def ref(tiny_dirs):
    return load_offloaded(tiny_dirs["qwen3_moe"], slots=SLOTS, device="cpu", progress=False)


@pytest.fixture(scope="module")
def servers(tiny_dirs):
    """``{"batch1": (state, srv), "batched": (state, srv)}``: the queued worker and the continuous-batching one."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the batch's exact-token rules hold at one intra-op thread
    s1, t1 = _served(tiny_dirs, max_batch=1)
    s2, t2 = _served(tiny_dirs, max_batch=4)
    with t1 as srv1, t2 as srv2:
        assert not hasattr(s1.worker, "max_batch") and s2.worker.max_batch == 4  # queued (batch 1), batching
        yield {"batch1": (s1, srv1), "batched": (s2, srv2)}
    torch.set_num_threads(threads)


def _greedy(ref, path, n=6) -> list[int]:
    ids = encode_prompt(ref.tokenizer, PROMPT) if "chat" in path else ref.tokenizer(PROMPT)["input_ids"]
    return generate_ids(ref, ids, n)[0]


@pytest.mark.parametrize("kind", ["batch1", "batched"])
@pytest.mark.parametrize("path", ENDPOINTS)
def test_temperature_edges_are_greedy_or_sampled_never_500(servers, ref, kind, path):
    _, srv = servers[kind]
    want = _greedy(ref, path)
    for t in (0, 0.0, 1e-40, 5e-324, 1e-30, 1e-6, GREEDY_TEMPERATURE / 2):
        assert _ids(srv, path, temperature=t, seed=1) == want, t
    for t in (GREEDY_TEMPERATURE, 1.0, 2.0):  # sampled, from the request's seed: repeatable
        a = _ids(srv, path, temperature=t, seed=5)
        assert len(a) >= 1 and a == _ids(srv, path, temperature=t, seed=5)
    for t in (-1e-300, 2.0000001, 1e308):
        assert "temperature must be in [0, 2]" in _refused(srv, path, _body(path, temperature=t), "temperature")
    assert _get_stats(srv)["requests_failed"] == 0


@pytest.mark.parametrize("kind", ["batch1", "batched"])
@pytest.mark.parametrize("path", ENDPOINTS)
def test_top_p_edges(servers, ref, kind, path):
    _, srv = servers[kind]
    want = _greedy(ref, path)
    for p in (0, 0.0, 1e-300, 1e-9):  # only the most probable token survives: greedy, even at temperature 2
        assert _ids(srv, path, temperature=2.0, top_p=p, seed=3) == want, p
    assert _ids(srv, path, temperature=1.0, top_p=1, seed=3) == _ids(srv, path, temperature=1.0, seed=3)
    for p in (-1e-9, 1.0000001):
        assert "top_p must be in [0, 1]" in _refused(srv, path, _body(path, top_p=p), "top_p")


def _top_k_reference(ref, path, temperature, top_k, seed):
    """The tokens of one seeded request and the float32 ``[V]`` logits each was chosen from: the shared sampler on
    the reference model, alone (``batching.BatchDecoder``, one row)."""
    ids = encode_prompt(ref.tokenizer, PROMPT) if "chat" in path else ref.tokenizer(PROMPT)["input_ids"]
    dec = BatchDecoder(ref, 1, keep_logits=True)
    seq = Sequence(0, ids, 6, temperature, 1.0, seed, top_k=top_k)
    dec.admit(seq)
    while not dec.done(seq):
        dec.step()
    return seq.new, seq.logits


def _in_top_k(tokens, logits, k) -> bool:
    return all(int(t) in lg.topk(k).indices.tolist() for t, lg in zip(tokens, logits))


@pytest.mark.parametrize("kind", ["batch1", "batched"])
@pytest.mark.parametrize("path", ENDPOINTS)
def test_top_k_on_both_servers(servers, ref, kind, path):
    """Both workers apply ``top_k`` with the shared sampler: 1 is greedy, off values change nothing, k draws only
    among the k most probable tokens, and a seeded request gives the same tokens on either server and on the
    reference model (the batch's exact-token rule at one intra-op thread)."""
    _, srv = servers[kind]
    vocab = int(ref.model.config.vocab_size)
    want = _greedy(ref, path)
    assert _ids(srv, path, temperature=2.0, top_k=1, seed=4) == want
    assert _ids(srv, path, temperature=0, top_k=5) == want  # greedy anyway: top_k changes nothing
    plain = _ids(srv, path, temperature=1.0, seed=4)
    for k in (None, -1, 0, vocab, vocab + 7):  # off
        assert _ids(srv, path, temperature=1.0, top_k=k, seed=4) == plain, k
    got = _ids(srv, path, temperature=2.0, top_k=2, seed=4)
    assert got == _ids(srv, path, temperature=2.0, top_k=2, seed=4)
    new, logits = _top_k_reference(ref, path, 2.0, 2, 4)
    assert got == new and _in_top_k(got, logits, 2)
    other = servers["batch1" if kind == "batched" else "batched"][1]
    assert got == _ids(other, path, temperature=2.0, top_k=2, seed=4)
    plain_new, plain_logits = _top_k_reference(ref, path, 2.0, 0, 4)
    assert not _in_top_k(plain_new, plain_logits, 2)  # without top_k it leaves the top 2: the check has teeth
    assert "top_k must be -1 or 0 (off) or a positive integer" in _refused(srv, path, _body(path, top_k=-2), "top_k")
    assert _refused(srv, path, _body(path, top_k=2.5), "top_k")
    assert _get_stats(srv)["requests_failed"] == 0


NON_FINITE = [b"NaN", b"Infinity", b"-Infinity", b"1e999"]


@pytest.mark.parametrize("path", ENDPOINTS)
@pytest.mark.parametrize("field", ["temperature", "top_p", "presence_penalty", "frequency_penalty", "max_tokens",
                                   "top_k", "seed", "n"])
def test_non_finite_numbers_are_400_naming_the_field(servers, path, field):
    _, srv = servers["batch1"]
    before = _get_stats(srv)
    for literal in NON_FINITE:
        body = json.dumps(_body(path, **{field: 12345})).encode().replace(b"12345", literal)
        msg = _refused(srv, path, body, field)
        assert msg.startswith(f"{field}: ")
    after = _get_stats(srv)
    assert (after["requests_served"], after["requests_failed"]) == (before["requests_served"],
                                                                   before["requests_failed"])


OPTIONAL_COMMON = ["max_tokens", "temperature", "top_p", "top_k", "stop", "seed", "stream", "stream_options", "n",
                   "user", "presence_penalty", "frequency_penalty", "logit_bias", "response_format",
                   "return_token_ids"]
OPTIONAL_CHAT = ["max_completion_tokens", "logprobs", "top_logprobs", "tools", "tool_choice", "functions",
                 "function_call"]
OPTIONAL_COMPLETIONS = ["echo", "logprobs", "suffix", "best_of"]


@pytest.mark.parametrize("kind", ["batch1", "batched"])
@pytest.mark.parametrize("path", ENDPOINTS)
def test_every_optional_field_accepts_null(servers, ref, kind, path):
    _, srv = servers[kind]
    names = OPTIONAL_COMMON + (OPTIONAL_CHAT if "chat" in path else OPTIONAL_COMPLETIONS)
    body = _body(path) | dict.fromkeys(names) | {"max_tokens": 6}
    if "chat" in path:
        body["messages"] = [{"role": "user", "content": PROMPT, "name": None}]
    code, r = _post(srv, path, body)
    assert code == 200, r
    text = r["choices"][0]["message"]["content"] if "chat" in path else r["choices"][0]["text"]
    assert text == ref.tokenizer.decode(_greedy(ref, path), skip_special_tokens=True)
    assert "token_ids" not in r["choices"][0]  # return_token_ids null: not set
    for name in names:  # one at a time too, with a streamed request for stream null
        code, r = _post(srv, path, _body(path) | {name: None})  # max_tokens null: the rest of the context
        assert code == 200, (name, r)
    code, _, raw = _request(srv, "POST", path, json.dumps(_body(path, stream=True,
                                                                stream_options={"include_usage": None})).encode())
    assert code == 200 and raw.rstrip().endswith(b"data: [DONE]") and b'"usage"' not in raw


@pytest.mark.parametrize("kind", ["batch1", "batched"])
@pytest.mark.parametrize("path", ENDPOINTS)
def test_seed_minus_one_is_no_seed(servers, ref, kind, path):
    _, srv = servers[kind]
    assert len(_ids(srv, path, temperature=1.0, seed=-1)) >= 1
    assert _ids(srv, path, temperature=0, seed=-1) == _greedy(ref, path)
    for s in (-2, -(2**40)):
        assert "or -1: no seed" in _refused(srv, path, _body(path, seed=s), "seed")


SURROGATE = "emoji \ud83d"
SURROGATE_CASES = [  # (endpoint, fields to merge into the body, param named in the 400)
    ("/v1/completions", {"prompt": SURROGATE}, "prompt"),
    ("/v1/completions", {"prompt": [SURROGATE]}, "prompt.0"),
    ("/v1/completions", {"suffix": "\udc00"}, "suffix"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": SURROGATE}]}, "messages.0.content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": SURROGATE}]}]},
     "messages.0.content.0.text"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi", "name": "\ud800x"}]},
     "messages.0.name"),
    ("/v1/chat/completions", {"stop": SURROGATE}, "stop"),
    ("/v1/chat/completions", {"stop": ["ok", SURROGATE]}, "stop.1"),
    ("/v1/chat/completions", {"user": SURROGATE}, "user"),
    ("/v1/chat/completions", {"model": "tiny\ud83d"}, "model"),
    ("/v1/completions", {"model": "\udfff"}, "model"),
]


@pytest.mark.parametrize("kind", ["batch1", "batched"])
@pytest.mark.parametrize("path,fields,param", SURROGATE_CASES)
def test_lone_surrogates_are_400_naming_the_field(servers, kind, path, fields, param):
    _, srv = servers[kind]
    body = json.dumps(_body(path) | fields).encode()  # ensure_ascii: the lone surrogate travels as \udxxx
    assert b"\\ud" in body
    msg = _refused(srv, path, body, param)
    assert "lone UTF-16 surrogate" in msg and msg.startswith(f"{param}: ")
    assert _get_stats(srv)["requests_failed"] == 0


UNSUPPORTED = [  # (endpoint, fields, param)
    ("/v1/chat/completions", {"response_format": {"type": "json_object"}}, "response_format"),
    ("/v1/completions", {"response_format": {"type": "json_schema", "json_schema": {}}}, "response_format"),
    ("/v1/chat/completions", {"response_format": "json"}, "response_format"),  # not an object: a type error
    # tools and tool_choice are served: tests/test_serve_tools.py
    ("/v1/chat/completions", {"functions": [{"name": "f", "parameters": {}}]}, "functions"),
    ("/v1/chat/completions", {"function_call": "auto"}, "function_call"),
    ("/v1/chat/completions", {"logprobs": True}, "logprobs"),
    ("/v1/chat/completions", {"top_logprobs": 0}, "top_logprobs"),
    ("/v1/completions", {"logprobs": 0}, "logprobs"),
    ("/v1/completions", {"logprobs": 5}, "logprobs"),
    ("/v1/completions", {"echo": True}, "echo"),
    ("/v1/completions", {"suffix": "end"}, "suffix"),
    ("/v1/completions", {"best_of": 2}, "best_of"),
    ("/v1/chat/completions", {"presence_penalty": 0.5}, "presence_penalty"),
    ("/v1/chat/completions", {"n": 2}, "n"),
]


@pytest.mark.parametrize("path,fields,param", UNSUPPORTED)
def test_unsupported_fields_are_400_naming_the_field(servers, path, fields, param):
    _, srv = servers["batch1"]
    msg = _refused(srv, path, _body(path, **fields), param)
    assert param in msg and ("supported" in msg or "Input should be a valid dictionary" in msg)


@pytest.mark.parametrize("path,fields", [
    ("/v1/chat/completions", {"response_format": {"type": "text"}}),
    ("/v1/completions", {"response_format": {"type": "text"}}),
    ("/v1/chat/completions", {"tools": [], "functions": [], "logprobs": False}),
    ("/v1/completions", {"echo": False, "suffix": "", "best_of": 1}),
])
def test_explicitly_unset_fields_are_served(servers, ref, path, fields):
    _, srv = servers["batch1"]
    assert _ids(srv, path, **fields) == _greedy(ref, path)


def _get_stats(srv):
    code, _, raw = _request(srv, "GET", "/v1/stats")
    assert code == 200
    return json.loads(raw)


@pytest.mark.parametrize("path", ["/health", "/v1/models", "/v1/stats"])
def test_head_answers_where_get_does(servers, path):
    _, srv = servers["batch1"]
    code, headers, raw = _request(srv, "HEAD", path)
    assert code == 200 and raw == b"" and headers["content-type"] == "application/json"
    assert _request(srv, "GET", path)[0] == 200


def test_cors_preflight_and_cross_origin_requests(servers, ref):
    _, srv = servers["batch1"]
    for path in ENDPOINTS + ("/v1/models",):
        code, headers, _ = _request(srv, "OPTIONS", path, headers={
            "Origin": "http://localhost:3000", "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type"})
        assert code == 200 and headers["access-control-allow-origin"] == "*"
        assert "POST" in headers["access-control-allow-methods"]
        assert "authorization" in headers["access-control-allow-headers"].lower()
        assert "access-control-allow-credentials" not in headers
    path = "/v1/completions"
    code, headers, raw = _request(srv, "POST", path, json.dumps(_body(path)).encode(),
                                  headers={"Origin": "http://localhost:3000"})
    assert code == 200 and headers["access-control-allow-origin"] == "*"
    assert json.loads(raw)["choices"][0]["token_ids"] == _greedy(ref, path)


def _asgi(app, method, path, headers) -> tuple[int, dict]:
    """One request straight into the ASGI app (no server, no lifespan): (status, response headers)."""
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "path": path,
             "raw_path": path.encode(), "query_string": b"", "root_path": "", "scheme": "http",
             "server": ("test", 80), "client": ("test", 1),
             "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()]}
    sent = []

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(msg):
        sent.append(msg)

    asyncio.run(app(scope, receive, send))
    start = next(m for m in sent if m["type"] == "http.response.start")
    return start["status"], {k.decode(): v.decode() for k, v in start["headers"]}


def test_cors_origins_can_be_named_or_switched_off(servers):
    state, _ = servers["batch1"]
    pre = {"Origin": "http://ui.example", "Access-Control-Request-Method": "POST"}
    saved = state.cors_origins
    try:
        state.cors_origins = ("http://ui.example",)
        app = create_app(state)
        code, headers = _asgi(app, "OPTIONS", "/v1/chat/completions", pre)
        assert code == 200 and headers["access-control-allow-origin"] == "http://ui.example"
        code, headers = _asgi(app, "OPTIONS", "/v1/chat/completions", dict(pre, Origin="http://evil.example"))
        assert code == 400 and "access-control-allow-origin" not in headers
        state.cors_origins = ()
        code, headers = _asgi(create_app(state), "OPTIONS", "/v1/chat/completions", pre)
        assert code == 405 and "access-control-allow-origin" not in headers
    finally:
        state.cors_origins = saved


@pytest.mark.parametrize("argv,needle", [
    (["--memory-budget", "inf"], "argument --memory-budget: expected a finite number, got 'inf'"),
    (["--memory-budget", "nan"], "argument --memory-budget: expected a finite number, got 'nan'"),
    (["--residency=-inf"], "argument --residency: expected a finite number, got '-inf'"),
])
def test_non_finite_serve_options_are_one_line_errors(tiny_dirs, capsys, argv, needle):
    with pytest.raises(SystemExit) as ex:
        main(["serve", "--model", str(tiny_dirs["qwen3_moe"]), "--port", "0", "--quiet", *argv])
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert ex.value.code == 2 and needle in lines[-1] and "Traceback" not in "".join(lines)


def test_non_finite_budget_in_the_config_is_a_clear_error(tiny_dirs):
    from moe_offload.errors import MoeOffloadError

    for gb in (float("inf"), float("nan")):
        with pytest.raises(MoeOffloadError, match="--memory-budget must be a finite number > 0 GB"):
            load_for_serving(ServeConfig(tiny_dirs["qwen3_moe"], memory_budget_gb=gb), log=lambda m: None)


@pytest.mark.parametrize("argv,needle", [
    (["--memory-budget", "0.0048", "--max-batch", "1000000"],
     r"--max-batch 1000000 needs .* GB of KV cache at --max-context 512 \(.* MB per request\), more than the "
     r"--memory-budget of 0\.0048 GB leaves"),
    (["--residency", "1.0", "--max-batch", str(10**9)],
     r"--max-batch 1000000000 needs .* GB of KV cache at --max-context 512 .* more than the .* GB free on cpu"),
])
def test_huge_max_batch_is_refused_before_allocating(tiny_dirs, capsys, monkeypatch, argv, needle):
    import re

    import moe_offload.serve.batch_memory as bm

    def never(*a, **k):
        raise AssertionError("the batch KV cache was allocated before the check")

    monkeypatch.setattr(bm, "profile_batch_decode", never)
    assert main(["serve", "--model", str(tiny_dirs["qwen3_moe"]), "--port", "0", "--quiet", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("moe-offload: error: ") and re.search(needle, err[-1]), err[-1]
    assert "Traceback" not in "".join(err)


def test_diffusion_server_sampling_edges(tiny_dirs):
    """The diffusion loop samples with the shared sampler too, and the request edge hands it the settings as sent:
    a tiny temperature and ``top_k`` 1 are greedy, ``top_p`` 0 keeps the most probable token (confidence 1, so each
    block commits at once: greedy at one step per block), ``top_k`` is served; 200s, never 500s."""
    from moe_offload.generation.diffusion import diffusion_generate_ids

    d = tiny_dirs["llada2_moe"]
    state = load_for_serving(ServeConfig(d, model_name="tiny", block_length=8, steps=4, max_context=64,
                                         residency=0.5), log=lambda m: None)
    ref = load_offloaded(d, slots=state.plan.slots, device="cpu", progress=False)
    path = "/v1/completions"
    ids = ref.tokenizer(PROMPT)["input_ids"]

    def direct(**kw):
        kw = {"block_length": 8, "steps": 4, "threshold": 0.95} | kw
        return diffusion_generate_ids(ref, ids, 6, **kw).token_ids

    want = direct()
    with ServerThread(state) as srv:
        for t in (0, 1e-40, 5e-324, GREEDY_TEMPERATURE / 2):
            assert _ids(srv, path, temperature=t) == want, t
        assert _ids(srv, path, temperature=2.0, top_k=1, seed=2) == want
        for p in (0, 1e-300):
            assert _ids(srv, path, temperature=1.0, top_p=p, seed=2) == direct(steps=1), p
        assert len(_ids(srv, path, temperature=2.0, top_p=1, seed=2, top_k=-1)) >= 1
        assert _ids(srv, path, temperature=1.0, top_k=3, seed=2) == direct(temperature=1.0, top_k=3, seed=2)
        assert _get_stats(srv)["requests_failed"] == 0
