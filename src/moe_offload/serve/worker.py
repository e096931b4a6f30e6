"""The serving worker: one thread that runs requests one at a time, in arrival order (**queued**, batch 1).

The engine generates for one request at a time (its slot pool, lookup table and KV cache serve one sequence), so
concurrent clients wait in a FIFO queue; each request runs exactly ``generate``'s loop (``generation.generate.generate_ids``,
or ``generation.diffusion.diffusion_generate_ids`` for block-diffusion models) with the request's prompt and settings,
so its tokens are those ``generate`` gives. Tokens are handed to the request's event queue as they are chosen
(autoregressive) or block by block (diffusion); a cancelled request (its client went away) stops after the
current token / block and its state is dropped; a cancelled request still waiting never runs.

Shutdown (``Worker.begin_shutdown``, on Ctrl-C / SIGTERM): waiting requests, and any that arrive later, end at once
with a ``Failed`` event of status 503; the running one gets a grace period to finish and is then stopped after its
current token / block with the same 503 event (its stream's final event), so no request is left to the HTTP
server's hard cancellation.
"""

from __future__ import annotations

import asyncio
import collections
import threading
import time
import traceback
from dataclasses import dataclass, field

import torch

from ..generation.generate import _eos_ids, generate_ids

SCHEDULING = "queued: one worker runs requests one at a time in arrival (FIFO) order, batch 1"
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


def _shutdown_event() -> Failed:
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


class Worker:
    """Runs queued jobs on one thread against one loaded model.

    Args:
        lm: the loaded model (``models.loader.LoadedModel``).
        diffusion: block-diffusion parameters ``{"block_length", "steps", "threshold"}`` for a diffusion model, else
            None.
        tracker: ``serve.memory.DeviceTierTracker`` entered around every job (CPU memory measurement), or None.
    """

    def __init__(self, lm, diffusion: dict | None = None, tracker=None):
        self.lm = lm
        self.diffusion = diffusion
        self.tracker = tracker
        self.stats = ServerStats()
        self.eos = _eos_ids(lm)
        self._queue: collections.deque[Job] = collections.deque()
        self._cv = threading.Condition()
        self._stopping = False
        self._closing = False
        self._thread: threading.Thread | None = None
        self._request = 0
        self.active: Job | None = None

    # -- queue -------------------------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the worker thread (idempotent)."""
        if self._thread is None:
            self._stopping = False
            self._thread = threading.Thread(target=self._run, name="moe-offload-worker", daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """End the waiting and running jobs with a 503 ``Failed`` event (``begin_shutdown`` without grace) and join
        the thread (seconds)."""
        self.begin_shutdown(0.0)
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    def begin_shutdown(self, grace_s: float) -> None:
        """Stop taking work: waiting jobs (and any submitted from now on) end at once with a 503 ``Failed`` event;
        the running job gets ``grace_s`` seconds to finish, then stops after its current token / block with the same
        event. Returns when no job runs any more or the grace period is over (idempotent)."""
        with self._cv:
            self._closing = True
            queued = list(self._queue)
            self._queue.clear()
            self.stats.requests_cancelled += len(queued)
        for job in queued:
            job.cancelled.set()
            job.push(_shutdown_event())
        deadline = time.monotonic() + grace_s
        with self._cv:
            while self.running_jobs() and deadline - time.monotonic() > 0:
                self._cv.wait(deadline - time.monotonic())
            for job in self.running_jobs():
                job.shutdown = True
                job.cancelled.set()

    def submit(self, job: Job) -> None:
        """Append a job to the FIFO queue (during shutdown: end it at once with a 503 ``Failed`` event)."""
        with self._cv:
            if not self._closing:
                self._queue.append(job)
                self._cv.notify()
                return
        job.push(_shutdown_event())

    def cancel(self, job: Job) -> None:
        """The client of ``job`` went away: drop it from the queue, or stop it after the current token / block."""
        job.cancelled.set()
        with self._cv:
            try:
                self._queue.remove(job)
                self.stats.requests_cancelled += 1
            except ValueError:
                pass

    def running_jobs(self) -> list[Job]:
        """The jobs being generated now (at most one here; a batch in ``serve.batch_worker``)."""
        return [] if self.active is None else [self.active]

    @property
    def queue_length(self) -> int:
        """Jobs waiting (not counting the running one)."""
        return len(self._queue)

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._stopping:
                    self._cv.wait()
                if self._stopping:
                    return
                job = self._queue.popleft()
                self.active = job
            try:
                if self.tracker is not None:
                    with self.tracker:
                        self._execute(job)
                else:
                    self._execute(job)
            except Exception as e:  # never kill the worker: report the failure to that request only
                self.stats.requests_failed += 1
                traceback.print_exc()
                job.push(Failed(f"{e.__class__.__name__}: {e}"))
            finally:
                job.finished = True
                with self._cv:
                    self.active = None
                    self._cv.notify_all()

    # -- one request -------------------------------------------------------------------------------------------
    @torch.no_grad()
    def _execute(self, job: Job) -> None:
        lm, p = self.lm, job.params
        started = time.perf_counter()
        detok = Detokenizer(lm.tokenizer, p.stop)

        def on_tokens(ids: list[int]) -> bool:
            if job.first_token_at is None:
                job.first_token_at = time.perf_counter()
            text = detok.add(ids)
            job.push(Delta(text, list(ids)))
            return detok.stopped or job.cancelled.is_set()

        request = self._request
        self._request += 1
        if self.diffusion is None:
            new, ttft, dec = generate_ids(lm, job.prompt_ids, p.max_tokens, temperature=p.temperature, top_p=p.top_p,
                                          top_k=p.top_k, seed=p.seed, request=request,
                                          on_token=lambda t: on_tokens([t]))
            decode_tokens = max(0, len(new) - 1)
        else:
            from ..generation.diffusion import diffusion_generate_ids

            d = self.diffusion
            res = diffusion_generate_ids(lm, job.prompt_ids, p.max_tokens, block_length=d["block_length"],
                                         steps=d["steps"], threshold=d["threshold"], temperature=p.temperature,
                                         top_p=p.top_p, top_k=p.top_k, seed=p.seed, request=request,
                                         on_block=on_tokens,
                                         prefix_cache=d.get("prefix_cache", True))
            new, ttft, dec = res.token_ids, res.first_block_s, res.seconds - res.first_block_s
            decode_tokens = res.decode_tokens(d["block_length"])
        self._complete(job, detok, new, ttft, dec, decode_tokens, started)

    def _complete(self, job: Job, detok: Detokenizer, new: list[int], ttft: float, dec: float, decode_tokens: int,
                  started: float) -> None:
        """Count a request that ran (``ttft`` / ``dec`` seconds; ``started``: when it left the queue) and push its
        final events: ``Done`` with the held-back text, or, when it was cancelled, nothing (503 at shutdown)."""
        st = self.stats
        if job.cancelled.is_set():
            st.requests_cancelled += 1
            if job.shutdown:
                job.push(_shutdown_event())
            return
        tail = detok.finish()
        if tail:
            job.push(Delta(tail, []))
        reason = "stop" if detok.stopped or (new and new[-1] in self.eos) else "length"
        queue_s = started - job.created
        st.requests_served += 1
        st.prompt_tokens += len(job.prompt_ids)
        st.completion_tokens += len(new)
        st.decode_tokens += decode_tokens
        st.decode_s += dec
        st.prefill_s += ttft
        st.ttft_s.append(ttft)
        st.queue_s.append(queue_s)
        if job.first_token_at is not None:
            st.server_ttft_s.append(job.first_token_at - job.created)
        job.push(Done(reason, detok.text, list(new), len(job.prompt_ids), ttft, dec, queue_s, detok.matched))
