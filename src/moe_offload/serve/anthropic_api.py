"""The Anthropic Messages API (``POST /v1/messages``) on the OpenAI-compatible server's port.

One generation path: a Messages request becomes the same ``Job`` as a chat completion — its system prompt and
messages go through ``ServeState.encode_messages`` (the model's chat template), its settings through
``ServeState.params`` / ``sampling`` (the one sampler, ``moe_offload.generation.sampling``) — so a greedy Messages request
gets the tokens of the same ``/v1/chat/completions`` request (a system prompt there is a ``system`` message).

Accepted: ``model``, ``max_tokens`` (required, at least 1, prompt + ``max_tokens`` within ``--max-context``),
``messages`` (``user`` / ``assistant``; ``content`` a string or a list of ``{"type": "text", "text"}`` blocks,
concatenated), ``system`` (a string or text blocks), ``stop_sequences`` (non-empty strings, any number),
``temperature`` (in [0, 1], Anthropic's range; default 0, greedy, as on the OpenAI side — Anthropic's own
default is 1), ``top_p``, ``top_k`` (the server's rules), ``stream``, ``metadata`` (accepted, unused); unknown
fields are ignored. Extensions, as on the OpenAI side: ``seed`` (the server's rules; -1: none), and
``return_token_ids: true``, which adds ``token_ids`` to the message (and to each streamed ``content_block_delta``),
for exact comparisons. A final ``assistant`` message is a prefill: generation continues it (the chat template's
``continue_final_message``) and the answer holds only the continuation.

Tools (``serve.tool_requests``, ``serve.tool_output``): ``tools`` (custom tools: ``name``, ``description``,
``input_schema``) rendered by the model's chat template, ``tool_choice`` (``auto``, ``any``, ``tool`` with a
``name``, ``none``), an assistant's ``tool_use`` blocks and a user's ``tool_result`` blocks (``content`` text or
text blocks; ``is_error`` marks the text ``Error:``) fed back; the answer's calls parsed into ``tool_use`` blocks
(stop reason ``tool_use``; streamed as ``content_block_start`` with the block, one ``input_json_delta``,
``content_block_stop``). A call the model wrote that does not parse comes back as text.

Refused with a 400: ``thinking`` (other than ``{"type": "disabled"}``), content blocks other than text, tool_use
and tool_result (images, documents, thinking), Anthropic's server tools, a tool result for no earlier call, a final
assistant message that ends in whitespace (as Anthropic's API refuses it) or holds tool calls.

``POST /v1/messages/count_tokens`` answers ``{"input_tokens": N}``: the tokens the chat template gives the
request's system prompt, messages and tools, what ``usage.input_tokens`` of the same ``/v1/messages`` request
reports (``max_tokens`` is not needed; the same refusals). An ``anthropic-beta`` header is accepted and ignored.

Errors are Anthropic's shape, ``{"type": "error", "error": {"type", "message"}}``: 400 ``invalid_request_error``
(validation, parameters, context length), 404 ``not_found_error`` (unknown model), 503 ``overloaded_error`` (the
server is shutting down; the OpenAI side's 503), 500 ``api_error`` (an engine failure). A stream that fails after
it started ends with an ``error`` event in the same shape.
"""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from types import SimpleNamespace
from typing import Literal

from fastapi import APIRouter, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from fastapi.sse import EventSourceResponse
from pydantic import BaseModel

from .protocol import _STRICT, OpenAIError, Text, validation_message
from .jobs import Done, Failed, Job, wait_result
from .anthropic_stream import ERROR_TYPES, TOOL_ID_PREFIX, stop_reason, stream_events, tool_use
from .limits import RETRY_AFTER_S, RETRY_STATUSES, check_queue
from .tool_output import ToolTurn
from .tool_requests import CallLedger, anthropic_tools


class ContentBlock(BaseModel):
    """A content block: ``text`` (``text``), an assistant's ``tool_use`` (``id``, ``name``, ``input``) and a user's
    ``tool_result`` (``tool_use_id``, ``content`` a string or text blocks, ``is_error``); any other ``type``
    parses only to be refused (``chat_messages``)."""

    model_config = _STRICT
    type: Text
    text: Text | None = None
    id: Text | None = None
    name: Text | None = None
    input: dict | None = None
    tool_use_id: Text | None = None
    content: Text | list["ContentBlock"] | None = None
    is_error: bool | None = None


class AnthropicMessage(BaseModel):
    """One message: ``role`` ``user`` or ``assistant``, ``content`` a string or content blocks."""

    model_config = _STRICT
    role: Literal["user", "assistant"]
    content: Text | list[ContentBlock]


class CountTokensRequest(BaseModel):
    """``POST /v1/messages/count_tokens`` body: what shapes a Messages request's prompt."""

    model_config = _STRICT
    model: Text
    messages: list[AnthropicMessage]
    system: Text | list[ContentBlock] | None = None
    tools: list | None = None
    tool_choice: dict | None = None
    thinking: dict | None = None


class MessagesRequest(BaseModel):
    """``POST /v1/messages`` body (Anthropic names; every optional field may be null: not set)."""

    model_config = _STRICT
    model: Text
    max_tokens: int
    messages: list[AnthropicMessage]
    system: Text | list[ContentBlock] | None = None
    stop_sequences: list[Text] | None = None
    stream: bool | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    metadata: dict | None = None
    tools: list | None = None
    tool_choice: dict | None = None
    thinking: dict | None = None
    seed: int | None = None
    return_token_ids: bool | None = None


def error_body(message: str, type: str = "invalid_request_error") -> dict:
    """Anthropic's error object ``{"type": "error", "error": {"type", "message"}}``."""
    return {"type": "error", "error": {"type": type, "message": message}}


def error_response(status: int, message: str) -> JSONResponse:
    """An Anthropic error answer: the error type of ``status`` (400 ``invalid_request_error``, 404
    ``not_found_error``, 500 ``api_error``, 503 / 529 ``overloaded_error``; other 4xx invalid request, 5xx api)."""
    kind = ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    retry = {"Retry-After": str(RETRY_AFTER_S)} if status in RETRY_STATUSES else None
    return JSONResponse(error_body(message, kind), status_code=status, headers=retry)


class AnthropicRoute(APIRoute):
    """A route whose errors are Anthropic-shaped: request validation (400), ``OpenAIError`` raised by the shared
    checks (its status), and any unexpected exception (500 ``api_error``; the server stays up)."""

    def get_route_handler(self):
        handler = super().get_route_handler()

        async def handle(request: Request):
            try:
                return await handler(request)
            except RequestValidationError as e:
                return error_response(400, validation_message(e.errors())[0])
            except OpenAIError as e:
                return error_response(e.status, e.message)
            except Exception as e:  # never a bare 500 in OpenAI's shape on this route
                return error_response(500, f"internal error: {e.__class__.__name__}: {e}")

        return handle


def _text(content: str | list[ContentBlock], where: str) -> str:
    """The text of a string or of text blocks (concatenated).

    Raises:
        OpenAIError: 400 for a block that is not text (``where`` names the field), or a text block without text.
    """
    if isinstance(content, str):
        return content
    for i, b in enumerate(content):
        if b.type != "text":
            raise OpenAIError(400, f"{where}.{i}: content blocks of type {b.type!r} are not supported by this "
                              "server (text only)")
        if b.text is None:
            raise OpenAIError(400, f"{where}.{i}.text: Field required")
    return "".join(b.text for b in content)


def refuse_unsupported(body) -> None:
    """Refuse what this server parses but cannot honour: extended thinking.

    Raises:
        OpenAIError: 400 naming the field.
    """
    if body.thinking is not None and body.thinking.get("type") != "disabled":
        raise OpenAIError(400, "thinking: extended thinking is not supported by this server")


def _tool_result(b: ContentBlock, where: str, ledger: CallLedger) -> dict:
    """A ``tool_result`` block as a chat template's ``tool`` message (an error's text marked ``Error:``: chat
    templates have no field for it)."""
    if b.tool_use_id is None:
        raise OpenAIError(400, f"{where}.tool_use_id: Field required")
    name = ledger.result(b.tool_use_id, f"{where}.tool_use_id")
    text = _text(b.content if b.content is not None else "", f"{where}.content")
    return {"role": "tool", "content": f"Error: {text}" if b.is_error else text, "tool_call_id": b.tool_use_id,
            "name": name}


def _message(m: AnthropicMessage, i: int, ledger: CallLedger) -> list[dict]:
    """The chat-template messages of one message: a user's ``tool_result`` blocks as ``tool`` messages (then its
    text, if any, as a user message); an assistant's text and ``tool_use`` blocks as one message with
    ``tool_calls``.

    Raises:
        OpenAIError: 400 for a block of another type, or one missing its fields (``serve.tool_requests``).
    """
    if isinstance(m.content, str):
        return [{"role": m.role, "content": m.content}]
    texts, calls, results = [], [], []
    for j, b in enumerate(m.content):
        where = f"messages.{i}.content.{j}"
        if b.type == "text":
            texts.append(_text([b], where.rsplit(".", 1)[0]))
        elif b.type == "tool_use" and m.role == "assistant":
            if b.id is None or b.name is None:
                raise OpenAIError(400, f"{where}: a tool_use block needs its id and name")
            calls.append(ledger.call(b.id, b.name, b.input if b.input is not None else {}, f"{where}.input"))
        elif b.type == "tool_result" and m.role == "user":
            results.append(_tool_result(b, where, ledger))
        else:
            raise OpenAIError(400, f"{where}: content blocks of type {b.type!r} are not supported by this server in "
                              f"{m.role} messages (text, tool_use from the assistant, tool_result from the user)")
    if m.role == "assistant":
        return [{"role": "assistant", "content": "".join(texts)} | ({"tool_calls": calls} if calls else {})]
    return results + ([{"role": "user", "content": "".join(texts)}] if texts or not results else [])


def chat_messages(body) -> tuple[list[dict], bool]:
    """``(messages, prefill)`` for the chat template: the system prompt (if any and non-empty) as a ``system``
    message, then the messages (``_message``); ``prefill``: the last one is the assistant's start, which
    generation continues (an empty one is left out: the model starts its turn as usual).

    Raises:
        OpenAIError: 400 for no message, a block this server does not take, a tool result answering no earlier
            call, a final assistant message ending in whitespace or holding tool calls.
    """
    if not body.messages:
        raise OpenAIError(400, "messages: must hold at least one message")
    msgs = []
    if body.system is not None and (system := _text(body.system, "system")):
        msgs.append({"role": "system", "content": system})
    ledger = CallLedger()
    for i, m in enumerate(body.messages):
        msgs += _message(m, i, ledger)
    prefill = msgs[-1]["role"] == "assistant"
    if prefill and "tool_calls" in msgs[-1]:
        raise OpenAIError(400, "messages: the final assistant message holds tool_use blocks; answer them with "
                          "tool_result blocks in a user message")
    if prefill and not msgs[-1]["content"]:
        msgs.pop()
        prefill = False
    if prefill and msgs[-1]["content"] != msgs[-1]["content"].rstrip():
        raise OpenAIError(400, "messages: final assistant content cannot end with trailing whitespace")
    if not msgs or msgs[-1]["role"] == "system":
        raise OpenAIError(400, "messages: must hold a user message")
    return msgs, prefill


def job_params(state, body: MessagesRequest, prompt_tokens: int):
    """``jobs.Params`` of a request, through the server's own checks (``ServeState.params``), with Anthropic's
    temperature range [0, 1] and any number of non-empty ``stop_sequences``.

    Raises:
        OpenAIError: 400 for a setting out of range or a prompt + ``max_tokens`` above the context.
    """
    if body.temperature is not None and not 0 <= body.temperature <= 1:
        raise OpenAIError(400, f"temperature: must be in [0, 1], got {body.temperature}")
    stop = list(body.stop_sequences or [])
    if any(not s for s in stop):
        raise OpenAIError(400, "stop_sequences: every stop sequence must be a non-empty string")
    view = SimpleNamespace(n=None, seed=body.seed, presence_penalty=None, frequency_penalty=None, logit_bias=None,
                           stop=None, temperature=body.temperature, top_p=body.top_p, top_k=body.top_k)
    return dataclasses.replace(state.params(view, prompt_tokens, body.max_tokens), stop=stop)


def message_body(mid: str, model: str, ev: Done, token_ids: bool, turn: ToolTurn | None = None) -> dict:
    """The non-streamed answer: a ``message`` with a text block (when there is text, or no call) and a
    ``tool_use`` block per call (``turn``: the request's tools), the stop reason and usage (tokens)."""
    text, calls = turn.parse(ev.text, TOOL_ID_PREFIX) if turn is not None else (ev.text, [])
    content = ([{"type": "text", "text": text}] if text or not calls else []) + [tool_use(c) for c in calls]
    out = {"id": mid, "type": "message", "role": "assistant", "model": model, "content": content,
           "stop_reason": stop_reason(ev, bool(calls)), "stop_sequence": ev.stop_sequence,
           "usage": {"input_tokens": ev.prompt_tokens, "output_tokens": len(ev.token_ids)}}
    if token_ids:
        out["token_ids"] = ev.token_ids
    return out


def anthropic_router(state) -> APIRouter:
    """``POST /v1/messages`` and ``/v1/messages/count_tokens`` over ``state`` (``state.ServeState``), with
    Anthropic-shaped errors."""
    router = APIRouter(route_class=AnthropicRoute)

    def prompt_ids(body):
        """``(prompt token ids, ToolTurn or None)`` of a Messages or a count_tokens request (the same checks and
        refusals; ``ServeState.encode_chat``)."""
        state.check_model(body.model)
        refuse_unsupported(body)
        tools = anthropic_tools(body.tools, body.tool_choice)
        msgs, prefill = chat_messages(body)
        ids, turn = state.encode_chat(msgs, tools, continue_final=prefill)
        return ids, turn, tools

    @router.post("/v1/messages/count_tokens")
    async def count_tokens(body: CountTokensRequest):
        return {"input_tokens": len(prompt_ids(body)[0])}

    @router.post("/v1/messages")
    async def messages(body: MessagesRequest, request: Request):
        ids, turn, tools = prompt_ids(body)
        state.check_tool_room(tools, len(ids))
        params = job_params(state, body, len(ids))
        check_queue(state.worker, state.max_queue, 529)
        job = Job(ids, params, asyncio.get_running_loop())
        state.worker.submit(job)
        mid = "msg_" + uuid.uuid4().hex
        finished = lambda ev: request.app.state.metrics.finished("/v1/messages", job, ev)  # noqa: E731
        if body.stream:
            return EventSourceResponse(stream_events(state, job, mid, bool(body.return_token_ids), finished, turn),
                                       headers={"Cache-Control": "no-cache"})
        ev = await wait_result(state.worker, job, request.is_disconnected, finished)
        if ev is None:
            return error_response(499, "client disconnected")
        if isinstance(ev, Failed):
            return error_response(ev.status, ev.message)
        return message_body(mid, state.model_name, ev, bool(body.return_token_ids), turn)

    return router
