"""How a model writes a tool call: transformers response templates, as data, and where a forced call starts
(issue 48).

A tokenizer that ships a ``response_template`` (transformers' declarative response parsing) is parsed with it. The
families that ship none get one of ours, chosen from the chat template's own text (what the model was trained to
write is what its template writes for an assistant's earlier calls):

- ``hermes``: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` (Hermes, Qwen2.5, Qwen3 and the
  many templates that copied them);
- ``qwen3-coder``: ``<tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>\\n</function>\\n
  </tool_call>`` (Qwen3-Coder, Qwen3.5); values are text, typed by the tool's JSON schema when parsed;
- ``json``: the answer is a JSON object ``{"name": ..., "arguments": {...}}`` (``"parameters"`` is taken too) or a
  list of them, and nothing else (Llama 3.1's JSON tool calling and templates that say nothing of a format).

A forced call (``tool_choice`` required / any, or a named tool) is a prefill: generation starts at the format's
opening of a call (``ToolFormat.opening``), so the model writes the rest of one.

Our templates anchor at the start of the text they are given (``start_anchor_pattern`` ``\\A``): the caller gives
the parser what the assistant's turn holds before generation (a forced opening, or nothing), not the whole prompt.
A tokenizer's own template is given the whole prompt, as transformers' own server does, since its anchor is the
template's assistant marker.

``serve --chat-template FILE`` (a Jinja file) replaces a model's chat template, e.g. with one that renders tools;
``serve --response-template FILE`` (JSON) gives the tokenizer a response template for a format none of ours parses.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

#: the tool-call field's shape in every template: ``{"type": "function", "function": {"name", "arguments"}}``
_CALL = {"type": "function", "function": {"name": "{name}", "arguments": "{content}"}}


@dataclass(frozen=True)
class ToolFormat:
    """One way of writing tool calls.

    Attributes:
        name: ``hermes``, ``qwen3-coder``, ``json``, or ``tokenizer`` (the tokenizer's own ``response_template``).
        template: the transformers response template (a dict, ``utils.chat_parsing``).
        opening: the text a forced call starts with, for any tool.
        named_opening: the same for one named tool (``{name}`` replaced by ``json.dumps``-safe text), or None when
            the format cannot name the tool up front.
        whole_prompt: the parser is given the whole prompt as its prefix (a tokenizer's own template, anchored at the
            template's assistant marker); otherwise only the assistant turn's pre-written text.
    """

    name: str
    template: dict
    opening: str
    named_opening: str | None
    whole_prompt: bool = False

    def forced_opening(self, tool: str | None) -> str:
        """The prefill of a forced call: of the named ``tool``, or of any tool (``tool`` None)."""
        if tool is not None and self.named_opening is not None:
            return self.named_opening.replace("{name}", json.dumps(tool)[1:-1])
        return self.opening


HERMES = ToolFormat("hermes", {
    "start_anchor_pattern": r"\A",
    "defaults": {"role": "assistant"},
    "fields": {
        "tool_calls": {"open_pattern": r"\s*<tool_call>", "close": "</tool_call>", "repeats": True,
                       "content": "json", "transform": {"type": "function", "function": "{content}"}},
        "content": {"content": "text"},
    },
}, opening="<tool_call>\n", named_opening='<tool_call>\n{"name": "{name}", "arguments": ')

QWEN3_CODER = ToolFormat("qwen3-coder", {
    "start_anchor_pattern": r"\A",
    "defaults": {"role": "assistant"},
    "fields": {
        "tool_calls": {
            "open_pattern": r"\s*<tool_call>\s*<function=(?P<name>[^>\n]+)>",
            "close_pattern": r"</function>\s*</tool_call>",
            "repeats": True,
            "content": "xml-inline",
            "content_args": {"tag_pattern": r"<parameter=(?P<key>[^>\n]+)>\n?(?P<value>.*?)\n?</parameter>",
                             "strip": False},
            "transform": _CALL,
        },
        "content": {"content": "text"},
    },
}, opening="<tool_call>\n<function=", named_opening="<tool_call>\n<function={name}>\n")

PLAIN_JSON = ToolFormat("json", {
    "start_anchor_pattern": r"\A",
    "defaults": {"role": "assistant"},
    "fields": {
        # the whole answer: a JSON object or a list of them (the open anchor consumes nothing but leading space)
        "tool_calls": {"open_pattern": r"\A\s*(?=[\[{])", "content": "json"},
        "content": {"content": "text"},
    },
}, opening='{"name": "', named_opening='{"name": "{name}", "arguments": ')

FORMATS = {f.name: f for f in (HERMES, QWEN3_CODER, PLAIN_JSON)}


def template_source(tokenizer, tools: list | None = None) -> str | None:
    """The chat template text ``apply_chat_template`` would use (a tool-use template where a tokenizer has named
    ones), or None without one."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    try:
        return tokenizer.get_chat_template(tools=tools)
    except (ValueError, TypeError):
        return None


def takes_tools(source: str | None) -> bool:
    """Whether a chat template renders tools at all (reads its ``tools`` variable)."""
    return bool(source) and "tools" in source


def _literal_open(template: dict) -> str:
    """A response template's literal opening of a tool call (its ``tool_calls`` field's ``open``, the first of a
    list), or "" when it opens with a pattern: a forced call then starts where the model's turn starts."""
    field = (template.get("fields") or {}).get("tool_calls") or {}
    opening = field.get("open")
    return opening[0] if isinstance(opening, list) and opening else opening if isinstance(opening, str) else ""


def format_for(tokenizer, source: str | None) -> ToolFormat:
    """The tool-call format of a model: its tokenizer's ``response_template`` where it ships one (a forced call
    opens with its literal ``open``; the tool cannot be named up front), else ours, chosen from its chat template's
    text (``source``): XML parameters -> ``qwen3-coder``, ``<tool_call>`` -> ``hermes``, else ``json``."""
    own = getattr(tokenizer, "response_template", None)
    if own:
        return ToolFormat("tokenizer", own, _literal_open(own), None, whole_prompt=True)
    text = source or ""
    if "<function=" in text and "<parameter=" in text:
        return QWEN3_CODER
    if "<tool_call>" in text:
        return HERMES
    return PLAIN_JSON


def read_chat_template(path) -> str:
    """A chat template from a Jinja file (``serve --chat-template``), for a model whose own renders no tools.

    Raises:
        MoeOffloadError: the file cannot be read or is not a Jinja template (one line, with the line number).
    """
    import jinja2

    from ..errors import MoeOffloadError

    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise MoeOffloadError(f"--chat-template {path}: cannot read it ({getattr(e, 'strerror', None) or e})") \
            from None
    try:
        jinja2.Environment().parse(text)
    except jinja2.TemplateSyntaxError as e:
        raise MoeOffloadError(f"--chat-template {path}: not a Jinja template: {e.message} (line {e.lineno})") \
            from None
    return text


def read_response_template(path) -> dict:
    """A transformers response template from a JSON file (``serve --response-template``), for a model that writes
    its calls in a format none of ours parses.

    Raises:
        MoeOffloadError: the file cannot be read, is not JSON, or is not a valid response template (one line).
    """
    from transformers.utils.chat_parsing.response_templates import load_response_template

    from ..errors import MoeOffloadError

    try:
        spec = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as e:
        raise MoeOffloadError(f"--response-template {path}: cannot read it ({getattr(e, 'strerror', None) or e})") \
            from None
    except json.JSONDecodeError as e:
        raise MoeOffloadError(f"--response-template {path}: not JSON: {e.msg} (line {e.lineno})") from None
    try:
        load_response_template(spec)
    except (ValueError, TypeError, KeyError) as e:
        raise MoeOffloadError(f"--response-template {path}: not a response template: "
                              f"{str(e).strip().splitlines()[0]}") from None
    return spec
