"""OpenAI request schemas (pydantic, strict types) and the OpenAI-style error body.

Only what the engine can honour is accepted: one choice (``n`` = 1), no log-probabilities, no penalties, no
tools. A parameter with a wrong JSON type is a 400 (strict validation: ``"5"`` is not an integer, ``true`` is not a
number); unknown extra fields are ignored, as OpenAI-compatible servers commonly do.

Integer fields are range-checked before a request is queued (``ServeState.params``; a 400 naming the field):
``seed`` must be in [0, 2**32 - 1] (``moe_offload.seeds``: one seed mapping shared with ``generate --seed``), ``n``
1, ``max_tokens`` / ``max_completion_tokens`` at least 1 and within the context, token ids within the vocabulary.

Defaults that differ from OpenAI's: ``temperature`` defaults to 0 (greedy), as ``moe-offload generate`` does, so
that a request without sampling settings gives ``generate``'s tokens; ``max_tokens`` defaults to the rest of the
context (``--max-context`` minus the prompt).

Extension: ``return_token_ids: true`` adds the generated token ids to every choice (non-streamed) and to every
streamed delta (``choices[0].token_ids``), for exact comparisons with ``generate``.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

_STRICT = ConfigDict(strict=True, extra="ignore")


class TextPart(BaseModel):
    """A content part ``{"type": "text", "text": ...}`` (the only kind a text model takes)."""

    model_config = _STRICT
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """One chat message; ``content`` is a string or a list of text parts (concatenated)."""

    model_config = _STRICT
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class StreamOptions(BaseModel):
    model_config = _STRICT
    include_usage: bool = False


class _Common(BaseModel):
    """Parameters shared by chat completions and completions (OpenAI names)."""

    model_config = _STRICT
    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int | None = None
    user: str | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict | None = None
    return_token_ids: bool = False


class ChatCompletionRequest(_Common):
    """``POST /v1/chat/completions`` body."""

    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    tools: list | None = None


class CompletionRequest(_Common):
    """``POST /v1/completions`` body: ``prompt`` is a string, a one-string list, or a list of token ids."""

    prompt: str | list[str] | list[int] = Field(union_mode="left_to_right")
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None
    best_of: int | None = None


class OpenAIError(Exception):
    """A request error answered with an OpenAI-style JSON body.

    Args:
        status: HTTP status (4xx).
        message: human-readable message.
        param: the offending request field, if any.
        code: OpenAI error code (e.g. ``model_not_found``), if any.
        type: OpenAI error type (``invalid_request_error`` for 4xx).
    """

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type

    def body(self) -> dict:
        """``{"error": {"message", "type", "param", "code"}}``."""
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    """The OpenAI error object ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}
