"""Progress of a long loop: a tqdm bar on a terminal, plain log lines in a file or pipe.

A bar redraws itself with carriage returns; in a batch job's log (``make train > log``) that
is hundreds of KB of redraws on a few lines. When stderr is not a terminal, :func:`progress`
returns a :class:`LogProgress` instead: one ordinary log line per ``interval`` seconds.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Optional

log = logging.getLogger(__name__)


class LogProgress:
    """One ``desc: n/total postfix`` log line per ``interval`` seconds (and one at close), the
    part of tqdm's interface the training loop uses; ``disable``: log nothing (DDP ranks > 0)."""

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
):
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
