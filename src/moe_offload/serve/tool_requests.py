"""The tools of a request, in both APIs (issue 48): their definitions checked and put in the form chat templates
take, the tool choice, and the earlier calls and results of a conversation as chat-template messages.

Chat templates take tools as OpenAI function tools, ``{"type": "function", "function": {"name", "description",
"parameters"}}`` (what ``apply_chat_template(tools=...)`` renders), and an assistant's earlier calls as
``tool_calls`` of ``{"id", "type": "function", "function": {"name", "arguments"}}`` with ``arguments`` a dict
(OpenAI's JSON-string arguments are decoded: templates iterate them, e.g. Qwen3-Coder's ``arguments|items``), and
tool results as ``{"role": "tool", "content", "tool_call_id", "name"}`` messages.

Checked, each a 400 naming the field: a tool without a valid name (OpenAI's rule: 1-64 of ``a-z A-Z 0-9 _ -``), two
tools of one name, a ``parameters`` / ``input_schema`` that is not a JSON Schema of an object (checked with
``jsonschema``'s meta-schema), more than ``MAX_TOOLS`` tools, a tool choice naming no given tool or asking for a
call without tools, arguments that are not a JSON object, and a tool result whose call id no earlier call has.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from .protocol import OpenAIError

#: most tools one request may carry (OpenAI's limit)
MAX_TOOLS = 128
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


@dataclass
class ToolRequest:
    """What a request asks of tools.

    Attributes:
        tools: the tools as chat templates take them (OpenAI function tools; empty: none).
        choice: ``auto`` (the model may call), ``required`` (it must call one), ``none`` (it must not: the tools
            are not rendered and its output is not parsed), or ``named`` (it must call ``name``).
        name: the named tool (``choice`` ``named``), else None.
    """

    tools: list[dict] = field(default_factory=list)
    choice: str = "none"
    name: str | None = None

    @property
    def active(self) -> bool:
        """Whether tools are rendered and the output parsed for calls."""
        return bool(self.tools) and self.choice != "none"

    @property
    def forced(self) -> bool:
        """Whether generation must start with a call (``required`` or a named tool)."""
        return self.active and self.choice in ("required", "named")


def _schema_problem(schema) -> str | None:
    """Why ``schema`` is not a JSON Schema of an object, or None."""
    import jsonschema

    if not isinstance(schema, dict):
        return f"must be a JSON Schema object, got {type(schema).__name__}"
    if schema.get("type", "object") != "object":
        return f"must describe an object (\"type\": \"object\"), got type {schema.get('type')!r}"
    try:
        jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator).check_schema(schema)
    except jsonschema.SchemaError as e:
        where = "/".join(str(p) for p in e.path)
        return f"is not a valid JSON Schema{' at ' + where if where else ''}: {e.message}"
    return None


def _tool(name, description, schema, where: str) -> dict:
    """One tool as chat templates take it, checked (``where``: the request field, for the error)."""
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise OpenAIError(400, f"{where}.name: a tool name must be 1-64 letters, digits, '_' or '-', got {name!r}",
                          param="tools")
    if description is not None and not isinstance(description, str):
        raise OpenAIError(400, f"{where}.description: must be a string", param="tools")
    if schema is None:
        schema = {"type": "object", "properties": {}}
    problem = _schema_problem(schema)
    if problem:
        raise OpenAIError(400, f"{where}: the tool {name!r}'s parameters {problem}", param="tools")
    fn = {"name": name, "parameters": schema}
    if description:
        fn["description"] = description
    return {"type": "function", "function": fn}


def _checked_tools(tools: list | None, one) -> list[dict]:
    """The request's tools as chat templates take them: at most ``MAX_TOOLS``, each through ``one(i, tool)``
    (checked, converted), no two of one name.

    Raises:
        OpenAIError: 400 (param ``tools``) for too many tools, a tool ``one`` refuses, or a repeated name.
    """
    tools = tools or []
    if len(tools) > MAX_TOOLS:
        raise OpenAIError(400, f"tools: at most {MAX_TOOLS} tools per request, got {len(tools)}", param="tools")
    out = [one(i, t) for i, t in enumerate(tools)]
    seen = set()
    for t in out:
        name = t["function"]["name"]
        if name in seen:
            raise OpenAIError(400, f"tools: two tools are named {name!r}", param="tools")
        seen.add(name)
    return out


def _named(tools: list[dict], name, where: str) -> ToolRequest:
    if not any(t["function"]["name"] == name for t in tools):
        given = ", ".join(t["function"]["name"] for t in tools) or "none"
        raise OpenAIError(400, f"{where}: names the tool {name!r}, which the request does not give (tools: {given})",
                          param="tool_choice")
    return ToolRequest(tools, "named", name)


def openai_tools(tools: list | None, tool_choice) -> ToolRequest:
    """The tools and ``tool_choice`` of a chat completion, checked (module docstring). ``tool_choice`` null means
    ``auto`` with tools and ``none`` without; ``none`` and ``auto`` are accepted without tools.

    Raises:
        OpenAIError: 400 naming the field.
    """
    def one(i: int, t) -> dict:
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(t.get("function"),
                                                                                              dict):
            raise OpenAIError(400, f"tools.{i}: a tool must be {{\"type\": \"function\", \"function\": {{...}}}}",
                              param="tools")
        fn = t["function"]
        return _tool(fn.get("name"), fn.get("description"), fn.get("parameters"), f"tools.{i}.function")

    out = _checked_tools(tools, one)
    if tool_choice is None:
        return ToolRequest(out, "auto" if out else "none")
    if isinstance(tool_choice, str):
        if tool_choice not in ("none", "auto", "required"):
            raise OpenAIError(400, f"tool_choice: must be none, auto, required or a named function, got "
                              f"{tool_choice!r}", param="tool_choice")
        if tool_choice == "required" and not out:
            raise OpenAIError(400, "tool_choice: required asks for a tool call, but the request gives no tools",
                              param="tool_choice")
        return ToolRequest(out, tool_choice)
    fn = tool_choice.get("function") if tool_choice.get("type") == "function" else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise OpenAIError(400, "tool_choice: a named choice is {\"type\": \"function\", \"function\": {\"name\": ...}}",
                          param="tool_choice")
    return _named(out, fn["name"], "tool_choice.function.name")


#: Anthropic's server tools (run by Anthropic, not by the client): refused by name
_SERVER_TOOL = re.compile(r"(web_search|web_fetch|code_execution|bash|text_editor|computer|memory)_\d+")


def anthropic_tools(tools: list | None, tool_choice: dict | None) -> ToolRequest:
    """The tools and ``tool_choice`` of a Messages request, checked, as chat templates take them: each
    ``{"name", "description", "input_schema"}`` (``type`` ``custom`` or absent; Anthropic's server tools are
    refused) becomes a function tool; ``tool_choice`` ``auto`` / ``any`` / ``tool`` (with ``name``) / ``none``
    (null: ``auto`` with tools).

    Raises:
        OpenAIError: 400 naming the field.
    """
    def one(i: int, t) -> dict:
        if not isinstance(t, dict):
            raise OpenAIError(400, f"tools.{i}: a tool must be an object", param="tools")
        kind = t.get("type") or "custom"
        if kind != "custom":
            what = "a server tool, run by Anthropic's API," if _SERVER_TOOL.fullmatch(kind) else "a tool type"
            raise OpenAIError(400, f"tools.{i}.type: {kind!r} is {what} not by this server (custom tools only)",
                              param="tools")
        if "input_schema" not in t:
            raise OpenAIError(400, f"tools.{i}.input_schema: Field required", param="tools")
        return _tool(t.get("name"), t.get("description"), t["input_schema"], f"tools.{i}")

    out = _checked_tools(tools, one)
    if tool_choice is None:
        return ToolRequest(out, "auto" if out else "none")
    kind = tool_choice.get("type")
    if kind in ("auto", "none"):
        return ToolRequest(out, kind)
    if kind in ("any", "tool") and not out:
        raise OpenAIError(400, f"tool_choice: {kind} asks for a tool call, but the request gives no tools",
                          param="tool_choice")
    if kind == "any":
        return ToolRequest(out, "required")
    if kind == "tool":
        return _named(out, tool_choice.get("name"), "tool_choice.name")
    raise OpenAIError(400, f"tool_choice.type: must be auto, any, tool or none, got {kind!r}", param="tool_choice")


class CallLedger:
    """The tool calls of a conversation so far, by id: a tool result must answer one of them.

    ``call(id, name, arguments, where)`` records an assistant's call and returns it as chat templates take it;
    ``result(id, where)`` returns the called tool's name for a result, or raises.
    """

    def __init__(self):
        self.names: dict[str, str] = {}

    def call(self, call_id: str, name: str, arguments, where: str) -> dict:
        """An earlier call as chat templates take it (``arguments`` a dict: a JSON string is decoded).

        Raises:
            OpenAIError: 400 when ``arguments`` is not a JSON object.
        """
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except json.JSONDecodeError as e:
                raise OpenAIError(400, f"{where}: the arguments are not valid JSON ({e.msg} at character {e.pos})",
                                  param="messages") from None
        if not isinstance(arguments, dict):
            raise OpenAIError(400, f"{where}: the arguments must be a JSON object, got {type(arguments).__name__}",
                              param="messages")
        self.names[call_id] = name
        return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}

    def result(self, call_id: str, where: str) -> str:
        """The name of the tool whose call ``call_id`` is.

        Raises:
            OpenAIError: 400 when no earlier call of the conversation has that id.
        """
        if call_id not in self.names:
            known = ", ".join(self.names) or "none"
            raise OpenAIError(400, f"{where}: no earlier tool call has the id {call_id!r} (calls so far: {known})",
                              param="messages")
        return self.names[call_id]


def openai_messages(messages) -> list[dict]:
    """A chat completion's messages (``protocol.ChatMessage``) as chat templates take them: ``{"role", "content"}``,
    an assistant's ``tool_calls`` with decoded arguments, a tool message's ``tool_call_id`` and the called tool's
    ``name``.

    Raises:
        OpenAIError: 400 for arguments that are not a JSON object, a tool message without ``tool_call_id`` or one
            answering no earlier call.
    """
    ledger = CallLedger()
    out = []
    for i, m in enumerate(messages):
        msg = {"role": m.role, "content": m.text()}
        if m.tool_calls:
            msg["tool_calls"] = [ledger.call(c.id, c.function.name, c.function.arguments,
                                             f"messages.{i}.tool_calls.{j}.function.arguments")
                                 for j, c in enumerate(m.tool_calls)]
        if m.role == "tool":
            if m.tool_call_id is None:
                raise OpenAIError(400, f"messages.{i}.tool_call_id: a tool message answers a call: Field required",
                                  param="messages")
            msg["tool_call_id"] = m.tool_call_id
            msg["name"] = ledger.result(m.tool_call_id, f"messages.{i}.tool_call_id")
        out.append(msg)
    return out
