"""``POST /v1/messages``: the Anthropic Messages API, driven by the official ``anthropic`` client against a server
started in-process on a free loopback port (tiny random Qwen3-MoE), and compared token for token with the same
server's ``/v1/chat/completions`` (the one generation path). The installed client (2.x) no longer takes
``temperature`` / ``top_p`` / ``top_k`` as arguments; they go in ``extra_body``, as the HTTP API takes them."""

import asyncio
import json
import urllib.error
import urllib.request

import anthropic
import openai
import pytest

from moe_offload.serve.anthropic_api import error_response
from moe_offload.serve.anthropic_stream import stream_events
from moe_offload.serve.server import ServeConfig, ServerThread, load_for_serving
from moe_offload.serve.jobs import Delta, Done, Failed, Job, Params

PROMPT = "Hello there, how are you today?"
MODEL = "tiny-qwen"
#: a minimal chat template (the tiny model ships none)
TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}<|end|>{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")
ORDER = ["message_start", "content_block_start", "ping", "content_block_delta", "content_block_stop",
         "message_delta", "message_stop"]


@pytest.fixture(scope="module")
def srv(tiny_dirs):
    """A served tiny Qwen3-MoE (batch 1, 256 tokens of context) with an ``anthropic`` and an ``openai`` client."""
    state = load_for_serving(ServeConfig(tiny_dirs["qwen3_moe"], model_name=MODEL, max_context=256, max_batch=1),
                             log=lambda m: None)
    with ServerThread(state) as server:
        ac = anthropic.Anthropic(base_url=server.base_url, api_key="none", max_retries=0, timeout=60)
        oc = openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0, timeout=60)
        yield state, server, ac, oc
        ac.close()
        oc.close()


def _msg(ac, max_tokens=12, messages=None, **kw):
    return ac.messages.create(model=MODEL, max_tokens=max_tokens,
                              messages=messages or [{"role": "user", "content": PROMPT}],
                              extra_body={"return_token_ids": True, "temperature": 0}, **kw)


def _chat(oc, max_tokens=12, messages=None, **kw):
    return oc.chat.completions.create(model=MODEL, max_tokens=max_tokens, temperature=0,
                                      messages=messages or [{"role": "user", "content": PROMPT}],
                                      extra_body={"return_token_ids": True}, **kw).choices[0]


def _post(server, body, raw: bytes | None = None):
    """POST ``/v1/messages``; returns (status, parsed JSON body) for a non-streamed answer."""
    req = urllib.request.Request(server.base_url + "/v1/messages", data=raw or json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _sse(server, body) -> list[tuple[str, dict]]:
    """``(event name, data)`` of every server-sent event of a streamed request, as sent (``ping`` included)."""
    req = urllib.request.Request(server.base_url + "/v1/messages", data=json.dumps(dict(body, stream=True)).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req) as r:
        text = r.read().decode()
    out = []
    for block in filter(None, text.split("\n\n")):
        fields = dict(line.split(": ", 1) for line in block.splitlines())
        out.append((fields["event"], json.loads(fields["data"])))
    return out


def test_message_equals_the_chat_completion(srv):
    state, server, ac, oc = srv
    m = _msg(ac, metadata={"user_id": "u-1"})
    c = _chat(oc)
    assert m.id.startswith("msg_") and m.type == "message" and m.role == "assistant" and m.model == MODEL
    assert len(c.token_ids) == 12 and c.finish_reason == "length"
    assert m.model_extra["token_ids"] == c.token_ids
    assert [(b.type, b.text) for b in m.content] == [("text", c.message.content)]
    assert (m.stop_reason, m.stop_sequence) == ("max_tokens", None)
    ids = state.encode_messages([{"role": "user", "content": PROMPT}])
    assert (m.usage.input_tokens, m.usage.output_tokens) == (len(ids), 12)


def test_stream_event_order_and_tokens(srv):
    state, server, ac, oc = srv
    full = _msg(ac, max_tokens=16)
    events = _sse(server, {"model": MODEL, "max_tokens": 16, "temperature": 0, "return_token_ids": True,
                           "messages": [{"role": "user", "content": PROMPT}]})
    names = [n for n, _ in events]
    assert all(d["type"] == n for n, d in events)
    deltas = names.count("content_block_delta")
    assert deltas >= 2 and names == ORDER[:3] + ["content_block_delta"] * deltas + ORDER[4:]
    start = events[0][1]["message"]
    assert (start["id"][:4], start["role"], start["content"], start["stop_reason"]) == ("msg_", "assistant", [], None)
    assert start["usage"] == {"input_tokens": full.usage.input_tokens, "output_tokens": 0}
    body = [d for n, d in events if n == "content_block_delta"]
    assert all(d["index"] == 0 and d["delta"]["type"] == "text_delta" for d in body)
    assert "".join(d["delta"]["text"] for d in body) == full.content[0].text
    assert [t for d in body for t in d["token_ids"]] == full.model_extra["token_ids"]
    end = events[-2][1]
    assert end["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert end["usage"]["output_tokens"] == 16
    streamed_chat = oc.chat.completions.create(model=MODEL, max_tokens=16, temperature=0, stream=True,
                                               messages=[{"role": "user", "content": PROMPT}],
                                               extra_body={"return_token_ids": True})
    chat_ids = [t for ch in streamed_chat if ch.choices for t in (getattr(ch.choices[0], "token_ids", None) or [])]
    assert chat_ids == full.model_extra["token_ids"]


def test_stream_through_the_client(srv):
    state, server, ac, oc = srv
    full = _msg(ac, max_tokens=10)
    kinds = [e.type for e in ac.messages.create(model=MODEL, max_tokens=10, stream=True, extra_body={"temperature": 0},
                                                messages=[{"role": "user", "content": PROMPT}])]
    assert kinds[:2] == ["message_start", "content_block_start"] and kinds[-3:] == ORDER[4:]
    with ac.messages.stream(model=MODEL, max_tokens=10, extra_body={"temperature": 0},
                            messages=[{"role": "user", "content": PROMPT}]) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    assert text == final.content[0].text == full.content[0].text
    assert (final.stop_reason, final.usage.output_tokens) == ("max_tokens", 10)


def test_system_prompt_as_string_and_as_blocks(srv):
    state, server, ac, oc = srv
    turns = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
             {"role": "user", "content": [{"type": "text", "text": "What is "}, {"type": "text", "text": "MoE?"}]}]
    as_string = _msg(ac, messages=turns, system="You are terse.")
    as_blocks = _msg(ac, messages=turns, system=[{"type": "text", "text": "You are "},
                                                 {"type": "text", "text": "terse."}])
    chat = _chat(oc, messages=[{"role": "system", "content": "You are terse."}, turns[0], turns[1],
                               {"role": "user", "content": "What is MoE?"}])
    assert as_string.model_extra["token_ids"] == as_blocks.model_extra["token_ids"] == chat.token_ids
    assert as_string.content[0].text == as_blocks.content[0].text == chat.message.content
    without = _msg(ac, messages=turns)
    sys_ids = state.encode_messages([{"role": "system", "content": "You are terse."}] +
                                    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
                                     {"role": "user", "content": "What is MoE?"}])
    assert as_string.usage.input_tokens == as_blocks.usage.input_tokens == len(sys_ids)
    assert without.usage.input_tokens < len(sys_ids)


def test_stop_sequences(srv):
    state, server, ac, oc = srv
    full = _msg(ac, max_tokens=24).content[0].text
    # a two-character (else one-character) stop string without replacement characters, first occurring after the
    # start (random byte-level text has few clean windows)
    i, n = next((i, n) for n in (2, 1) for i in range(1, len(full) - n + 1)
                if "\ufffd" not in full[i:i + n] and full.find(full[i:i + n]) == i)
    stop = full[i:i + n]
    m = _msg(ac, max_tokens=24, stop_sequences=["\x00never", stop])
    assert (m.content[0].text, m.stop_reason, m.stop_sequence) == (full[:i], "stop_sequence", stop)
    events = _sse(server, {"model": MODEL, "max_tokens": 24, "temperature": 0, "stop_sequences": [stop],
                           "messages": [{"role": "user", "content": PROMPT}]})
    assert "".join(d["delta"]["text"] for n, d in events if n == "content_block_delta") == full[:i]
    assert events[-2][1]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": stop}


def test_max_tokens_and_sampling(srv):
    state, server, ac, oc = srv
    m = _msg(ac, max_tokens=3)
    assert (m.stop_reason, m.usage.output_tokens, len(m.model_extra["token_ids"])) == ("max_tokens", 3, 3)
    sampled = ac.messages.create(model=MODEL, max_tokens=8, messages=[{"role": "user", "content": PROMPT}],
                                 extra_body={"return_token_ids": True, "seed": 5, "temperature": 0.9, "top_p": 0.8,
                                             "top_k": 20})
    chat = oc.chat.completions.create(model=MODEL, max_tokens=8, messages=[{"role": "user", "content": PROMPT}],
                                      temperature=0.9, top_p=0.8, seed=5,
                                      extra_body={"return_token_ids": True, "top_k": 20}).choices[0]
    greedy = _chat(oc, max_tokens=8)
    assert sampled.model_extra["token_ids"] == chat.token_ids != greedy.token_ids
    assert sampled.content[0].text == chat.message.content


def _error(status, body, kind, contains):
    assert body["type"] == "error" and body["error"]["type"] == kind, body
    assert contains in body["error"]["message"], body
    assert set(body) == {"type", "error"} and set(body["error"]) == {"type", "message"}


def test_errors_in_anthropic_shape(srv):
    state, server, ac, oc = srv
    user = [{"role": "user", "content": PROMPT}]
    status, body = _post(server, {"model": MODEL, "messages": user})
    assert status == 400
    _error(status, body, "invalid_request_error", "max_tokens: Field required")
    cases = [({"model": "nope"}, 404, "not_found_error", "`nope` does not exist"),
             ({"temperature": 1.5}, 400, "invalid_request_error", "temperature: must be in [0, 1], got 1.5"),
             ({"tools": [{"name": "f", "input_schema": {"type": "object"}}]}, 400, "invalid_request_error", "tools"),
             ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, 400, "invalid_request_error", "thinking"),
             ({"max_tokens": 0}, 400, "invalid_request_error", "max_tokens must be at least 1"),
             ({"max_tokens": 10_000}, 400, "invalid_request_error", "maximum context length is 256"),
             ({"top_k": -2}, 400, "invalid_request_error", "top_k"),
             ({"stop_sequences": [""]}, 400, "invalid_request_error", "stop_sequences"),
             ({"max_tokens": "5"}, 400, "invalid_request_error", "max_tokens"),
             ({"messages": []}, 400, "invalid_request_error", "at least one message"),
             ({"messages": user + [{"role": "assistant", "content": "Sure "}]}, 400, "invalid_request_error",
              "trailing whitespace"),
             ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, 400,
              "invalid_request_error", "'image' are not supported")]
    for change, want_status, kind, contains in cases:
        status, body = _post(server, {"model": MODEL, "max_tokens": 8, "messages": user} | change)
        assert status == want_status, (change, body)
        _error(status, body, kind, contains)
    status, body = _post(server, None, raw=b"{not json")
    assert status == 400
    _error(status, body, "invalid_request_error", "not valid JSON")


def test_prefill_continues_the_assistants_start(srv):
    """A final assistant message is a prefill: the answer is the continuation only, token for token what the model
    generates after the template's rendering of the conversation with that start (``continue_final_message``)."""
    from moe_offload.generation.generate import generate_ids

    state, server, ac, oc = srv
    start = "Sure, here is"
    turns = [{"role": "user", "content": PROMPT}, {"role": "assistant", "content": start}]
    tok = state.lm.tokenizer
    for template in (None, TEMPLATE):   # the tiny model has none: "role: text" lines; then a chat template
        tok.chat_template = template
        try:
            m = _msg(ac, max_tokens=6, messages=turns)
            if template is None:
                ids = tok(f"user: {PROMPT}\nassistant: {start}")["input_ids"]
            else:
                ids = tok.apply_chat_template(turns, continue_final_message=True, tokenize=True)
                ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
            assert tok.decode(ids).endswith(start)
            want, *_ = generate_ids(state.lm, ids, 6)
            assert m.token_ids == want and m.usage.input_tokens == len(ids)
        finally:
            tok.chat_template = None
    # an empty final assistant message: an ordinary turn
    plain = _msg(ac, max_tokens=6, messages=[{"role": "user", "content": PROMPT}])
    empty = _msg(ac, max_tokens=6, messages=[{"role": "user", "content": PROMPT}, {"role": "assistant", "content": ""}])
    assert empty.token_ids == plain.token_ids


def test_count_tokens_equals_the_prompt_tokens_of_the_request(srv):
    """``/v1/messages/count_tokens`` through the official client: the prompt tokens ``/v1/messages`` then reports
    in ``usage.input_tokens``, a system prompt and a prefill included; the same refusals in the same shape; the
    ``anthropic-beta`` header accepted."""
    state, server, ac, oc = srv
    convs = [dict(messages=[{"role": "user", "content": PROMPT}]),
             dict(messages=[{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
                            {"role": "user", "content": PROMPT}], system="Be brief."),
             dict(messages=[{"role": "user", "content": PROMPT}, {"role": "assistant", "content": "Well"}])]
    for conv in convs:
        counted = ac.messages.count_tokens(model=MODEL, **conv, extra_headers={"anthropic-beta": "tools-2024-04-04"})
        assert counted.input_tokens == _msg(ac, max_tokens=2, **conv).usage.input_tokens > 0
    with pytest.raises(anthropic.BadRequestError, match="has no chat template, so it cannot be told of tools"):
        ac.messages.count_tokens(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                 tools=[{"name": "f", "input_schema": {"type": "object"}}])
    with pytest.raises(anthropic.NotFoundError):
        ac.messages.count_tokens(model="nope", messages=[{"role": "user", "content": "x"}])


def test_errors_through_the_client(srv):
    state, server, ac, oc = srv
    with pytest.raises(anthropic.NotFoundError) as e:
        ac.messages.create(model="nope", max_tokens=4, messages=[{"role": "user", "content": "x"}])
    assert e.value.status_code == 404 and e.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError) as e:
        ac.messages.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "x"}],
                           extra_body={"temperature": 1.5})
    assert e.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.BadRequestError):
        ac.messages.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "x"}],
                           tools=[{"name": "f", "description": "d", "input_schema": {"type": "object"}}])


def test_engine_failure_is_an_api_error(srv, monkeypatch):
    state, server, ac, oc = srv

    def boom(msgs, continue_final=False):
        raise RuntimeError("kaput")

    monkeypatch.setattr(state, "encode_messages", boom)
    status, body = _post(server, {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "x"}]})
    assert status == 500
    _error(status, body, "api_error", "RuntimeError: kaput")


def test_error_types_and_a_failed_stream():
    for status, kind in [(400, "invalid_request_error"), (404, "not_found_error"), (500, "api_error"),
                         (503, "overloaded_error"), (529, "overloaded_error"), (422, "invalid_request_error")]:
        r = error_response(status, "m")
        assert r.status_code == status and json.loads(r.body) == {"type": "error",
                                                                  "error": {"type": kind, "message": "m"}}

    class _State:
        model_name = MODEL
        worker = None

    async def run(final):
        job = Job([1, 2, 3], Params(max_tokens=4), asyncio.get_running_loop())
        for ev in (Delta("ab", [7]), final):
            job.events.put_nowait(ev)
        return [chunk.decode() async for chunk in stream_events(_State(), job, "msg_x", False)]

    failed = asyncio.run(run(Failed("the server is shutting down", 503, "server_shutting_down")))
    assert [c.split("\n")[0] for c in failed] == ["event: " + n for n in ORDER[:4]] + ["event: error"]
    assert json.loads(failed[-1].split("data: ")[1]) == {
        "type": "error", "error": {"type": "overloaded_error", "message": "the server is shutting down"}}
    done = asyncio.run(run(Done("stop", "ab", [7, 2], 3, 0.0, 0.0, 0.0)))
    assert [c.split("\n")[0] for c in done] == ["event: " + n for n in ORDER]
    assert json.loads(done[-2].split("data: ")[1])["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}
