"""The OpenAI-compatible HTTP API (FastAPI): ``/v1/models``, ``/v1/chat/completions``, ``/v1/completions``,
``/v1/stats``, ``/health``, and Prometheus metrics at ``/metrics`` (``serve.metrics``); Anthropic's ``/v1/messages``
comes from ``anthropic_api`` (its own error shape).

Chat completions take ``tools`` and ``tool_choice`` (``none``, ``auto``, ``required``, a named function;
``serve.tool_requests``): the tools are rendered by the model's chat template, an assistant's earlier
``tool_calls`` and ``tool`` messages fed back, and the answer's calls parsed with transformers' response parsing
(``serve.tool_output``) into ``message.tool_calls`` (finish reason ``tool_calls``; streamed as one
``delta.tool_calls`` chunk per call as it closes). A call the model wrote that does not parse comes back as text.

Streaming responses are server-sent events (``data: {chunk}`` ... ``data: [DONE]``); a client that disconnects
mid-stream cancels its request (Starlette cancels the response stream; the stream's ``finally`` cancels the job).
Every request error is an OpenAI-style JSON body with a 4xx status; an unexpected failure inside the engine is a
500 for that request only (the worker and the server stay up); a request that the shutdown (Ctrl-C / SIGTERM) ends
gets a 503 JSON error (code ``server_shutting_down``), or, when streamed, that error as its final event before
``[DONE]``.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse
from fastapi.sse import EventSourceResponse, format_sse_event
from starlette.exceptions import HTTPException as StarletteHTTPException

from .anthropic_api import anthropic_router, error_response as anthropic_error
from .metrics import install_metrics
from .protocol import ChatCompletionRequest, CompletionRequest, OpenAIError, error_body, validation_message
from .jobs import Delta, Done, Failed, Job, Params, wait_result
from .limits import RETRY_AFTER_S, RETRY_STATUSES, BodyLimit, check_queue
from .state import ServeState
from .tool_output import ToolCall, ToolTurn
from .tool_requests import openai_tools

CALL_ID_PREFIX = "call_"  # OpenAI's tool call ids

def refuse_unsupported(body, chat: bool) -> None:
    """Refuse the OpenAI fields this server parses but cannot honour, rather than ignore them silently: a
    ``response_format`` other than ``{"type": "text"}`` (no constrained decoding), log-probabilities (chat
    ``logprobs: true`` / ``top_logprobs``; completions ``logprobs``, 0 included), the legacy functions (a non-empty
    ``functions``, any ``function_call``: ``tools`` instead), and completions' ``echo``, ``suffix``, ``best_of`` > 1.
    Null, false and empty values mean "not set" and pass.

    Raises:
        OpenAIError: 400 naming the first such field.
    """
    fmt = body.response_format
    if fmt is not None and fmt != {"type": "text"}:
        raise OpenAIError(400, f"response_format {fmt.get('type')!r} is not supported: this server does not "
                          "constrain its output (only {\"type\": \"text\"})", param="response_format")
    if chat:
        bad = [("logprobs", bool(body.logprobs)), ("top_logprobs", body.top_logprobs is not None),
               ("functions", bool(body.functions)), ("function_call", body.function_call is not None)]
    else:
        bad = [("logprobs", body.logprobs is not None), ("echo", bool(body.echo)), ("suffix", bool(body.suffix)),
               ("best_of", body.best_of not in (None, 1))]
    for name, refused in bad:
        if refused:
            what = ("the legacy function calling is not supported (send tools), and it is" if name in (
                "functions", "function_call") else f"{name} is")
            raise OpenAIError(400, f"{name}: {what} not supported by this server", param=name)


def error_bytes(path: str, err: OpenAIError) -> bytes:
    """An error's JSON body in the shape of the API that ``path`` belongs to (Anthropic's under ``/v1/messages``,
    else OpenAI's)."""
    if path == "/v1/messages" or path.startswith("/v1/messages/"):
        return bytes(anthropic_error(err.status, err.message).body)
    return json.dumps(err.body()).encode()


def _now() -> int:
    return int(time.time())


def _install_error_handlers(app: FastAPI) -> None:
    """The OpenAI-shaped answers of every error outside Anthropic's routes: ``OpenAIError`` (its status; 503 / 529
    with ``Retry-After``), request validation (400), Starlette's HTTP errors (404, 405, ...), and any unexpected
    exception (500 ``server_error``; the server stays up)."""

    @app.exception_handler(OpenAIError)
    async def _openai_error(request: Request, exc: OpenAIError):
        retry = {"Retry-After": str(RETRY_AFTER_S)} if exc.status in RETRY_STATUSES else None
        return JSONResponse(exc.body(), status_code=exc.status, headers=retry)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        msg, param = validation_message(exc.errors())
        return JSONResponse(error_body(msg, param=param), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        return JSONResponse(error_body(str(exc.detail)), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception):
        return JSONResponse(error_body(f"internal error: {exc.__class__.__name__}: {exc}", type="server_error"),
                            status_code=500)


def create_app(state: ServeState) -> FastAPI:
    """The FastAPI application over ``state``; its lifespan starts and stops the worker thread.

    Every GET route also answers HEAD (load balancers and uptime checks probe ``HEAD /health``). Browsers get
    CORS through Starlette's ``CORSMiddleware``, which answers preflight ``OPTIONS`` requests: origins
    ``state.cors_origins`` (``serve --cors-origins``), any method and header, no credentials. The default, any
    origin (``*``), is what vLLM and llama.cpp's servers do, so a browser chat UI on another port or host can use
    the API; it is safe enough because the server keeps no cookies or sessions (``allow_credentials`` stays
    False, so a page cannot act with a user's credentials) and listens on 127.0.0.1 unless told otherwise; a
    server exposed on a network can name its origins or send none (no CORS headers: browsers then refuse
    cross-origin pages).
    """

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state.worker.start()
        try:
            yield
        finally:
            await asyncio.to_thread(state.worker.stop)

    app = FastAPI(title="moe-offload", lifespan=lifespan)
    app.state.serve = state
    if state.cors_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(state.cors_origins), allow_methods=["*"],
                           allow_headers=["*"], allow_credentials=False)
    install_metrics(app, state)  # GET /metrics, the HTTP request counter, app.state.metrics
    app.add_middleware(BodyLimit, limit=state.max_request_bytes, error_bytes=error_bytes)  # 413 (serve.limits)

    _install_error_handlers(app)

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health():
        return {"status": "ok", "model": state.model_name}

    @app.api_route("/v1/models", methods=["GET", "HEAD"])
    async def models():
        return {"object": "list", "data": [{"id": state.model_name, "object": "model", "created": state.created,
                                            "owned_by": "moe-offload", "max_model_len": state.max_context}]}

    @app.api_route("/v1/stats", methods=["GET", "HEAD"])
    async def stats():
        return state.stats()

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        state.check_model(body.model)
        refuse_unsupported(body, chat=True)
        tools = openai_tools(body.tools, body.tool_choice)
        ids, turn = state.chat_prompt(body, tools)
        state.check_tool_room(tools, len(ids))
        which = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        params = state.params(body, len(ids), getattr(body, which), which)
        return await _respond(state, request, body, ids, params, chat=True, turn=turn)

    app.include_router(anthropic_router(state))  # POST /v1/messages (serve/anthropic_api.py)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        state.check_model(body.model)
        refuse_unsupported(body, chat=False)
        ids = state.completion_prompt(body)
        params = state.params(body, len(ids), body.max_tokens)
        return await _respond(state, request, body, ids, params, chat=False)

    return app


async def _respond(state: ServeState, request: Request, body, ids: list[int], params: Params, chat: bool,
                   turn: ToolTurn | None = None):
    check_queue(state.worker, state.max_queue, 503)
    job = Job(ids, params, asyncio.get_running_loop())
    endpoint = "/v1/chat/completions" if chat else "/v1/completions"
    finished = lambda ev: request.app.state.metrics.finished(endpoint, job, ev)  # noqa: E731
    state.worker.submit(job)
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
    created = _now()
    obj = "chat.completion" if chat else "text_completion"
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return EventSourceResponse(_stream(state, job, rid, created, chat, include_usage, body.return_token_ids,
                                           finished, turn),
                                   headers={"Cache-Control": "no-cache"})
    ev = await wait_result(state.worker, job, request.is_disconnected, finished)
    if ev is None:
        return JSONResponse(error_body("client disconnected"), status_code=499)
    if isinstance(ev, Failed):
        return JSONResponse(error_body(ev.message, type="server_error", code=ev.code), status_code=ev.status)
    choice = {"index": 0, "finish_reason": ev.finish_reason, "logprobs": None}
    if chat and turn is not None:
        content, calls = turn.parse(ev.text, CALL_ID_PREFIX)
        choice["message"] = {"role": "assistant", "content": content or (None if calls else "")}
        if calls:
            choice["message"]["tool_calls"] = [_call(c) for c in calls]
            choice["finish_reason"] = "tool_calls"
    elif chat:
        choice["message"] = {"role": "assistant", "content": ev.text}
    else:
        choice["text"] = ev.text
    if body.return_token_ids:
        choice["token_ids"] = ev.token_ids
    return {"id": rid, "object": obj, "created": created, "model": state.model_name, "choices": [choice],
            "usage": _usage(ev)}


def _usage(ev: Done) -> dict:
    n = len(ev.token_ids)
    return {"prompt_tokens": ev.prompt_tokens, "completion_tokens": n, "total_tokens": ev.prompt_tokens + n}


def _sse(obj) -> bytes:
    return format_sse_event(data_str=json.dumps(obj, separators=(",", ":")))


def _call(c: ToolCall, index: int | None = None) -> dict:
    """A parsed call as OpenAI carries it (``index``: its place in a streamed answer's calls)."""
    out = {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments_json()}}
    return out if index is None else {"index": index} | out


class _Chunks:
    """The chunks of one streamed OpenAI answer (``head``: id, object, created, model): text deltas, one
    ``delta.tool_calls`` chunk per parsed call (``calls``: how many so far, their indexes), ``token_ids`` when asked."""

    def __init__(self, head: dict, chat: bool, token_ids: bool):
        self.head, self.chat, self.token_ids, self.calls = head, chat, token_ids, 0

    def text(self, text: str | None, ids: list[int] | None, finish: str | None, role: bool = False) -> bytes:
        if self.chat:
            delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text is not None else {})
            c = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
        else:
            c = {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}
        if self.token_ids and ids is not None:
            c["token_ids"] = ids
        return _sse(dict(self.head, choices=[c]))

    def items(self, items: list, ids: list[int] | None):
        """Chunks of parsed items (``tool_output.ToolStream``): content text and calls."""
        for item in items:
            if isinstance(item, ToolCall):
                c = {"index": 0, "delta": {"tool_calls": [_call(item, self.calls)]}, "finish_reason": None,
                     "logprobs": None}
                self.calls += 1
                yield _sse(dict(self.head, choices=[c]))
            else:
                yield self.text(item, ids, None)
                ids = None
        if self.token_ids and ids:
            yield self.text(None, ids, None)


async def _stream(state: ServeState, job: Job, rid: str, created: int, chat: bool, include_usage: bool,
                  token_ids: bool, finished, turn: ToolTurn | None = None):
    """Server-sent events of one request: chunks as tokens (or diffusion blocks) become final, a last chunk with
    the finish reason, an optional usage chunk, then ``[DONE]``. With tools (``turn``), content chunks as the parser
    makes text final and a ``delta.tool_calls`` chunk per call as it closes, finish reason ``tool_calls``. Cancels
    the job if the stream is abandoned; ``finished(last event)`` counts the request in the metrics when the stream
    ends."""
    head = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
            "model": state.model_name}
    out = _Chunks(head, chat, token_ids)
    parser = turn.stream(CALL_ID_PREFIX) if turn is not None else None
    ev = None
    try:
        if chat:
            yield out.text(None, None, None, role=True)
        while True:
            ev = await job.events.get()
            if isinstance(ev, Delta) and parser is not None:
                for c in out.items(parser.feed(ev.text), ev.token_ids):
                    yield c
            elif isinstance(ev, Delta):
                if ev.text or (token_ids and ev.token_ids):
                    yield out.text(ev.text, ev.token_ids, None)
            elif isinstance(ev, Done):
                for c in out.items(parser.finish() if parser is not None else [], None):
                    yield c
                yield out.text(None if chat else "", [], "tool_calls" if out.calls else ev.finish_reason)
                if include_usage:
                    yield _sse(dict(head, choices=[], usage=_usage(ev)))
                yield format_sse_event(data_str="[DONE]")
                return
            else:  # Failed (an engine error, or the server shut down before the request finished)
                yield _sse(error_body(ev.message, type="server_error", code=ev.code))
                yield format_sse_event(data_str="[DONE]")
                return
    finally:
        finished(ev)
        if not isinstance(ev, (Done, Failed)):  # abandoned: the client disconnected mid-stream
            state.worker.cancel(job)
