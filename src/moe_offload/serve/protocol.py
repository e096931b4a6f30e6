"""OpenAI request schemas (pydantic, strict types) and the OpenAI-style error body.

Only what the engine can honour is accepted: one choice (``n`` = 1), no log-probabilities, no penalties, no
legacy ``functions`` (``tools`` instead: ``serve.tool_requests``), no ``response_format`` but text. A parameter with a wrong JSON type is a 400 (strict validation:
``"5"`` is not an integer, ``true`` is not a number); unknown extra fields are ignored, as OpenAI-compatible servers
commonly do. Every optional field may be sent as ``null``, which means "not set" (as in the OpenAI API; several
client libraries send every field). Numbers must be finite (``NaN`` / ``Infinity``, which Python's JSON parser
accepts, are a 400 naming the field), and strings valid Unicode (a lone UTF-16 surrogate such as ``"\\ud83d"`` is
a 400 naming the field: it cannot be tokenized or echoed).

Integer fields are range-checked before a request is queued (``ServeState.params``; a 400 naming the field):
``seed`` must be in [0, 2**32 - 1] (``moe_offload.common.seeds``: one seed mapping shared with ``generate --seed``) or -1,
which means no seed (llama.cpp's and many UIs' "random seed"; other negative seeds are a 400), ``n`` 1,
``max_tokens`` / ``max_completion_tokens`` at least 1 and within the context, token ids within the vocabulary,
``top_k`` -1 or 0 (off) or positive.

Sampling edges (``moe_offload.generation.sampling``, the one sampler of both servers, ``generate`` and the diffusion loop): a
``temperature`` below ``generation.sampling.GREEDY_TEMPERATURE`` (1e-5), 0 included, is greedy; ``top_p`` in [0, 1] always
keeps the most probable token (0: only it); ``top_k`` 1 is greedy and ``top_k`` at least the vocabulary size is off.

Defaults that differ from OpenAI's: ``temperature`` defaults to 0 (greedy), as ``moe-offload generate`` does, so
that a request without sampling settings gives ``generate``'s tokens; ``max_tokens`` defaults to the rest of the
context (``--max-context`` minus the prompt).

Extensions: ``return_token_ids: true`` adds the generated token ids to every choice (non-streamed) and to every
streamed delta (``choices[0].token_ids``), for exact comparisons with ``generate``; ``top_k`` (as vLLM and
llama.cpp take it).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

_STRICT = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


def _unicode(s: str) -> str:
    """``s`` itself when it encodes to UTF-8.

    Raises:
        ValueError: a lone UTF-16 surrogate (JSON ``"\\ud83d"`` without its pair), which no tokenizer takes."""
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"contains a lone UTF-16 surrogate (\\u{ord(s[e.start]):04x} at character {e.start}); "
                         "strings must be valid Unicode") from None
    return s


Text = Annotated[str, AfterValidator(_unicode)]  # a string field: valid Unicode (no lone surrogates)


class TextPart(BaseModel):
    """A content part ``{"type": "text", "text": ...}`` (the only kind a text model takes)."""

    model_config = _STRICT
    type: Literal["text"]
    text: Text


class FunctionCall(BaseModel):
    """The function of an earlier tool call: ``name`` and ``arguments`` (a JSON string, as OpenAI sends it; an
    object is taken too)."""

    model_config = _STRICT
    name: Text
    arguments: Text | dict


class ToolCallIn(BaseModel):
    """An assistant's earlier tool call, ``{"id", "type": "function", "function": {"name", "arguments"}}``."""

    model_config = _STRICT
    id: Text
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    """One chat message; ``content`` is a string or a list of text parts (concatenated). An assistant message may
    carry ``tool_calls`` (its ``content`` then null or text); a ``tool`` message answers one by ``tool_call_id``."""

    model_config = _STRICT
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[TextPart] | None = None
    name: Text | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: Text | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class StreamOptions(BaseModel):
    model_config = _STRICT
    include_usage: bool | None = None


class _Common(BaseModel):
    """Parameters shared by chat completions and completions (OpenAI names; every optional one may be null)."""

    model_config = _STRICT
    model: Text
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stop: Text | list[Text] | None = None
    seed: int | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    n: int | None = None
    user: Text | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict | None = None
    response_format: dict | None = None
    return_token_ids: bool | None = None


class ChatCompletionRequest(_Common):
    """``POST /v1/chat/completions`` body. ``tools`` / ``tool_choice`` are checked by ``serve.tool_requests``;
    ``logprobs`` / ``top_logprobs`` and the older ``functions`` / ``function_call`` are parsed only to be refused
    (``app.refuse_unsupported``)."""

    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list | None = None
    tool_choice: str | dict | None = None
    functions: list | None = None
    function_call: str | dict | None = None


class CompletionRequest(_Common):
    """``POST /v1/completions`` body: ``prompt`` is a string, a one-string list, or a list of token ids."""

    prompt: Text | list[Text] | list[int] = Field(union_mode="left_to_right")
    echo: bool | None = None
    logprobs: int | None = None
    suffix: Text | None = None
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


_TYPE_TAGS = {"str", "int", "float", "bool", "dict", "list", "none", "literal"}


def _param_path(loc) -> str | None:
    """The request field of a pydantic error location: body fields and list indexes joined with dots, without
    the union-member tags pydantic adds (``str``, ``list[int]``, ``function-after[...]``, model names)."""
    keep = [str(x) for x in loc if isinstance(x, int) or (
        x != "body" and str(x).isidentifier() and str(x).lower() not in _TYPE_TAGS and not str(x)[:1].isupper())]
    return ".".join(keep) or None


def validation_message(errors: list[dict]) -> tuple[str, str | None]:
    """``(message, param)`` of a request that failed validation (``RequestValidationError.errors()``): our own
    checks (a lone surrogate) before type mismatches of other union members; invalid JSON and a body that is
    not an object have no param."""
    e = next((x for x in errors if x.get("type") in ("value_error", "finite_number")), errors[0] if errors else {})
    loc = e.get("loc", ())
    if e.get("type") == "json_invalid":  # loc is ("body", character offset): not a parameter
        at = f" at character {loc[1]}" if len(loc) > 1 else ""
        return f"the request body is not valid JSON{at}: {e.get('ctx', {}).get('error', e.get('msg'))}", None
    param = _param_path(loc)
    if not param and e.get("type") in ("model_attributes_type", "dict_type"):
        return "the request body must be a JSON object (send it with Content-Type: application/json)", None
    msg = str(e.get("msg", "invalid value")).removeprefix("Value error, ")
    return f"{param or 'body'}: {msg}", param
