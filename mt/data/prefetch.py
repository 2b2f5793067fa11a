"""Batches made ready ahead of the training loop, in a background thread.

Reading a batch's pairs from the memory-mapped split and padding them
(:func:`mt.data.batches.collate`) takes host time that the training thread should spend
launching GPU work. :class:`Prefetcher` runs any batch iterator in one background thread, up to
``depth`` batches ahead, pinned (page-locked) when bound for a GPU so that the loop's
``batch.to(device)`` (``non_blocking=True``) is an asynchronous copy.

A thread rather than DataLoader worker processes: the work is numpy and memory-map reads that
need no second interpreter, nothing is pickled, and the order is the iterator's own, so exact
resume (the loop's ``state.batch``) is untouched: the thread never decides what comes next.

Contract: batches arrive in the iterator's order, each exactly once; an exception the iterator
raises (a corrupt split) is raised again in the consuming thread, as the same object, when the
loop reaches that point; :meth:`Prefetcher.close` (also on leaving the ``with`` block, however it
is left) stops the thread and joins it.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
from collections.abc import Iterator
from typing import Generic, TypeVar

import torch

T = TypeVar("T")

_POLL = 0.1  # seconds between the producer's checks of the stop flag while the queue is full


@dataclasses.dataclass
class _End:
    """The producer is done: the iterator ran out (``error`` None) or raised ``error``."""

    error: BaseException | None = None


class Prefetcher(Generic[T]):
    """Iterate ``source`` in a background thread, ``depth`` items ahead.

    ``depth`` 0 makes no thread: ``source`` runs in the caller's thread (for debugging).
    ``pin`` calls each item's ``pin_memory()`` in the thread, with ``device`` made current there
    first: the current CUDA device is per thread, and without it a rank on GPU 3 would pin
    through GPU 0's context.
    """

    def __init__(
        self,
        source: Iterator[T],
        depth: int = 2,
        pin: bool = False,
        device: torch.device | None = None,
    ) -> None:
        if depth < 0:
            raise ValueError(f"train.prefetch must be >= 0, got {depth}")
        self._source, self._pin, self._device = iter(source), pin, device
        self._queue: queue.Queue = queue.Queue(maxsize=max(depth, 1))
        self._stop = threading.Event()
        self._done = False
        self._thread: threading.Thread | None = None
        if depth > 0:
            self._thread = threading.Thread(target=self._produce, name="mt-prefetch", daemon=True)
            self._thread.start()

    def _produce(self) -> None:
        end = _End()
        try:
            if self._pin and self._device is not None and self._device.type == "cuda":
                torch.cuda.set_device(self._device)
            for item in self._source:
                if not self._put(item.pin_memory() if self._pin else item):
                    return
        except BaseException as err:  # handed to the consumer, which raises it
            end = _End(err)
        self._put(end)

    def _put(self, item) -> bool:
        """Wait for room in the queue unless told to stop; False when stopped."""
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=_POLL)
                return True
            except queue.Full:
                continue
        return False

    def __iter__(self) -> Iterator[T]:
        return self

    def __next__(self) -> T:
        if self._done:
            raise StopIteration
        if self._thread is None:  # depth 0: in this thread
            item = next(self._source)
            return item.pin_memory() if self._pin else item
        item = self._queue.get()
        if isinstance(item, _End):
            self._done = True
            self._thread.join()
            if item.error is not None:
                raise item.error
            raise StopIteration
        return item

    def close(self) -> None:
        """Stop the background thread and wait for it (idempotent): the producer sees the
        stop flag within ``_POLL`` seconds, even when waiting on a full queue."""
        self._done = True
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def __enter__(self) -> Prefetcher[T]:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
