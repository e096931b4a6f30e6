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

import collections
import threading
import time
import traceback

import torch

from ..generation.generate import eos_ids, generate_ids
from .jobs import Delta, Detokenizer, Done, Failed, Job, ServerStats, shutdown_event

SCHEDULING = "queued: one worker runs requests one at a time in arrival (FIFO) order, batch 1"


class Worker:
    """Runs queued jobs on one thread against one loaded model.

    Args:
        lm: the loaded model (``models.loader.LoadedModel``).
        diffusion: block-diffusion parameters ``{"block_length", "steps", "threshold"}`` for a diffusion model, else
            None.
        tracker: ``serve.memory_profile.DeviceTierTracker`` entered around every job (CPU memory measurement), or None.
        decoder: a ``graph.decode.GraphDecoder`` whose compiled decode step runs the requests (``serve --graph``;
            kept as ``graph_decoder``), or None (the eager ``generate_ids``).
    """

    def __init__(self, lm, diffusion: dict | None = None, tracker=None, decoder=None):
        self.lm = lm
        self.diffusion = diffusion
        self.tracker = tracker
        self.graph_decoder = decoder
        self.stats = ServerStats()
        self.eos = eos_ids(lm)
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
            job.push(shutdown_event())
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
        job.push(shutdown_event())

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
            kw = dict(temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, seed=p.seed, request=request,
                      on_token=lambda t: on_tokens([t]))
            new, ttft, dec = (generate_ids(lm, job.prompt_ids, p.max_tokens, **kw) if self.graph_decoder is None
                              else self.graph_decoder.generate_ids(job.prompt_ids, p.max_tokens, **kw))
            compiled = self.graph_decoder.last_compile_steps if self.graph_decoder is not None else 0
            decode_tokens = max(0, len(new) - 1 - compiled)
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
                job.push(shutdown_event())
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
