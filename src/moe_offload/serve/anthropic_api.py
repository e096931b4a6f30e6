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
``continue_final_message``) and the answer holds only the continuation. Refused with a 400: ``tools`` /
``tool_choice``, ``thinking`` (other than ``{"type": "disabled"}``), content blocks other than text (images,
documents, tool use / results, thinking), and a final assistant message that ends in whitespace (as Anthropic's
API refuses it).

``POST /v1/messages/count_tokens`` answers ``{"input_tokens": N}``: the tokens the chat template gives the
request's system prompt and messages, what ``usage.input_tokens`` of the same ``/v1/messages`` request reports
(``max_tokens`` is not needed; the same refusals). An ``anthropic-beta`` header is accepted and ignored.

Errors are Anthropic's shape, ``{"type": "error", "error": {"type", "message"}}``: 400 ``invalid_request_error``
(validation, parameters, context length), 404 ``not_found_error`` (unknown model), 503 ``overloaded_error`` (the
server is shutting down; the OpenAI side's 503), 500 ``api_error`` (an engine failure). A stream that fails after
it started ends with an ``error`` event in the same shape.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import uuid
from types import SimpleNamespace
from typing import Literal

from fastapi import APIRouter, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from fastapi.sse import EventSourceResponse, format_sse_event
from pydantic import BaseModel

from .protocol import _STRICT, OpenAIError, Text, validation_message
from .jobs import Delta, Done, Failed, Job, wait_result

_ERROR_TYPES = {400: "invalid_request_error", 404: "not_found_error", 413: "request_too_large",
                429: "rate_limit_error", 500: "api_error", 503: "overloaded_error", 529: "overloaded_error"}


class ContentBlock(BaseModel):
    """A content block: ``{"type": "text", "text"}`` is the only kind served; any other ``type`` parses only to
    be refused (``refuse_unsupported``)."""

    model_config = _STRICT
    type: Text
    text: Text | None = None


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
    kind = _ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return JSONResponse(error_body(message, kind), status_code=status)


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
    """Refuse what this server parses but cannot honour: tools, tool choice, extended thinking.

    Raises:
        OpenAIError: 400 naming the field.
    """
    if body.tools or body.tool_choice is not None:
        raise OpenAIError(400, f"{'tools' if body.tools else 'tool_choice'}: tool use is not supported by this server")
    if body.thinking is not None and body.thinking.get("type") != "disabled":
        raise OpenAIError(400, "thinking: extended thinking is not supported by this server")


def chat_messages(body) -> tuple[list[dict], bool]:
    """``([{"role", "content": str}], prefill)`` for the chat template: the system prompt (if any and non-empty)
    as a ``system`` message, then the messages; ``prefill``: the last one is the assistant's start, which
    generation continues (an empty one is left out: the model starts its turn as usual).

    Raises:
        OpenAIError: 400 for no message, a non-text block, or a final assistant message ending in whitespace.
    """
    if not body.messages:
        raise OpenAIError(400, "messages: must hold at least one message")
    msgs = []
    if body.system is not None and (system := _text(body.system, "system")):
        msgs.append({"role": "system", "content": system})
    msgs += [{"role": m.role, "content": _text(m.content, f"messages.{i}.content")}
             for i, m in enumerate(body.messages)]
    prefill = msgs[-1]["role"] == "assistant"
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


def stop_reason(ev: Done) -> str:
    """Anthropic's ``stop_reason`` of a finished request: ``stop_sequence``, ``end_turn`` (EOS) or
    ``max_tokens`` (``max_tokens`` or the model's position limit)."""
    if ev.stop_sequence is not None:
        return "stop_sequence"
    return "end_turn" if ev.finish_reason == "stop" else "max_tokens"


def message_body(mid: str, model: str, ev: Done, token_ids: bool) -> dict:
    """The non-streamed answer: a ``message`` with one text block, the stop reason and usage (tokens)."""
    out = {"id": mid, "type": "message", "role": "assistant", "model": model,
           "content": [{"type": "text", "text": ev.text}], "stop_reason": stop_reason(ev),
           "stop_sequence": ev.stop_sequence,
           "usage": {"input_tokens": ev.prompt_tokens, "output_tokens": len(ev.token_ids)}}
    if token_ids:
        out["token_ids"] = ev.token_ids
    return out


def _event(name: str, data: dict) -> bytes:
    return format_sse_event(event=name, data_str=json.dumps(dict(type=name, **data), separators=(",", ":")))


async def stream_events(state, job: Job, mid: str, token_ids: bool, finished=lambda ev: None):
    """Anthropic's server-sent events of one request: ``message_start``, ``content_block_start``, ``ping``,
    ``content_block_delta`` (``text_delta``) as text becomes final, ``content_block_stop``, ``message_delta``
    (``stop_reason``, ``stop_sequence``, usage), ``message_stop``; a failure ends it with an ``error`` event.
    Cancels the job if the stream is abandoned; ``finished(last event)`` counts it in the metrics."""
    n_in = len(job.prompt_ids)
    ev = None
    try:
        yield _event("message_start", {"message": {
            "id": mid, "type": "message", "role": "assistant", "model": state.model_name, "content": [],
            "stop_reason": None, "stop_sequence": None, "usage": {"input_tokens": n_in, "output_tokens": 0}}})
        yield _event("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}})
        yield _event("ping", {})
        while True:
            ev = await job.events.get()
            if isinstance(ev, Delta):
                if ev.text or (token_ids and ev.token_ids):
                    extra = {"token_ids": ev.token_ids} if token_ids else {}
                    yield _event("content_block_delta", {"index": 0, "delta": {"type": "text_delta",
                                                                               "text": ev.text}} | extra)
            elif isinstance(ev, Done):
                yield _event("content_block_stop", {"index": 0})
                yield _event("message_delta", {
                    "delta": {"stop_reason": stop_reason(ev), "stop_sequence": ev.stop_sequence},
                    "usage": {"input_tokens": n_in, "output_tokens": len(ev.token_ids)}})
                yield _event("message_stop", {})
                return
            else:  # Failed: an engine error (500) or the server shutting down (503)
                yield _event("error", {"error": {"type": _ERROR_TYPES.get(ev.status, "api_error"),
                                                 "message": ev.message}})
                return
    finally:
        finished(ev)
        if not isinstance(ev, (Done, Failed)):  # abandoned: the client disconnected mid-stream
            state.worker.cancel(job)


def anthropic_router(state) -> APIRouter:
    """``POST /v1/messages`` and ``/v1/messages/count_tokens`` over ``state`` (``state.ServeState``), with
    Anthropic-shaped errors."""
    router = APIRouter(route_class=AnthropicRoute)

    def prompt_ids(body) -> list[int]:
        """The prompt's token ids of a Messages or a count_tokens request (the same checks and refusals)."""
        state.check_model(body.model)
        refuse_unsupported(body)
        msgs, prefill = chat_messages(body)
        return state.encode_messages(msgs, continue_final=prefill)

    @router.post("/v1/messages/count_tokens")
    async def count_tokens(body: CountTokensRequest):
        return {"input_tokens": len(prompt_ids(body))}

    @router.post("/v1/messages")
    async def messages(body: MessagesRequest, request: Request):
        ids = prompt_ids(body)
        job = Job(ids, job_params(state, body, len(ids)), asyncio.get_running_loop())
        state.worker.submit(job)
        mid = "msg_" + uuid.uuid4().hex
        finished = lambda ev: request.app.state.metrics.finished("/v1/messages", job, ev)  # noqa: E731
        if body.stream:
            return EventSourceResponse(stream_events(state, job, mid, bool(body.return_token_ids), finished),
                                       headers={"Cache-Control": "no-cache"})
        ev = await wait_result(state.worker, job, request.is_disconnected, finished)
        if ev is None:
            return error_response(499, "client disconnected")
        if isinstance(ev, Failed):
            return error_response(ev.status, ev.message)
        return message_body(mid, state.model_name, ev, bool(body.return_token_ids))

    return router
