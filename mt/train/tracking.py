"""The run's metrics: ``metrics.jsonl`` and TensorBoard, written by rank 0, and the process's
resident memory for its records (:func:`resident_fields`)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Optional

from mt.allocator import heap_in_use
from mt.files import JsonlAppender

log = logging.getLogger(__name__)


class MetricsLog:
    """``metrics.jsonl`` (one flushed line per record, appended) and TensorBoard, rank 0 only
    (``enabled``). Records from the first with a step beyond ``resume_step`` on are cut off:
    they were written after the checkpoint being resumed, and will be written again."""

    def __init__(self, run_dir: Path, resume_step: int, enabled: bool = True):
        self.enabled = enabled
        self.file: Optional[JsonlAppender] = None
        self.tb = None
        if not enabled:
            return
        # Appended, never rewritten: a torn last line and the records after the resumed step
        # are cut off with one truncate.
        self.file = JsonlAppender(run_dir / "metrics.jsonl", keep_through_step=resume_step)
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:  # tensorboard is an optional extra: metrics.jsonl has it all
            log.warning(
                "TensorBoard logging is off: the tensorboard package is not installed (%s). "
                "Install it with `pip install tensorboard` (or mt's `all` extra, "
                "`pip install 'mt[all]'`); metrics.jsonl records every figure meanwhile", e,
            )  # fmt: skip
            return
        try:
            self.tb = SummaryWriter(str(run_dir / "tensorboard"), purge_step=resume_step + 1)
        except Exception as e:  # a broken install or an unwritable folder: JSONL is enough
            log.warning("TensorBoard logging is off: %s: %s; metrics.jsonl records every "
                        "figure", type(e).__name__, e)  # fmt: skip

    def write(self, record: dict[str, Any]) -> None:
        """Append one record; scalars also go to TensorBoard under their key."""
        if not self.enabled:
            return
        self.file.write(record)
        if self.tb is not None and "step" in record:
            for key, value in record.items():
                if key not in ("step", "epoch") and isinstance(value, (int, float)):
                    self.tb.add_scalar(key, value, record["step"])
            self.tb.flush()

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
        if self.tb is not None:
            self.tb.close()


def resident_mb() -> tuple[float, float]:
    """This process's resident memory now and at its peak, in MB (Linux; (0, peak) elsewhere)."""
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KB on Linux
    try:
        with open("/proc/self/statm") as f:
            pages = int(f.read().split()[1])
        import os

        rss = pages * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):
        return 0.0, peak
    return rss, max(peak, rss)  # the kernel updates its peak lazily


def resident_fields() -> dict[str, float]:
    """:func:`resident_mb` as a metrics record's ``rss_mb`` and ``peak_rss_mb``, and the part
    of it the program holds from malloc (``heap_mb``, where the allocator tells: resident
    memory that grows while it stays level is freed memory kept, not a leak)."""
    rss, peak = resident_mb()
    fields = {"rss_mb": round(rss, 1), "peak_rss_mb": round(peak, 1)}
    held = heap_in_use()
    if held is not None:
        fields["heap_mb"] = round(held / 2**20, 1)
    return fields
