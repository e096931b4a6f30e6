"""The continuous-batching worker (issue 18): one thread runs up to ``max_batch`` requests at once.

Each turn of its loop: take waiting requests (FIFO) into the free rows of the decode batch and prefill them —
shortest prompt first, several per prefill pass, left-padded, up to ``prefill_tokens`` padded tokens
(``generation.batching.prefill_group``, ``BatchDecoder.admit_many``); each streams its first token as soon as its pass ends
—, then run one decode step for every admitted request (``BatchDecoder.step``), stream each row's token, and
retire the rows that ended (EOS, ``max_tokens``, a stop sequence, a client that went away: its KV rows are freed
before the next step). The other rows go on. Tokens per request follow ``generate_ids`` (greedy rows equal it
alone up to near ties; each sampled row draws from its own seeded generator), see ``batching``.

Shutdown and cancellation keep ``serve.worker.Worker``'s contract (a request stops after its current token; at
shutdown waiting ones get 503 at once, running ones after the grace period).
"""

from __future__ import annotations

import time
import traceback
from dataclasses import dataclass

import torch

from ..generation.batching import BatchDecoder, Sequence, prefill_group
from .jobs import Delta, Detokenizer, Failed, Job
from .worker import Worker

SCHEDULING = ("continuous batching: prefills admitted between decode steps (FIFO, several prompts per prefill "
              "pass), up to max_batch sequences decode together through one slot pool")


@dataclass
class _Row:
    """A running request: its job, sequence, detokenizer, and times (``perf_counter`` seconds)."""

    job: Job
    seq: Sequence
    detok: Detokenizer
    started: float
    prefill_s: float = 0.0
    first_at: float = 0.0


class BatchWorker(Worker):
    """Runs queued jobs on one thread in a continuous decode batch (module docstring).

    Args:
        lm: the loaded model (autoregressive, batchable: ``generation.batching.batch_reason(lm)`` is None).
        max_batch: most requests decoding at once (>= 2 to batch; 1 works too).
        tracker: ``serve.memory_profile.DeviceTierTracker`` entered around every turn of the loop, or None.
        prefill_tokens: most padded tokens (prompts x longest prompt) in one prefill pass; the server passes
            ``max_context - 1``, the prefill its memory plan measured (None: each prompt alone).
    Attributes:
        decoder: the ``generation.batching.BatchDecoder`` (its ``stats`` are the per-batch-size counters).
    """

    scheduling = SCHEDULING

    def __init__(self, lm, max_batch: int, tracker=None, prefill_tokens: int | None = None):
        super().__init__(lm, None, tracker)
        self.max_batch = max_batch
        self.prefill_tokens = prefill_tokens
        self.decoder = BatchDecoder(lm, max_batch)
        self._rows: list[_Row] = []

    def running_jobs(self) -> list[Job]:
        """The jobs in the decode batch now."""
        return [r.job for r in list(self._rows)]

    @property
    def active(self) -> Job | None:
        """The oldest running job (None when the batch is empty)."""
        rows = list(self._rows)
        return rows[0].job if rows else None

    @active.setter
    def active(self, value) -> None:  # Worker.__init__ sets it; the batch is the state here
        pass

    def kv_cache_bytes(self) -> int:
        """Bytes of the batch's KV cache now."""
        return self.decoder.kv.nbytes()

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._rows and not self._stopping:
                    self._cv.wait()
                if self._stopping and not self._rows:
                    return
                admits = []
                while self._queue and len(self._rows) + len(admits) < self.max_batch:
                    admits.append(self._queue.popleft())
            if self.tracker is not None:
                with self.tracker:
                    self._turn(admits)
            else:
                self._turn(admits)

    @torch.no_grad()
    def _turn(self, admits: list[Job]) -> None:
        # every request taken this turn is prefilled before the next decode step; shortest prompts first: the
        # groups need the least padding and the mean wait for a first token is the least (no request waits for a
        # later turn, so none starves)
        admits = sorted(admits, key=lambda j: len(j.prompt_ids))
        while admits:
            n = prefill_group([len(j.prompt_ids) for j in admits], len(admits), self.prefill_tokens)
            self._admit(admits[:n])
            admits = admits[n:]
        self._retire()
        if not self._rows:
            return
        try:
            made = self.decoder.step()
        except Exception as e:  # the batch's state is unknown: end every running request, keep serving
            traceback.print_exc()
            self._fail_all(e)
            return
        for row, (_, tok) in zip(list(self._rows), made):
            self._emit(row, tok)
        self._retire()

    def _admit(self, jobs: list[Job]) -> None:
        """Prefill ``jobs`` in one pass and stream their first tokens; a failure fails these requests only."""
        rows = []
        for job in jobs:
            p = job.params
            seq = Sequence(self._request, job.prompt_ids, p.max_tokens, p.temperature, p.top_p, p.seed, p.top_k)
            self._request += 1
            rows.append(_Row(job, seq, Detokenizer(self.lm.tokenizer, p.stop), time.perf_counter()))
        try:
            toks = self.decoder.admit_many([r.seq for r in rows])
        except Exception as e:  # these requests only
            traceback.print_exc()
            for r in rows:
                self.stats.requests_failed += 1
                r.job.push(Failed(f"{e.__class__.__name__}: {e}"))
                r.job.finished = True
            return
        now = time.perf_counter()
        for r in rows:
            r.first_at = now
            r.prefill_s = now - r.started
        with self._cv:
            self._rows += rows
        for r, tok in zip(rows, toks):
            self._emit(r, tok)

    def _emit(self, row: _Row, tok: int) -> None:
        job = row.job
        if job.first_token_at is None:
            job.first_token_at = time.perf_counter()
        job.push(Delta(row.detok.add([tok]), [tok]))

    def _ended(self, row: _Row) -> bool:
        return row.job.cancelled.is_set() or row.detok.stopped or self.decoder.done(row.seq)

    def _retire(self) -> None:
        """Finish the rows that ended and drop them from the batch (their KV rows are freed)."""
        gone = [r for r in self._rows if self._ended(r)]
        if not gone:
            return
        self.decoder.drop([r.seq for r in gone])
        with self._cv:
            self._rows = [r for r in self._rows if r not in gone]
            self._cv.notify_all()
        now = time.perf_counter()
        for r in gone:
            new = r.seq.new
            self._complete(r.job, r.detok, new, r.prefill_s, now - r.first_at, max(0, len(new) - 1), r.started)
            r.job.finished = True

    def _fail_all(self, e: Exception) -> None:
        rows = list(self._rows)
        self.decoder = BatchDecoder(self.lm, self.max_batch)
        with self._cv:
            self._rows = []
            self._cv.notify_all()
        for r in rows:
            self.stats.requests_failed += 1
            r.job.push(Failed(f"{e.__class__.__name__}: {e}"))
            r.job.finished = True
