"""The server-sent events of a streamed Anthropic Messages answer (``serve.anthropic_api``): the event sequence,
content blocks opened as their content comes (text, and ``tool_use`` blocks for parsed tool calls), the stop
reason.
"""

from __future__ import annotations

import json

from fastapi.sse import format_sse_event

from .jobs import Delta, Done, Failed, Job
from .tool_output import ToolCall, ToolTurn

TOOL_ID_PREFIX = "toolu_"  # Anthropic's tool_use ids
#: Anthropic's error type of each HTTP status
ERROR_TYPES = {400: "invalid_request_error", 404: "not_found_error", 413: "request_too_large",
               429: "rate_limit_error", 500: "api_error", 503: "overloaded_error", 529: "overloaded_error"}


def stop_reason(ev: Done, calls: bool = False) -> str:
    """Anthropic's ``stop_reason`` of a finished request: ``tool_use`` (its answer holds ``calls``),
    ``stop_sequence``, ``end_turn`` (EOS) or ``max_tokens`` (``max_tokens`` or the model's position limit)."""
    if calls:
        return "tool_use"
    if ev.stop_sequence is not None:
        return "stop_sequence"
    return "end_turn" if ev.finish_reason == "stop" else "max_tokens"


def tool_use(c: ToolCall) -> dict:
    """A parsed call as a ``tool_use`` content block."""
    return {"type": "tool_use", "id": c.id, "name": c.name, "input": c.arguments}


def _event(name: str, data: dict) -> bytes:
    return format_sse_event(event=name, data_str=json.dumps(dict(type=name, **data), separators=(",", ":")))


class _Blocks:
    """The content blocks of a streamed answer, opened as their content comes: a text block at the first text
    (or at once without tools, as before), a ``tool_use`` block per call (its input as one ``input_json_delta``)."""

    def __init__(self, token_ids: bool):
        self.token_ids = token_ids
        self.index = -1
        self.text_open = False
        self.calls = 0

    def text(self, text: str, ids: list[int]):
        if not self.text_open:
            yield from self.open_text()
        extra = {"token_ids": ids} if self.token_ids else {}
        yield _event("content_block_delta", {"index": self.index, "delta": {"type": "text_delta", "text": text}}
                     | extra)

    def open_text(self):
        self.index += 1
        self.text_open = True
        yield _event("content_block_start", {"index": self.index, "content_block": {"type": "text", "text": ""}})

    def close(self):
        if self.index >= 0 and self.text_open:
            self.text_open = False
            yield _event("content_block_stop", {"index": self.index})

    def call(self, c: ToolCall):
        yield from self.close()
        self.index += 1
        self.calls += 1
        yield _event("content_block_start", {"index": self.index, "content_block": {
            "type": "tool_use", "id": c.id, "name": c.name, "input": {}}})
        yield _event("content_block_delta", {"index": self.index, "delta": {
            "type": "input_json_delta", "partial_json": json.dumps(c.arguments, ensure_ascii=False)}})
        yield _event("content_block_stop", {"index": self.index})

    def items(self, items: list, ids: list[int]):
        """Events of parsed items (``tool_output.ToolStream``): text deltas and calls."""
        for item in items:
            if isinstance(item, ToolCall):
                yield from self.call(item)
            else:
                yield from self.text(item, ids)
                ids = []
        if self.token_ids and ids:
            yield from self.text("", ids)


async def stream_events(state, job: Job, mid: str, token_ids: bool, finished=lambda ev: None,
                        turn: ToolTurn | None = None):
    """Anthropic's server-sent events of one request: ``message_start``, ``content_block_start``, ``ping``,
    ``content_block_delta`` (``text_delta``) as text becomes final, ``content_block_stop``, ``message_delta``
    (``stop_reason``, ``stop_sequence``, usage), ``message_stop``; a failure ends it with an ``error`` event. With
    tools (``turn``), the text block opens at the first text and each call is a ``tool_use`` block (``_Blocks``),
    stop reason ``tool_use``. Cancels the job if the stream is abandoned; ``finished(last event)`` counts it in the
    metrics."""
    n_in = len(job.prompt_ids)
    parser = turn.stream(TOOL_ID_PREFIX) if turn is not None else None
    blocks = _Blocks(token_ids)
    ev = None
    try:
        yield _event("message_start", {"message": {
            "id": mid, "type": "message", "role": "assistant", "model": state.model_name, "content": [],
            "stop_reason": None, "stop_sequence": None, "usage": {"input_tokens": n_in, "output_tokens": 0}}})
        if parser is None:
            for out in blocks.open_text():
                yield out
        yield _event("ping", {})
        while True:
            ev = await job.events.get()
            if isinstance(ev, Delta):
                items = parser.feed(ev.text) if parser is not None else ([ev.text] if ev.text else [])
                for out in blocks.items(items, ev.token_ids):
                    yield out
            elif isinstance(ev, Done):
                for out in blocks.items(parser.finish() if parser is not None else [], []):
                    yield out
                if blocks.index < 0:  # no text and no call: one empty text block, as the non-streamed answer has
                    for out in blocks.open_text():
                        yield out
                for out in blocks.close():
                    yield out
                yield _event("message_delta", {
                    "delta": {"stop_reason": stop_reason(ev, blocks.calls > 0), "stop_sequence": ev.stop_sequence},
                    "usage": {"input_tokens": n_in, "output_tokens": len(ev.token_ids)}})
                yield _event("message_stop", {})
                return
            else:  # Failed: an engine error (500) or the server shutting down (503)
                yield _event("error", {"error": {"type": ERROR_TYPES.get(ev.status, "api_error"),
                                                 "message": ev.message}})
                return
    finally:
        finished(ev)
        if not isinstance(ev, (Done, Failed)):  # abandoned: the client disconnected mid-stream
            state.worker.cancel(job)
