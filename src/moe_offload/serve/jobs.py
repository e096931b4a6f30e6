"""What a served request is made of, shared by both workers (``serve.worker``, ``serve.batch_worker``) and the HTTP
APIs: its settings (``Params``), its queue entry (``Job``) and the events it receives (``Delta`` ... then ``Done`` or
``Failed``), the incremental detokenizer with stop sequences, the wait for a non-streamed request's result, and
the served-request counters (``ServerStats``, ``percentile``).
"""

from __future__ import annotations

import asyncio
import collections
import threading
import time
from dataclasses import dataclass, field


SHUTDOWN_MESSAGE = "the server is shutting down; retry the request when it is back"
SHUTDOWN_CODE = "server_shutting_down"


class Detokenizer:
    """Incremental detokenizer with stop sequences.

    ``add(ids)`` returns the text that became final: the decoded text grows token by token; text that could still
    change (an incomplete UTF-8 sequence, shown as U+FFFD) or that could be the start of a stop sequence is held
    back. When a stop sequence appears, the text is cut before it, ``stopped`` is set and ``matched`` is that stop
    sequence (the earliest in the text; the first listed at a tie). ``finish()`` returns the
    held-back rest. The concatenation of everything returned is ``text``, which is what a non-streamed response
    carries, so streamed deltas always concatenate to the non-streamed text.

    Args:
        tokenizer: a transformers tokenizer (``decode(ids, skip_special_tokens=True)``).
        stop: stop sequences (non-empty strings).
    """

    def __init__(self, tokenizer, stop: list[str]):
        self.tokenizer = tokenizer
        self.stop = stop
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.ids: list[int] = []
        self.text = ""
        self.stopped = False
        self.matched: str | None = None

    def _decode(self) -> str:
        return self.tokenizer.decode(self.ids, skip_special_tokens=True)

    def add(self, ids: list[int]) -> str:
        """Feed new token ids; returns the new final text (possibly empty)."""
        if self.stopped:
            return ""
        self.ids.extend(ids)
        full = self._decode()
        if self.stop:
            hits = [(i, s) for i, s in ((full.find(s, max(0, len(self.text) - len(s))), s) for s in self.stop)
                    if i >= 0]
            if hits:
                at, self.matched = min(hits, key=lambda h: h[0])
                self.stopped = True
                return self._emit(full[:at])
        safe = len(full.rstrip("\ufffd")) - self.hold
        return self._emit(full[:safe]) if safe > len(self.text) else ""

    def finish(self) -> str:
        """The held-back text at the end of generation ("" after a stop sequence)."""
        return "" if self.stopped else self._emit(self._decode())

    def _emit(self, upto: str) -> str:
        delta = upto[len(self.text):]
        self.text += delta
        return delta


@dataclass
class Params:
    """Generation settings of one request (validated by the app): tokens, sampling (``moe_offload.generation.sampling``, the
    one sampler of every worker; ``top_k`` -1 / 0: off), stop sequences."""

    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    top_k: int = 0


@dataclass
class Delta:
    """Streamed piece: new final ``text`` and the ``token_ids`` chosen since the last delta."""

    text: str
    token_ids: list[int]


@dataclass
class Done:
    """End of a request: ``finish_reason`` ("stop": an EOS id of ``models.gen_limits.eos_token_ids`` or a stop
    sequence; "length": max_tokens or the model's position limit), the full ``text`` and ``token_ids``,
    ``prompt_tokens``, and times in seconds (``ttft_s``: prefill / first block; ``decode_s``: the rest;
    ``queue_s``: waiting for the worker), and ``stop_sequence``: the stop sequence that ended it (None: EOS,
    ``max_tokens`` or the position limit)."""

    finish_reason: str
    text: str
    token_ids: list[int]
    prompt_tokens: int
    ttft_s: float
    decode_s: float
    queue_s: float
    stop_sequence: str | None = None


@dataclass
class Failed:
    """The request ended without a result: ``status`` 500 when it failed inside the engine (never expected; the
    server stays up), 503 (``code`` ``server_shutting_down``) when the server shut down before it could finish."""

    message: str
    status: int = 500
    code: str | None = None


def shutdown_event() -> Failed:
    """The event a request gets when the server stops it at shutdown (503, ``SHUTDOWN_CODE``)."""
    return Failed(SHUTDOWN_MESSAGE, 503, SHUTDOWN_CODE)


class Job:
    """One request in the queue.

    Args:
        prompt_ids: the encoded prompt.
        params: generation settings.
        loop: the event loop of the HTTP handler waiting on ``events``.
    Attributes:
        events: ``asyncio.Queue`` of ``Delta`` ... then one ``Done`` or ``Failed``.
        cancelled: set when the client went away (or the server stopped it at shutdown).
        shutdown: set when the server stopped it at shutdown (it then ends with a 503 ``Failed`` event).
    """

    def __init__(self, prompt_ids: list[int], params: Params, loop: asyncio.AbstractEventLoop):
        self.prompt_ids = prompt_ids
        self.params = params
        self.loop = loop
        self.events: asyncio.Queue = asyncio.Queue()
        self.cancelled = threading.Event()
        self.shutdown = False
        self.created = time.perf_counter()
        self.first_token_at: float | None = None
        self.finished = False

    def push(self, event) -> None:
        """Hand an event to the handler's loop (thread-safe; dropped if that loop is closed)."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:
            pass


@dataclass
class ServerStats:
    """Counters of served requests (times in seconds): ``ttft_s`` holds each request's prefill time (engine),
    ``server_ttft_s`` the time from arrival to its first token (queue wait included), ``queue_s`` the wait."""

    requests_served: int = 0
    requests_cancelled: int = 0
    requests_failed: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    decode_tokens: int = 0
    decode_s: float = 0.0
    prefill_s: float = 0.0
    ttft_s: collections.deque = field(default_factory=lambda: collections.deque(maxlen=10000))
    server_ttft_s: collections.deque = field(default_factory=lambda: collections.deque(maxlen=10000))
    queue_s: collections.deque = field(default_factory=lambda: collections.deque(maxlen=10000))


DISCONNECT_POLL_S = 0.25  # a non-streamed request checks this often whether its client is still there


async def wait_result(worker, job: Job, is_disconnected, on_end=None) -> Done | Failed | None:
    """The final event of a non-streamed request (``Delta`` events are skipped), checking every
    ``DISCONNECT_POLL_S`` seconds whether its client is still there.

    Args:
        worker: the worker (``Worker`` or ``BatchWorker``) ``job`` was submitted to.
        job: the request.
        is_disconnected: ``async () -> bool`` (Starlette's ``Request.is_disconnected``).
        on_end: ``(last event) -> None``, called however the wait ends (the metrics' ``finished``), or None.
    Returns:
        ``Done`` or ``Failed``; None when the client went away. Unless it returns ``Done`` / ``Failed`` (the client
        left, or the caller was cancelled), the job is cancelled.
    """
    ev = None
    checked = time.monotonic()
    try:
        while not isinstance(ev, (Done, Failed)):
            try:
                ev = await asyncio.wait_for(job.events.get(), timeout=DISCONNECT_POLL_S)
            except TimeoutError:
                pass
            if time.monotonic() - checked >= DISCONNECT_POLL_S and not isinstance(ev, (Done, Failed)):
                checked = time.monotonic()
                if await is_disconnected():
                    return None
    finally:
        if on_end is not None:
            on_end(ev)
        if not isinstance(ev, (Done, Failed)):  # the client went away (or the handler was cancelled)
            worker.cancel(job)
    return ev


def percentile(values, q: float) -> float | None:
    """The ``q``-quantile (0..1) of ``values`` by linear interpolation; None when empty."""
    v = sorted(values)
    if not v:
        return None
    pos = q * (len(v) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)
