"""Progress of a long loop: a tqdm bar on a terminal, plain log lines in a file or pipe.

A bar redraws itself with carriage returns; in a batch job's log (``make train > log``) that
is hundreds of KB of redraws on a few lines. When stderr is not a terminal, :func:`progress`
returns a :class:`LogProgress` instead: one ordinary log line per ``interval`` seconds.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Optional, Protocol

log = logging.getLogger(__name__)


class Progress(Protocol):
    """What the training loop needs of a progress display."""

    def update(self, n: int = 1) -> object: ...

    def set_postfix_str(self, s: str = "", refresh: bool = True) -> None: ...

    def close(self) -> None: ...


class LogProgress:
    """One ``desc: n/total postfix`` log line per ``interval`` seconds (and one at close).

    Args:
        desc: the loop's name.
        total: the expected count (None: unknown).
        initial: the count to start from (a resumed run).
        interval: seconds between lines.
        disable: log nothing (DDP ranks other than 0).
    """

    def __init__(
        self,
        desc: str,
        total: Optional[int] = None,
        initial: int = 0,
        interval: float = 30.0,
        disable: bool = False,
    ):
        self.desc, self.total, self.n = desc, total, initial
        self.interval, self.disable = interval, disable
        self.postfix = ""
        self.last = time.monotonic()
        self.closed = False

    def update(self, n: int = 1) -> None:
        self.n += n
        if time.monotonic() - self.last >= self.interval:
            self._emit()

    def set_postfix_str(self, s: str = "", refresh: bool = True) -> None:
        self.postfix = s

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._emit()

    def _emit(self) -> None:
        self.last = time.monotonic()
        if self.disable:
            return
        count = f"{self.n}/{self.total}" if self.total else str(self.n)
        log.info("%s: %s%s", self.desc, count, f" | {self.postfix}" if self.postfix else "")


def progress(
    desc: str,
    total: Optional[int] = None,
    initial: int = 0,
    disable: bool = False,
    interval: float = 30.0,
    stream=None,
) -> Progress:
    """A tqdm bar when ``stream`` (default stderr) is a terminal, else a :class:`LogProgress`."""
    stream = sys.stderr if stream is None else stream
    isatty = getattr(stream, "isatty", None)
    if isatty is not None and isatty():
        from tqdm.auto import tqdm

        return tqdm(
            total=total, initial=initial, disable=disable, desc=desc, dynamic_ncols=True,
            mininterval=1.0, file=stream,
        )  # fmt: skip
    return LogProgress(desc, total, initial, interval, disable)
