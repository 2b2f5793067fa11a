"""The run's metrics: ``metrics.jsonl`` and TensorBoard, written by rank 0, and the process's
resident memory for its records (:func:`resident_fields`)."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from pathlib import Path
from typing import Any, Optional

from mt.allocator import heap_in_use
from mt.config import flatten_keys
from mt.files import JsonlAppender, write_json

log = logging.getLogger(__name__)


class MetricsLog:
    """``metrics.jsonl`` (one flushed line per record, appended), TensorBoard and MLflow as
    ``train.tracking`` says (``cfg`` None: TensorBoard alone), rank 0 only (``enabled``).
    Records from the first with a step beyond ``resume_step`` on are cut off: they were written
    after the checkpoint being resumed, and will be written again. ``where`` is the machine,
    for MLflow's tags."""

    def __init__(self, run_dir: Path, resume_step: int, enabled: bool = True, cfg=None,
                 where: Optional[dict] = None):  # fmt: skip
        tracking = ["tensorboard"] if cfg is None else list(cfg.train.tracking)
        unknown = ", ".join(sorted(set(tracking) - {"tensorboard", "mlflow"}))
        if unknown:  # on every rank, so that all of them stop
            raise ValueError(f"train.tracking: unknown {unknown} (known: tensorboard, mlflow)")
        self.enabled = enabled
        self.file: Optional[JsonlAppender] = None
        self.tb = self.mlflow = None
        if not enabled:
            return
        # Appended, never rewritten: a torn last line and the records after the resumed step
        # are cut off with one truncate.
        self.file = JsonlAppender(run_dir / "metrics.jsonl", keep_through_step=resume_step)
        if "mlflow" in tracking:
            self.mlflow = MLflowRun.open(run_dir, cfg, where)
        if "tensorboard" not in tracking:
            return
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
        if self.mlflow is not None and "step" in record:
            self.mlflow.log(record)

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
        if self.tb is not None:
            self.tb.close()
        if self.mlflow is not None:
            self.mlflow.client.set_terminated(self.mlflow.run_id)


class MLflowRun:
    """A run directory's MLflow run, made at its first start (the configuration as params, the
    machine as tags) and recorded for resumes and ``mt-evaluate`` (:attr:`RECORD`)."""

    RECORD = "mlflow.json"  # the tracking URI and the run's id

    def __init__(self, client, run_id: str) -> None:
        self.client, self.run_id = client, run_id

    @classmethod
    def open(cls, run_dir: Path, cfg=None, where=None) -> Optional[MLflowRun]:
        """The recorded run, else (with ``cfg``) a new one; None (warned) where none opens."""
        record = run_dir / cls.RECORD
        if cfg is None and not record.is_file():
            return None
        try:
            from mlflow.entities import Param
            from mlflow.tracking import MlflowClient
        except ImportError as e:  # an optional extra, as TensorBoard
            log.warning("MLflow tracking is off: the mlflow package is not installed (%s). Install "
                        "it with `pip install mlflow-skinny` (or mt's `track` or `all` extra); "
                        "metrics.jsonl records every figure meanwhile", e)  # fmt: skip
            return None
        known = json.loads(record.read_text(encoding="utf-8")) if record.is_file() else {}
        uri = known.get("tracking_uri") or cfg.train.tracking_uri or (
            run_dir / "mlruns").resolve().as_uri()  # fmt: skip
        if uri.startswith("file:"):  # MLflow 3 asks file stores to opt in (no server, no DB)
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        try:
            client = MlflowClient(uri)
            if known:
                return cls(client, known["run_id"])
            found = client.get_experiment_by_name(cfg.name)
            experiment = found.experiment_id if found else client.create_experiment(cfg.name)
            tags = {f"machine.{k}": str(v) for k, v in (where or {}).items()}
            run_id = client.create_run(experiment, run_name=run_dir.name, tags=tags).info.run_id
            params = [Param(k, str(v)) for k, v in flatten_keys(dataclasses.asdict(cfg)).items()]
            for i in range(0, len(params), 100):  # at most 100 params a call
                client.log_batch(run_id, params=params[i : i + 100])
        except Exception as e:  # an unreachable server, a store MLflow refuses: JSONL is enough
            log.warning("MLflow tracking is off: %s: %s; metrics.jsonl records every figure",
                        type(e).__name__, e)  # fmt: skip
            return None
        write_json(record, {"tracking_uri": uri, "run_id": run_id})
        return cls(client, run_id)

    def log(self, record: dict[str, Any]) -> None:
        """A record's scalars as metrics at its step."""
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(k, float(v), now, int(record["step"])) for k, v in record.items()
                   if k not in ("step", "epoch") and isinstance(v, (int, float))]  # fmt: skip
        self.client.log_batch(self.run_id, metrics=metrics)


def track_scores(run_dir: str | Path, result: dict[str, Any]) -> None:
    """``mt-evaluate``'s scores (``test_bleu``, ...) in the run's MLflow run, if it has one."""
    run = MLflowRun.open(Path(run_dir))
    if run is not None:
        run.log({"step": result.get("step", 0), **{f"{result['split']}_{name}": s["score"]
                 for name, s in (result.get("scores") or {}).items() if s}})  # fmt: skip


def resident_mb() -> tuple[float, float]:
    """This process's resident memory now and at its peak, in MB (Linux; (0, peak) elsewhere)."""
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KB on Linux
    try:
        with open("/proc/self/statm") as f:
            pages = int(f.read().split()[1])
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
