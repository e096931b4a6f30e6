"""What the server refuses for its own sake (issue 48): a request body above a size, and a request that finds the
queue full, each in the API's own error shape, so that the official clients raise their own exception classes
(``anthropic``: ``ContentTooLargeError`` for 413, ``OverloadedError`` for 529; ``openai``: ``APIStatusError`` 413,
``InternalServerError`` 503) and retry the overload after ``Retry-After``.

- **Body size** (``--max-request-mb``, default 32 MB, Anthropic's limit for a Messages request): a body declaring
  more (``Content-Length``) is answered 413 before it is read; a chunked body is read first and refused the same
  way when it passes the limit.
- **Queue** (``--max-queue``, default ``DEFAULT_MAX_QUEUE`` waiting requests): a request that finds that many
  waiting gets 503 (OpenAI side, code ``server_overloaded``) or 529 ``overloaded_error`` (Anthropic side), with
  ``Retry-After: 1``; the running and waiting requests go on.

Units: bytes; seconds.
"""

from __future__ import annotations


#: most bytes of a request body (Anthropic's limit for a Messages request: 32 MB)
DEFAULT_MAX_REQUEST_BYTES = 32 * 10**6
#: most requests waiting for the worker before new ones are refused as overloaded
DEFAULT_MAX_QUEUE = 256
#: seconds a refused client is told to wait before retrying an overloaded server
RETRY_AFTER_S = 1
#: the statuses that carry ``Retry-After``
RETRY_STATUSES = (503, 529)


def too_large(limit: int, size: int | None = None):
    """The 413 error (``protocol.OpenAIError``) of a body above ``limit`` bytes (``size``: its declared size)."""
    from .protocol import OpenAIError  # here: the command line reads this module's defaults without pydantic

    what = f"{size:,d} bytes" if size is not None else f"more than {limit:,d} bytes"
    return OpenAIError(413, f"the request body has {what}; this server takes at most {limit:,d} "
                       "(serve --max-request-mb)", code="request_too_large")


class BodyLimit:
    """ASGI middleware refusing request bodies above ``limit`` bytes with a 413 in the API's shape (module
    docstring): at once when ``Content-Length`` says so; a body without one is read here first (it is read whole
    by the endpoint anyway) and refused when it passes the limit, else handed on as it came. ``error_bytes(path,
    error)`` writes the error's JSON body in the shape of the API that ``path`` belongs to (``app.error_bytes``)."""

    def __init__(self, app, limit: int, error_bytes):
        self.app = app
        self.limit = limit
        self.error_bytes = error_bytes

    async def _refuse(self, scope, send, size: int | None) -> None:
        body = self.error_bytes(scope.get("path", ""), too_large(self.limit, size))
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None:
            if declared.isdigit() and int(declared) > self.limit:
                return await self._refuse(scope, send, int(declared))
            return await self.app(scope, receive, send)
        messages, seen = [], 0
        while True:
            message = await receive()
            messages.append(message)
            seen += len(message.get("body", b""))
            if seen > self.limit:
                return await self._refuse(scope, send, None)
            if message["type"] != "http.request" or not message.get("more_body", False):
                break

        async def replay():
            return messages.pop(0) if messages else await receive()

        return await self.app(scope, replay, send)


def check_queue(worker, max_queue: int | None, status: int) -> None:
    """Refuse a request when ``max_queue`` requests already wait (``status``: 503 OpenAI side, 529 Anthropic side).

    Raises:
        OpenAIError: ``status``, code ``server_overloaded``, type ``server_error``.
    """
    if max_queue is not None and worker.queue_length >= max_queue:
        from .protocol import OpenAIError

        raise OpenAIError(status, f"the server is overloaded: {worker.queue_length} requests are waiting "
                          f"(serve --max-queue {max_queue}); retry in a moment", code="server_overloaded",
                          type="server_error")
