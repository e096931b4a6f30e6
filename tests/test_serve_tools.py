"""Tool calls through both APIs (issue 48): an agent loop (user -> tool call -> tool result -> answer) driven by the
official ``openai`` and ``anthropic`` clients, streamed and not, against a served tiny Qwen3-MoE with its experts
offloaded; the answers' tokens equal FullLoad's for the same prompt. The tiny random model cannot write a call, so
the turns that must be one are scripted (``script``: the worker's generation replaced by fixed text for one
request); the rest is the model's own generation. The tokenizer gets a chat template that renders tools in the
Hermes format (the tiny model ships none)."""

import json
import urllib.error
import urllib.request

import anthropic
import openai
import pytest

import moe_offload.serve.worker as worker_mod
from moe_offload.generation.generate import generate_ids
from moe_offload.models.loader import load_full
from moe_offload.serve.server import ServeConfig, ServerThread, load_for_serving

MODEL = "tiny-qwen"
#: a Hermes-style chat template that renders tools, an assistant's earlier calls and tool results
TOOLS_TEMPLATE = (
    "{% if tools %}<|system|>You may call these tools:{% for t in tools %}\n{{ t | tojson }}{% endfor %}<|end|>"
    "{% endif %}{% for m in messages %}"
    "{% if m.role == 'assistant' and m.tool_calls %}<|assistant|>{{ m.content }}{% for c in m.tool_calls %}"
    "<tool_call>\n{{ {'name': c.function.name, 'arguments': c.function.arguments} | tojson }}\n</tool_call>"
    "{% endfor %}<|end|>{% elif m.role == 'tool' %}<|tool|>{{ m.content }}<|end|>"
    "{% else %}<|{{ m.role }}|>{{ m.content }}<|end|>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}")
PLAIN_TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}<|end|>{% endfor %}"
                  "{% if add_generation_prompt %}<|assistant|>{% endif %}")
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
A_WEATHER = {"name": "get_weather", "description": "The weather of a city",
             "input_schema": WEATHER["function"]["parameters"]}
CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
QUESTION = "What is the weather in Paris?"


@pytest.fixture(scope="module")
def srv(tiny_dirs):
    """The served model (offloaded, 60% of its experts in slots), FullLoad of the same checkpoint, both clients."""
    state = load_for_serving(ServeConfig(tiny_dirs["qwen3_moe"], model_name=MODEL, max_context=512, max_batch=1,
                                         residency=0.6, chat_template=TOOLS_TEMPLATE), log=lambda m: None)
    full = load_full(tiny_dirs["qwen3_moe"])
    with ServerThread(state) as server:
        ac = anthropic.Anthropic(base_url=server.base_url, api_key="none", max_retries=0, timeout=60)
        oc = openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0, timeout=60)
        yield state, server, ac, oc, full
        ac.close()
        oc.close()
    state.lm.tokenizer.chat_template = None


@pytest.fixture
def script(srv, monkeypatch):
    """``script(text)``: the next request's answer is ``text`` (then EOS) instead of the model's generation; the
    prompt each request got is kept in ``script.prompts``."""
    state = srv[0]
    tok = state.lm.tokenizer
    real = worker_mod.generate_ids
    queued: list[str] = []
    prompts: list[list[int]] = []

    def fake(lm, prompt_ids, max_new, on_token=None, **kw):
        prompts.append(list(prompt_ids))
        if not queued:
            return real(lm, prompt_ids, max_new, on_token=on_token, **kw)
        ids = tok.encode(queued.pop(0), add_special_tokens=False) + [min(state.worker.eos)]
        for t in ids:
            on_token(t)
        return ids, 0.0, 0.0

    def add(text: str) -> None:
        queued.append(text)

    monkeypatch.setattr(worker_mod, "generate_ids", fake)
    add.prompts = prompts  # type: ignore[attr-defined]
    return add


def _full_tokens(srv, prompt_ids, n):
    """FullLoad's greedy tokens for the prompt."""
    return generate_ids(srv[4], prompt_ids, n)[0]


def test_openai_agent_loop(srv, script):
    state, server, ac, oc, full = srv
    for stream in (False, True):
        msgs = [{"role": "user", "content": QUESTION}]
        script(f"Let me check.\n{CALL_TEXT}")
        if stream:
            chunks = list(oc.chat.completions.create(model=MODEL, messages=msgs, tools=[WEATHER], stream=True,
                                                     max_tokens=40))
            calls = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])] if chunks else []
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            finish = chunks[-1].choices[0].finish_reason
            call_id, name, args = calls[0].id, calls[0].function.name, calls[0].function.arguments
            assert calls[0].index == 0 and len(calls) == 1
        else:
            r = oc.chat.completions.create(model=MODEL, messages=msgs, tools=[WEATHER], max_tokens=40).choices[0]
            text, finish = r.message.content, r.finish_reason
            tc = r.message.tool_calls[0]
            call_id, name, args = tc.id, tc.function.name, tc.function.arguments
            assert len(r.message.tool_calls) == 1
        assert text.strip() == "Let me check." and finish == "tool_calls"
        assert name == "get_weather" and json.loads(args) == {"city": "Paris"} and call_id.startswith("call_")
        tok = state.lm.tokenizer
        rendered = tok.decode(script.prompts[-1])
        assert '"name": "get_weather"' in rendered and rendered.endswith("<|assistant|>")
        # the tool result goes back; the answer is the model's own, FullLoad's tokens for the same prompt
        msgs += [{"role": "assistant", "content": "Let me check.",
                  "tool_calls": [{"id": call_id, "type": "function",
                                  "function": {"name": name, "arguments": args}}]},
                 {"role": "tool", "tool_call_id": call_id, "content": "Sunny, 21 C"}]
        r = oc.chat.completions.create(model=MODEL, messages=msgs, tools=[WEATHER], max_tokens=8, temperature=0,
                                       extra_body={"return_token_ids": True}).choices[0]
        prompt = script.prompts[-1]
        assert "<|tool|>Sunny, 21 C<|end|>" in tok.decode(prompt) and "<tool_call>" in tok.decode(prompt)
        assert r.token_ids == _full_tokens(srv, prompt, 8)
        assert r.finish_reason in ("stop", "length") and not r.message.tool_calls


def test_anthropic_agent_loop(srv, script):
    state, server, ac, oc, full = srv
    for stream in (False, True):
        msgs = [{"role": "user", "content": QUESTION}]
        script(CALL_TEXT)
        if stream:
            with ac.messages.stream(model=MODEL, max_tokens=40, messages=msgs, tools=[A_WEATHER]) as s:
                kinds = [e.type for e in s]
                m = s.get_final_message()
            assert "input_json" in kinds
        else:
            m = ac.messages.create(model=MODEL, max_tokens=40, messages=msgs, tools=[A_WEATHER])
        assert m.stop_reason == "tool_use"
        assert [b.type for b in m.content] == ["tool_use"]
        use = m.content[0]
        assert use.name == "get_weather" and use.input == {"city": "Paris"} and use.id.startswith("toolu_")
        msgs += [{"role": "assistant", "content": [b.model_dump() for b in m.content]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                               "content": [{"type": "text", "text": "Sunny, 21 C"}]}]}]
        n = ac.messages.count_tokens(model=MODEL, messages=msgs, tools=[A_WEATHER]).input_tokens
        m = ac.messages.create(model=MODEL, max_tokens=8, messages=msgs, tools=[A_WEATHER],
                               extra_body={"return_token_ids": True, "temperature": 0})
        prompt = script.prompts[-1]
        assert m.usage.input_tokens == n == len(prompt)
        assert "<|tool|>Sunny, 21 C<|end|>" in state.lm.tokenizer.decode(prompt)
        assert m.model_extra["token_ids"] == _full_tokens(srv, prompt, 8)
        assert m.stop_reason in ("end_turn", "max_tokens")


def test_tool_choice(srv, script):
    """none: the tools are neither rendered nor parsed (the prompt of the same request without tools); a named
    tool and required / any: generation starts at the call's opening, which the parser continues."""
    state, server, ac, oc, full = srv
    tok = state.lm.tokenizer
    msgs = [{"role": "user", "content": QUESTION}]
    script(CALL_TEXT)
    r = oc.chat.completions.create(model=MODEL, messages=msgs, tools=[WEATHER], tool_choice="none",
                                   max_tokens=40).choices[0]
    assert r.finish_reason == "stop" and r.message.content == CALL_TEXT and not r.message.tool_calls
    no_tools = oc.chat.completions.create(model=MODEL, messages=msgs, max_tokens=1)
    assert script.prompts[-1] == script.prompts[-2]
    assert no_tools.choices[0].finish_reason in ("stop", "length")
    script('{"city": "Rome"}}\n</tool_call>')
    r = oc.chat.completions.create(model=MODEL, messages=msgs, tools=[WEATHER], max_tokens=40,
                                   tool_choice={"type": "function", "function": {"name": "get_weather"}}).choices[0]
    assert tok.decode(script.prompts[-1]).endswith('<tool_call>\n{"name": "get_weather", "arguments": ')
    assert json.loads(r.message.tool_calls[0].function.arguments) == {"city": "Rome"}
    script('{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>')
    m = ac.messages.create(model=MODEL, max_tokens=40, messages=msgs, tools=[A_WEATHER],
                           tool_choice={"type": "any"})
    assert tok.decode(script.prompts[-1]).endswith("<|assistant|><tool_call>\n")
    assert m.content[0].input == {"city": "Oslo"} and m.stop_reason == "tool_use"


def test_a_call_the_model_wrote_badly_is_text(srv, script):
    state, server, ac, oc, full = srv
    bad = '<tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call>'
    script(bad)
    r = oc.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": QUESTION}], tools=[WEATHER],
                                   max_tokens=40).choices[0]
    assert (r.message.content, r.finish_reason, r.message.tool_calls) == (bad, "stop", None)
    script(bad)
    chunks = list(oc.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": QUESTION}],
                                             tools=[WEATHER], max_tokens=40, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == bad
    assert chunks[-1].choices[0].finish_reason == "stop"
    script(bad)
    m = ac.messages.create(model=MODEL, max_tokens=40, messages=[{"role": "user", "content": QUESTION}],
                           tools=[A_WEATHER])
    assert [(b.type, b.text) for b in m.content] == [("text", bad)] and m.stop_reason == "end_turn"


def _post(server, path, body):
    req = urllib.request.Request(server.base_url + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_bad_tool_input_is_a_one_line_error_in_each_apis_shape(srv):
    """A malformed schema, an unknown call id, 1,000 tools, tools that overflow the context, a template without
    tools: 400 in each API's own error shape, and the server goes on serving."""
    state, server, ac, oc, full = srv
    user = [{"role": "user", "content": QUESTION}]
    bad_schema = {"type": "function", "function": {"name": "f", "parameters": {"type": "object",
                                                                                "properties": {"x": {"type": 5}}}}}
    big = {"type": "function", "function": {"name": "big", "description": "word " * 300}}
    cases = [
        (dict(messages=user, tools=[bad_schema]), "not a valid JSON Schema"),
        (dict(messages=user + [{"role": "tool", "tool_call_id": "call_x", "content": "r"}]),
         "no earlier tool call has the id 'call_x'"),
        (dict(messages=user, tools=[{"type": "function", "function": {"name": f"t{i}"}} for i in range(1000)]),
         "at most 128 tools"),
        (dict(messages=user, tools=[big]), "tools' definitions"),
    ]
    for body, words in cases:
        status, err = _post(server, "/v1/chat/completions", dict(body, model=MODEL, max_tokens=4))
        assert status == 400 and words in err["error"]["message"] and "\n" not in err["error"]["message"]
    a_cases = [
        (dict(messages=user, tools=[{"name": "f", "input_schema": {"type": "array"}}]), "must describe an object"),
        (dict(messages=user + [{"role": "assistant", "content": "ok"}, {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_x", "content": "r"}]}]), "no earlier tool call"),
        (dict(messages=user, tools=[{"name": f"t{i}", "input_schema": {"type": "object"}} for i in range(1000)]),
         "at most 128 tools"),
    ]
    for body, words in a_cases:
        status, err = _post(server, "/v1/messages", dict(body, model=MODEL, max_tokens=4))
        assert status == 400 and err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
        assert words in err["error"]["message"]
    for choice in ("none", "auto"):   # without tools: nothing asked of them, an ordinary answer
        r = oc.chat.completions.create(model=MODEL, messages=user, tool_choice=choice, max_tokens=2).choices[0]
        assert r.finish_reason in ("stop", "length") and not r.message.tool_calls
    state.lm.tokenizer.chat_template = None
    try:
        with pytest.raises(openai.BadRequestError, match="has no chat template") as e:
            oc.chat.completions.create(model=MODEL, messages=user, tools=[WEATHER], max_tokens=4)
        assert e.value.body["param"] == "tools"
    finally:
        state.lm.tokenizer.chat_template = TOOLS_TEMPLATE
    state.lm.tokenizer.chat_template = PLAIN_TEMPLATE
    try:
        with pytest.raises(openai.BadRequestError, match="never renders `tools`"):
            oc.chat.completions.create(model=MODEL, messages=user, tools=[WEATHER], max_tokens=4)
        with pytest.raises(anthropic.BadRequestError, match="never renders `tools`"):
            ac.messages.create(model=MODEL, max_tokens=4, messages=user, tools=[A_WEATHER])
    finally:
        state.lm.tokenizer.chat_template = TOOLS_TEMPLATE
    ok = oc.chat.completions.create(model=MODEL, messages=user, max_tokens=2)
    assert ok.choices[0].finish_reason in ("stop", "length")


def test_a_response_template_given_parses_the_models_own_format(srv, script):
    """``serve --response-template``: the tokenizer's response template (here a ``<call>`` JSON format anchored at
    the template's assistant marker) is used instead of ours, given the whole prompt as transformers' server does."""
    state, server, ac, oc, full = srv
    tok = state.lm.tokenizer
    tok.response_template = {
        "start_anchor": "<|assistant|>", "defaults": {"role": "assistant"},
        "fields": {"tool_calls": {"open": "<call>", "close": "</call>", "repeats": True, "content": "json",
                                  "transform": {"type": "function", "function": "{content}"}},
                   "content": {"content": "text"}}}
    try:
        script('Sure.<call>{"name": "get_weather", "arguments": {"city": "Lima"}}</call>')
        r = oc.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": QUESTION}],
                                       tools=[WEATHER], max_tokens=40).choices[0]
        assert r.message.content == "Sure." and r.finish_reason == "tool_calls"
        assert json.loads(r.message.tool_calls[0].function.arguments) == {"city": "Lima"}
        script('{"name": "get_weather", "arguments": {"city": "Quito"}}</call>')   # forced: its literal opening
        r = oc.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": QUESTION}],
                                       tools=[WEATHER], tool_choice="required", max_tokens=40).choices[0]
        assert tok.decode(script.prompts[-1]).endswith("<|assistant|><call>")
        assert json.loads(r.message.tool_calls[0].function.arguments) == {"city": "Quito"}
    finally:
        tok.response_template = None


def test_bad_template_files_are_one_line_errors(tmp_path, capsys, tiny_dirs):
    from moe_offload.cli import main

    bad_jinja = tmp_path / "t.jinja"
    bad_jinja.write_text("{% for m in messages %}{{ m.content }")
    bad_json = tmp_path / "r.json"
    bad_json.write_text('{"fields": {}}')
    cases = [(["--chat-template", str(tmp_path / "none.jinja")], "cannot read it"),
             (["--chat-template", str(bad_jinja)], "not a Jinja template"),
             (["--response-template", str(bad_json)], "not a response template")]
    for argv, words in cases:
        assert main(["serve", "--model", str(tiny_dirs["qwen3_moe"]), "--port", "0", "--quiet", *argv]) == 2
        err = capsys.readouterr().err.strip()
        assert words in err and len(err.splitlines()) == 1
