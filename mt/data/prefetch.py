"""Batches made ready ahead of the training loop, in a background thread.

Reading a batch's pairs from the memory-mapped split and padding them
(:func:`mt.data.batches.collate`)
takes host time that the training thread should spend launching GPU work. :class:`Prefetcher`
runs any batch iterator in one background thread and keeps up to ``depth`` batches waiting in a
bounded queue, pinned (page-locked) when they are bound for a GPU, so that the loop's
``batch.to(device)`` (``non_blocking=True``) is an asynchronous copy.

A thread rather than DataLoader worker processes: the work is numpy and memory-map reads that
need no second interpreter, nothing is pickled between processes, and the order is the
iterator's own, so exact resume (the loop's ``state.batch``) is untouched; the thread only runs
ahead of the loop and never decides what comes next.

Contract:
    - Batches arrive in the iterator's order, each exactly once.
    - An exception raised by the iterator (a corrupt split, a bad pair) is raised again in the
      consuming thread, as the same exception object, when the loop reaches that point.
    - :meth:`Prefetcher.close` (also on leaving the ``with`` block, however it is left: a
      ``break``, a stop signal, an exception) stops the thread and joins it; no thread outlives
      the block.

Example:
    >>> with Prefetcher(iter(range(3)), depth=2) as batches:
    ...     list(batches)
    [0, 1, 2]
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Iterator
from typing import Generic, TypeVar

import torch

log = logging.getLogger(__name__)


T = TypeVar("T")

_POLL = 0.1  # seconds between the producer's checks of the stop flag while the queue is full


class _End:
    """The producer is done: iterator exhausted (``error`` None) or failed (``error`` set)."""

    def __init__(self, error: BaseException | None = None) -> None:
        self.error = error


class Prefetcher(Generic[T]):
    """Iterate ``source`` in a background thread, ``depth`` items ahead.

    Args:
        source: the items (e.g. :func:`mt.data.batches.iterate_batches`); consumed only by the
            background thread.
        depth: items kept ready (>= 1). 0 makes no thread: ``source`` is iterated in the
            caller's thread, as without a prefetcher (for debugging).
        pin: call each item's ``pin_memory()`` in the background thread (for CUDA devices).
        device: the CUDA device the batches go to, made current in the thread before pinning
            (the current device is per thread; without it a rank on GPU 3 would pin through
            GPU 0's context). None: leave the thread's current device alone.
        name: the thread's name (shown in stack dumps).
    """

    def __init__(
        self,
        source: Iterator[T],
        depth: int = 2,
        pin: bool = False,
        device: torch.device | None = None,
        name: str = "mt-prefetch",
    ) -> None:
        if depth < 0:
            raise ValueError(f"train.prefetch must be >= 0, got {depth}")
        self._source, self._pin, self._device = iter(source), pin, device
        self._queue: queue.Queue = queue.Queue(maxsize=max(depth, 1))
        self._stop = threading.Event()
        self._done = False
        self._thread: threading.Thread | None = None
        if depth > 0:
            self._thread = threading.Thread(target=self._produce, name=name, daemon=True)
            self._thread.start()

    def _produce(self) -> None:
        end = _End()
        try:
            if self._pin and self._device is not None and self._device.type == "cuda":
                torch.cuda.set_device(self._device)
            for item in self._source:
                if self._pin:
                    item = item.pin_memory()
                if not self._put(item):
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
            try:
                item = next(self._source)
            except StopIteration:
                self._done = True
                raise
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
        """Stop the background thread and wait for it (idempotent)."""
        self._done = True
        self._stop.set()
        if self._thread is not None:
            while self._thread.is_alive():
                try:  # make room, so that a producer blocked in put() sees the stop flag
                    while True:
                        self._queue.get_nowait()
                except queue.Empty:
                    pass
                self._thread.join(timeout=_POLL)
            self._thread = None

    def __enter__(self) -> Prefetcher[T]:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
