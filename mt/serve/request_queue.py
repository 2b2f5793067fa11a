"""A decoding queue that forms batches from requests arriving together (mt-serve).

Requests put jobs (sentences + decoding options) on a bounded queue; one worker thread owns the
model. It takes the first waiting job, then keeps taking jobs for up to ``wait_ms`` or until
``max_sentences`` sentences are gathered, groups them by identical options and decodes each
group with ONE call of the :class:`mt.decode.translate.Translator` (one batched search instead
of one per request). Each job gets its own results back, in its own sentence order.

A job whose decoding fails (e.g. a sentence the model cannot take) gets that error; the other
jobs of its batch are decoded again without it, so one bad request never fails another.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)


class QueueFull(RuntimeError):
    """More sentences wait than the queue holds (the server answers 503)."""


@dataclass
class Job:
    """Sentences of one request with their options; ``future`` receives the n-best lists, or
    ``call`` (any other use of the model, e.g. attention) runs on the worker thread instead."""

    sentences: list[str]
    options: dict[str, Any]
    future: Future = field(default_factory=Future)
    call: Callable[[], Any] | None = None

    @property
    def key(self) -> tuple:
        """Jobs with equal keys are decoded in one call. A sampled job is decoded on its own:
        each sentence's draw is seeded by its line number, which must not depend on which
        other requests arrived with it."""
        if self.options.get("sample"):
            return ("sample", id(self))
        return tuple(sorted(self.options.items()))


class Batcher:
    """The queue and its worker thread, the only user of ``translator`` (anything with
    ``translate_nbest``): batches of at most ``max_sentences``, gathered for ``wait_ms`` after
    their first job; :meth:`submit` raises QueueFull beyond ``queue_size`` waiting sentences."""

    def __init__(self, translator: Any, max_sentences: int = 64,
                 wait_ms: float = 5.0, queue_size: int = 256) -> None:  # fmt: skip
        self.translator = translator
        self.max_sentences = max(1, max_sentences)
        self.wait = max(0.0, wait_ms) / 1000.0
        self.queue_size = queue_size
        self._jobs: queue.Queue[Job | None] = queue.Queue()
        self._waiting = 0  # sentences queued, not yet taken by the worker
        self._lock = threading.Lock()
        self.batches = 0  # decoding calls made (for tests, /info and the benchmark)
        self.sentences = 0  # sentences decoded by those calls
        self._thread = threading.Thread(target=self._run, name="mt-batcher", daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> Future:
        """Queue a job; its future completes with the n-best lists (or the call's result)."""
        n = max(1, len(job.sentences))
        with self._lock:
            if self._waiting + n > self.queue_size:
                raise QueueFull(f"{self._waiting} sentences are waiting (serve.queue_size="
                                f"{self.queue_size}); try again shortly")  # fmt: skip
            self._waiting += n
        self._jobs.put(job)
        return job.future

    def close(self) -> None:
        """Stop the worker after the jobs already queued."""
        self._jobs.put(None)
        self._thread.join(timeout=30)

    # ---- the worker -------------------------------------------------------------------------
    def _take(self, job: Job) -> None:
        with self._lock:
            self._waiting -= max(1, len(job.sentences))

    def _gather(self, first: Job) -> tuple[list[Job], bool]:
        """The first job plus those arriving within the wait, up to max_sentences."""
        jobs, n = [first], len(first.sentences)
        deadline = time.monotonic() + self.wait
        while n < self.max_sentences:
            left = deadline - time.monotonic()
            try:
                job = self._jobs.get(timeout=left) if left > 0 else self._jobs.get_nowait()
            except queue.Empty:
                break
            if job is None:
                return jobs, True
            self._take(job)
            jobs.append(job)
            n += len(job.sentences)
        return jobs, False

    def _run(self) -> None:
        while True:
            first = self._jobs.get()
            if first is None:
                return
            self._take(first)
            jobs, stop = self._gather(first)
            groups: dict[tuple, list[Job]] = {}
            for job in jobs:
                if job.call is not None:
                    self._call(job)
                else:
                    groups.setdefault(job.key, []).append(job)
            for group in groups.values():
                self._decode(group)
            if stop:
                return

    @staticmethod
    def _call(job: Job) -> None:
        try:
            job.future.set_result(job.call())
        except Exception as err:  # handed to the request that asked
            job.future.set_exception(err)

    def _decode(self, group: list[Job]) -> None:
        """One translate_nbest call for the whole group; on failure, each job on its own."""
        sentences = [s for job in group for s in job.sentences]
        try:
            results = self.translator.translate_nbest(sentences, **group[0].options)
            self.batches += 1
            self.sentences += len(sentences)
        except Exception as err:
            if len(group) == 1:
                group[0].future.set_exception(err)
                return
            log.info("a batch of %d requests failed (%s); decoding them one by one",
                     len(group), err)  # fmt: skip
            for job in group:
                self._decode([job])
            return
        start = 0
        for job in group:
            job.future.set_result(results[start : start + len(job.sentences)])
            start += len(job.sentences)
