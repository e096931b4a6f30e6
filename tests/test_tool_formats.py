"""Tool calls parsed back from a model's answer (``serve.tool_output``) in each of our formats
(``serve.tool_formats``), whole and streamed, and the tools of a request checked (``serve.tool_requests``)."""

import json

import pytest
from transformers import AutoTokenizer

from moe_offload.serve.protocol import OpenAIError
from moe_offload.serve.tool_formats import HERMES, PLAIN_JSON, QWEN3_CODER, format_for, takes_tools
from moe_offload.serve.tool_output import ToolCall, ToolStream, parse_answer
from moe_offload.serve.tool_requests import MAX_TOOLS, CallLedger, anthropic_tools, openai_tools

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string"}, "days": {"type": "integer"}},
                                                "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
TOOLS = [WEATHER, TIME]

#: (format, answer with text and two calls, the same answer's calls) per format
ANSWERS = [
    (HERMES, 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n'
             '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'),
    (QWEN3_CODER, "Let me look.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
                  "<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=get_time>\n"
                  "</function>\n</tool_call>"),
]
CALLS = [("get_weather", {"city": "Paris", "days": 2}), ("get_time", {})]


@pytest.fixture(scope="module")
def tok(tiny_dirs):
    return AutoTokenizer.from_pretrained(tiny_dirs["qwen3_moe"])


def _stream(tok, fmt, text, prefix="", step=3):
    """Items of ``text`` fed to a ``ToolStream`` ``step`` characters at a time; text items joined where adjacent."""
    s = ToolStream(tok, fmt, prefix, TOOLS, "call_")
    items = []
    for i in range(0, len(text), step):
        items += s.feed(text[i:i + step])
    items += s.finish()
    out = []
    for it in items:
        if isinstance(it, str) and out and isinstance(out[-1], str):
            out[-1] += it
        else:
            out.append(it)
    return out


@pytest.mark.parametrize("fmt,text", ANSWERS, ids=[f.name for f, _ in ANSWERS])
def test_text_and_two_calls_whole_and_streamed(tok, fmt, text):
    content, calls = parse_answer(tok, fmt, text, "", TOOLS, "call_")
    assert content == "Let me look."
    assert [(c.name, c.arguments) for c in calls] == CALLS   # qwen3-coder's "2" typed by the tool's schema
    assert all(c.id.startswith("call_") and len(c.id) == 29 for c in calls)
    for step in (1, 3, 17):
        items = _stream(tok, fmt, text, step=step)
        assert isinstance(items[0], str) and items[0].strip() == "Let me look."
        assert [(c.name, c.arguments) for c in items[1:] if isinstance(c, ToolCall)] == CALLS
        assert all(not isinstance(i, str) or not i.strip() for i in items[1:])


def test_plain_json_answer(tok):
    for text, want in [('{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}', CALLS[:1]),
                       ('[{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}, '
                        '{"name": "get_time", "arguments": {}}]', CALLS)]:
        content, calls = parse_answer(tok, PLAIN_JSON, text, "", TOOLS, "call_")
        assert content == "" and [(c.name, c.arguments) for c in calls] == want
        assert [(c.name, c.arguments) for c in _stream(tok, PLAIN_JSON, text) if isinstance(c, ToolCall)] == want
    content, calls = parse_answer(tok, PLAIN_JSON, "It is sunny in Paris.", "", TOOLS, "call_")
    assert (content, calls) == ("It is sunny in Paris.", [])


def test_forced_openings_are_prefixes_the_parser_continues(tok):
    """A forced call's opening is given as the parser's prefix: the model's continuation completes the call."""
    cases = [(HERMES, None, '{"name": "get_time", "arguments": {}}\n</tool_call>', ("get_time", {})),
             (HERMES, "get_weather", '{"city": "Oslo"}}\n</tool_call>', ("get_weather", {"city": "Oslo"})),
             (QWEN3_CODER, None, "get_time>\n</function>\n</tool_call>", ("get_time", {})),
             (QWEN3_CODER, "get_weather", "<parameter=city>\nOslo\n</parameter>\n</function>\n</tool_call>",
              ("get_weather", {"city": "Oslo"})),
             (PLAIN_JSON, "get_weather", '{"city": "Oslo"}}', ("get_weather", {"city": "Oslo"}))]
    for fmt, name, text, want in cases:
        prefix = fmt.forced_opening(name)
        content, calls = parse_answer(tok, fmt, text, prefix, TOOLS, "call_")
        assert [(c.name, c.arguments) for c in calls] == [want], (fmt.name, name)
        assert [(c.name, c.arguments) for c in _stream(tok, fmt, text, prefix) if isinstance(c, ToolCall)] == [want]


def test_a_call_that_does_not_parse_is_text(tok):
    """Invalid JSON in a call, or a call cut short: the answer comes back as the text the model wrote (a forced
    opening included), whole and streamed."""
    for fmt, prefix, text in [(HERMES, "", 'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": }\n'
                                           '</tool_call>'),
                              (HERMES, "", 'Sure.\n<tool_call>\n{"name": "get_weather", "argu'),
                              (HERMES, HERMES.forced_opening("get_weather"), '{"city": "Pa'),
                              (PLAIN_JSON, "", '{"name": "get_weather", "arguments": {"city": "Pa')]:
        content, calls = parse_answer(tok, fmt, text, prefix, TOOLS, "call_")
        assert calls == [] and content == prefix + text
        items = _stream(tok, fmt, text, prefix)
        assert items == [prefix + text]


def test_format_chosen_from_the_chat_template(tok):
    assert format_for(tok, "{{ '<tool_call>' }}{% for t in tools %}{% endfor %}") is HERMES
    assert format_for(tok, "<tool_call><function=x><parameter=y>{{ tools }}") is QWEN3_CODER
    assert format_for(tok, "{{ tools | tojson }}") is PLAIN_JSON
    assert takes_tools("{{ tools }}") and not takes_tools("{{ messages }}") and not takes_tools(None)


def _err(fn, *args, match):
    with pytest.raises(OpenAIError, match=match) as e:
        fn(*args)
    assert e.value.status == 400
    return e.value


def test_openai_tools_checked():
    t = openai_tools(TOOLS, None)
    assert t.choice == "auto" and t.active and not t.forced and [x["function"]["name"] for x in t.tools] == [
        "get_weather", "get_time"]
    assert openai_tools(None, "none").choice == "none" and not openai_tools(None, "none").active
    assert openai_tools(None, "auto").tools == [] and not openai_tools(TOOLS, "none").active
    assert openai_tools(TOOLS, "required").forced
    named = openai_tools(TOOLS, {"type": "function", "function": {"name": "get_time"}})
    assert (named.choice, named.name, named.forced) == ("named", "get_time", True)
    _err(openai_tools, TOOLS, {"type": "function", "function": {"name": "nope"}}, match="names the tool 'nope'")
    _err(openai_tools, None, "required", match="gives no tools")
    _err(openai_tools, TOOLS, "sometimes", match="tool_choice: must be")
    _err(openai_tools, [{"type": "function", "function": {"name": "bad name!"}}], None, match="tools.0.function.name")
    _err(openai_tools, [TIME, TIME], None, match="two tools are named 'get_time'")
    _err(openai_tools, [{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}], None,
         match="must describe an object")
    _err(openai_tools, [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "strin"}}}}}], None, match="not a valid JSON Schema")
    _err(openai_tools, [{"type": "retrieval"}], None, match="tools.0: a tool must be")
    many = [{"type": "function", "function": {"name": f"t{i}"}} for i in range(1000)]
    assert "at most 128 tools" in _err(openai_tools, many, None, match="at most").message
    assert len(openai_tools(many[:MAX_TOOLS], None).tools) == MAX_TOOLS


def test_anthropic_tools_checked():
    tools = [{"name": "get_weather", "description": "Weather", "input_schema": WEATHER["function"]["parameters"]}]
    t = anthropic_tools(tools, None)
    assert t.tools == [{"type": "function", "function": {
        "name": "get_weather", "parameters": WEATHER["function"]["parameters"], "description": "Weather"}}]
    assert anthropic_tools(tools, {"type": "any"}).choice == "required"
    assert anthropic_tools(tools, {"type": "tool", "name": "get_weather"}).name == "get_weather"
    assert not anthropic_tools(tools, {"type": "none"}).active
    _err(anthropic_tools, [{"name": "x"}], None, match="input_schema: Field required")
    _err(anthropic_tools, [{"type": "web_search_20250305", "name": "web_search"}], None, match="a server tool")
    _err(anthropic_tools, tools, {"type": "tool", "name": "other"}, match="names the tool 'other'")
    _err(anthropic_tools, [], {"type": "any"}, match="gives no tools")


def test_call_ledger():
    ledger = CallLedger()
    assert ledger.call("c1", "f", '{"a": 1}', "w") == {"id": "c1", "type": "function",
                                                       "function": {"name": "f", "arguments": {"a": 1}}}
    assert ledger.result("c1", "w") == "f"
    _err(ledger.result, "c2", "messages.3.tool_call_id", match="no earlier tool call has the id 'c2'")
    _err(ledger.call, "c3", "f", "[1, 2]", "w", match="must be a JSON object")
    _err(ledger.call, "c3", "f", "{bad", "w", match="not valid JSON")
    assert json.loads(ToolCall("f", {"a": "é"}, "x").arguments_json()) == {"a": "é"}
