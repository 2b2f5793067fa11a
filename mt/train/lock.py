"""One training run per run directory: an exclusive lock on ``run_dir/.lock``.

Two runs on one run directory would both resume from ``last.pt``, append to each other's
``metrics.jsonl`` and rotate each other's checkpoints. :class:`RunLock` prevents it with an
exclusive ``flock`` on ``run_dir/.lock``, held by the process that writes the run directory
(rank 0 under DDP; the other ranks write nothing). The kernel releases a ``flock`` when its
process dies, however it dies, so a lock left by a killed run is free again: the next run takes
it over and says whose it was (the file records ``host``, ``pid`` and the start time). On NFS,
Linux maps ``flock`` to POSIX byte-range locks, which the server arbitrates across hosts.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import socket
import time
from pathlib import Path

log = logging.getLogger(__name__)

LOCK_NAME = ".lock"


class LockError(RuntimeError):
    """The run directory is in use by another live run."""


def _alive(pid: int) -> bool:
    """Whether a process with ``pid`` exists on this host."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, owned by another user
        pass
    return True


class RunLock:
    """An exclusive, non-blocking lock on ``run_dir`` (created if missing), a context manager.
    :meth:`acquire` raises LockError, naming the holder's host and pid, when another holds it.
    """

    def __init__(self, run_dir: str | Path):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_NAME
        self.fd: int | None = None

    def holder(self) -> dict:
        """What the lock file says about its holder (``{}`` when unreadable)."""
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    def acquire(self) -> RunLock:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            # a run that has just taken the lock writes its record a moment later (between the
            # two, the file is empty): wait briefly for it
            end = time.monotonic() + 2.0
            while not (who := self.holder()) and time.monotonic() < end:
                time.sleep(0.02)
            host, pid = who.get("host", "?"), who.get("pid", "?")
            alive = ""
            if host == socket.gethostname() and isinstance(pid, int):
                alive = "" if _alive(pid) else " (the pid is gone but the lock is still held)"
            raise LockError(
                f"run_dir {self.run_dir} is in use by another run: host {host}, pid {pid}, "
                f"started {who.get('started', '?')}{alive}. Wait for it to finish, stop it, or "
                "choose another run_dir=PATH"
            ) from None
        previous = self.holder()
        if previous:
            log.info(
                "taking over the lock of a run that ended (host %s, pid %s)",
                previous.get("host"), previous.get("pid"),
            )  # fmt: skip
        me = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        }
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(me) + "\n").encode(), 0)
        os.fsync(fd)
        self.fd = fd
        return self

    def release(self) -> None:
        """Clear the holder record and unlock (the file stays, so a waiting run never locks a
        file that was unlinked under it)."""
        if self.fd is None:
            return
        with contextlib.suppress(OSError):
            os.ftruncate(self.fd, 0)
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)
        self.fd = None

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()
