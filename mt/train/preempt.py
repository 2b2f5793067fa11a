"""Stopping on a signal: save ``last.pt``, then exit with a status that says why.

A cluster that preempts a job sends SIGTERM (Slurm, Kubernetes) or, ahead of the time limit,
the signal chosen with ``sbatch --signal`` (SIGUSR1 here). Training then finishes the update it
is in, saves ``last.pt`` and the command exits with :data:`EXIT_PREEMPTED` (75, ``EX_TEMPFAIL``
in ``sysexits.h``: "try again later"), which a requeueing script tells apart from success (0)
and failure (1). Ctrl-C saves the same way and exits with :data:`EXIT_INTERRUPTED` (130, the
shell's status for SIGINT); a second Ctrl-C interrupts at once.

The handler only records the signal; the training loop checks it between updates (and every
rank learns of it in the same collective), so a checkpoint is never written from inside a
signal handler.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable
from typing import Optional

log = logging.getLogger(__name__)

EXIT_PREEMPTED = 75  # SIGTERM / SIGUSR1: saved, run again to continue (requeue)
EXIT_INTERRUPTED = 130  # Ctrl-C: saved, stopped by the user
PREEMPT_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class StopFlag:
    """The signal that asked training to stop (None while none has)."""

    def __init__(self) -> None:
        self.signum: Optional[int] = None

    @property
    def name(self) -> Optional[str]:
        return None if self.signum is None else signal.Signals(self.signum).name


def exit_status(signum: Optional[int]) -> int:
    """The process exit status after stopping on ``signum`` (0 when no signal stopped it)."""
    if signum is None:
        return 0
    return EXIT_INTERRUPTED if signum == signal.SIGINT else EXIT_PREEMPTED


def install(flag: StopFlag, message: str) -> Optional[Callable[[], None]]:
    """Record SIGTERM, SIGUSR1 and the first SIGINT in ``flag`` (a second SIGINT raises
    KeyboardInterrupt), logging ``message`` with the signal's name. Only in the main thread;
    returns a function restoring the previous handlers, or None when not installed."""
    if threading.current_thread() is not threading.main_thread():
        return None

    def handler(signum, frame):
        if flag.signum is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        flag.signum = signum
        log.warning("%s received: %s", signal.Signals(signum).name, message)

    old = {s: signal.signal(s, handler) for s in (*PREEMPT_SIGNALS, signal.SIGINT)}

    def restore() -> None:
        for s, h in old.items():
            signal.signal(s, h)

    return restore
