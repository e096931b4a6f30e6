"""A model's answer parsed back into text and tool calls (issue 48), with transformers' response parsing: the
whole answer with ``parse_response``, a stream with the ``ResponseParser`` of ``get_response_parser``, both driven
by the request's ``serve.tool_formats.ToolFormat``.

An answer whose call cannot be parsed (invalid JSON, a region cut by ``max_tokens``) is returned as text, never as
an error: the API then answers that text with the request's own finish reason.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from .tool_formats import ToolFormat


@dataclass
class ToolCall:
    """One parsed call: ``name``, ``arguments`` (a dict) and its id (``call_...`` / ``toolu_...``, per API)."""

    name: str
    arguments: dict
    id: str

    def arguments_json(self) -> str:
        """The arguments as OpenAI carries them (a JSON string)."""
        return json.dumps(self.arguments, ensure_ascii=False)


def _calls(raw, id_prefix: str) -> list[ToolCall]:
    """``ToolCall``s of a parsed ``tool_calls`` field: a list of calls, one call, or one call holding a list (the
    plain JSON format's answer), each ``{"type": "function", "function": {...}}`` or ``{"name", "arguments" |
    "parameters"}``.

    Raises:
        ValueError: an entry without a name, or arguments that are not an object.
    """
    items = raw if isinstance(raw, list) else [raw]
    flat = []
    for item in items:
        flat += item if isinstance(item, list) else [item]
    out = []
    for item in flat:
        fn = item.get("function", item) if isinstance(item, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ValueError(f"a tool call without a name: {item!r}")
        args = fn.get("arguments", fn.get("parameters", {}))
        if isinstance(args, str):
            args = json.loads(args) if args.strip() else {}
        if not isinstance(args, dict):
            raise ValueError(f"tool call arguments must be an object, got {type(args).__name__}")
        out.append(ToolCall(fn["name"], args, f"{id_prefix}{uuid.uuid4().hex[:24]}"))
    return out


def parse_answer(tokenizer, fmt: ToolFormat, text: str, prefix: str, tools: list[dict],
                 id_prefix: str) -> tuple[str, list[ToolCall]]:
    """``(content, calls)`` of a finished answer ``text`` (the generated text; ``prefix``: what the parser is given
    before it, ``ToolFormat.whole_prompt``). Without a call, or when the answer's calls cannot be parsed, ``content``
    is what the model wrote (after the prefix's pre-written part) and ``calls`` is empty."""
    try:
        parsed = tokenizer.parse_response(text, fmt.template, prefix=prefix, tools=tools)
        calls = _calls(parsed.get("tool_calls") or [], id_prefix)
    except (ValueError, KeyError, TypeError, json.JSONDecodeError):
        return raw_text(fmt, prefix, text), []
    if not calls:
        return raw_text(fmt, prefix, text), []
    return str(parsed.get("content") or ""), calls


def raw_text(fmt: ToolFormat, prefix: str, text: str) -> str:
    """What the assistant wrote, as text: a forced opening (the prefix of our formats) and the generated text."""
    return text if fmt.whole_prompt else prefix + text


class ToolStream:
    """A streamed answer parsed as it comes: ``feed(text)`` and ``finish()`` return items, ``str`` (content text,
    final) or ``ToolCall`` (a call whose region closed). When a call cannot be parsed, everything not yet returned
    (from the end of the last returned text, the call's opening included) comes back as text, and the rest of the
    stream passes through as text.

    Args:
        tokenizer: the model's tokenizer (``get_response_parser``).
        fmt: the request's tool format.
        prefix: what the parser is given before the answer (``ToolFormat.whole_prompt``: the prompt; else the
            assistant turn's pre-written text).
        tools: the request's tools (arguments typed by their schemas).
        id_prefix: ``call_`` (OpenAI) or ``toolu_`` (Anthropic).
    """

    def __init__(self, tokenizer, fmt: ToolFormat, prefix: str, tools: list[dict], id_prefix: str):
        self.parser = tokenizer.get_response_parser(fmt.template, prefix=prefix, tools=tools)
        self.id_prefix = id_prefix
        # the text the parser has seen that belongs to the answer (a forced opening first) and how far into it the
        # returned content reaches: on a failed call, what lies past it is returned as text
        self.seen = "" if fmt.whole_prompt else prefix
        self.mark = 0
        self.broken = False

    def _items(self, events) -> list:
        out = []
        for ev in events:
            if ev["type"] == "region_chunk" and ev["field"] == "content" and not ev.get("dirty") and ev["text"]:
                at = self.seen.find(ev["text"], self.mark)
                self.mark = at + len(ev["text"]) if at >= 0 else self.mark
                out.append(ev["text"])
            elif ev["type"] == "region_close" and ev["field"] == "tool_calls":
                calls = _calls(ev["value"], self.id_prefix)
                out += calls
                self.mark = len(self.seen)
        return out

    def _fail(self) -> list:
        self.broken = True
        rest = self.seen[self.mark:]
        self.mark = len(self.seen)
        return [rest] if rest else []

    def feed(self, text: str) -> list:
        """The items that ``text`` (the next generated text) completes."""
        if not text:
            return []
        if self.broken:
            return [text]
        self.seen += text
        try:
            return self._items(self.parser.feed(text))
        except (ValueError, KeyError, TypeError):
            return self._fail()

    def finish(self) -> list:
        """The items the end of the answer completes (a region open until the end closes here)."""
        if self.broken:
            return []
        try:
            _, events = self.parser.finalize()
            return self._items(events)
        except (ValueError, KeyError, TypeError):
            return self._fail()


@dataclass
class ToolTurn:
    """What parsing one request's answer needs: the tokenizer, the tool format, the parser's prefix
    (``ToolFormat.whole_prompt``: the prompt's text; else the assistant turn's pre-written text: a prefill and a
    forced call's opening) and the request's tools."""

    tokenizer: object
    fmt: ToolFormat
    prefix: str
    tools: list[dict]

    def parse(self, text: str, id_prefix: str) -> tuple[str, list[ToolCall]]:
        """``parse_answer`` of the finished answer ``text``."""
        return parse_answer(self.tokenizer, self.fmt, text, self.prefix, self.tools, id_prefix)

    def stream(self, id_prefix: str) -> ToolStream:
        """A ``ToolStream`` for the answer as it comes."""
        return ToolStream(self.tokenizer, self.fmt, self.prefix, self.tools, id_prefix)
