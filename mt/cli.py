"""Command-line entry points: ``mt-prepare``, ``mt-train``, ``mt-translate``, ``mt-evaluate``,
``mt-export``, ``mt-serve``, ``mt-score`` and ``mt-backtranslate``.

Each is a Hydra app over the same config tree (conf/); the stages live in their modules, this
file only composes the configuration, sets up logging and dispatches.

A user error (a missing or malformed file, a bad line, a bad setting) ends the command with one
line on stderr naming the file, line or key, and exit status 1; ``mt-train`` stopped by SIGTERM
or SIGUSR1 exits with 75 after saving (``mt.train.preempt``), so a requeueing script can tell it
apart.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path

from mt.allocator import bound_onednn_kernels, launched_as_command, preload_allocator
from mt.schema import Config

log = logging.getLogger("mt")


def setup_logging() -> None:
    """Console logging on rank 0 only (other DDP ranks log warnings and errors)."""
    rank = int(os.environ.get("RANK", "0"))
    level = logging.INFO if rank == 0 else logging.WARNING
    logging.basicConfig(
        level=level,
        format="%(asctime)s | %(levelname)s | %(name)s | %(message)s",
        datefmt="%H:%M:%S",
        stream=sys.stderr,
        force=True,
    )


def _hydra_app(task: Callable[[Config], object], command: str) -> Callable[[], None]:
    """Wrap a stage function ``task(cfg)`` as the Hydra command-line app ``mt-<command>``."""

    def main() -> None:
        tool = f"mt-{command}"
        if launched_as_command():  # first: a library cannot replace malloc later
            try:
                preload_allocator()  # MT_ALLOCATOR: tcmalloc or jemalloc where installed
            except ValueError as err:
                sys.exit(f"{tool}: {err}")
        # Hydra after the allocator's decision: a process that is executed again under the
        # allocator would import it twice (a noticeable part of a command's start)
        import hydra

        from mt.config import command_overrides, conf_dir, register_schema, to_config

        bound_onednn_kernels()  # before this process's first oneDNN product
        check_config_files(tool, [conf_dir(), *_extra_config_dirs(sys.argv[1:])])
        # A command's own settings as users type them: mt-translate input=x -> translate.input=x
        sys.argv[1:] = command_overrides(command, sys.argv[1:])
        register_schema()
        held = _HeldStderr(tool)

        @hydra.main(config_path=str(conf_dir()), config_name="config", version_base=None)
        def app(dcfg) -> object:
            held.release()
            setup_logging()
            with user_errors(tool):
                return task(trial_config(to_config(dcfg)))  # a sweeper's objective (train)

        with held:
            app()

    return main


def trial_config(cfg: Config) -> Config:
    """In a Hydra multirun (``-m``) each trial writes its own run directory, the job's output
    directory (``<hydra.sweep.dir>/<job number>``), so no trial resumes another; prepared data
    stays shared through ``cache_dir``. A ``run_dir`` override naming the job itself
    (``${hydra:job.num}``) is kept."""
    import dataclasses

    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if not HydraConfig.initialized():
        return cfg
    hc = HydraConfig.get()
    if hc.mode != RunMode.MULTIRUN:
        return cfg
    for override in hc.overrides.task:
        key, _, value = override.partition("=")
        if key.lstrip("+~") == "run_dir" and "${hydra:" in value:
            return cfg
    return dataclasses.replace(cfg, run_dir=hc.runtime.output_dir)


class _HeldStderr:
    """Hold what is written to stderr until the task starts. Hydra reports a bad override on
    several lines (plus a hint about HYDRA_FULL_ERROR) and exits; held, that report becomes
    one line ``<tool>: error: ...``. Anything else held is passed on unchanged."""

    def __init__(self, tool: str):
        self.tool = tool
        self.real = sys.stderr
        self.buffer = io.StringIO()
        self.active = not (os.environ.get("MT_DEBUG") or os.environ.get("HYDRA_FULL_ERROR"))

    def __enter__(self) -> None:
        if self.active:
            sys.stderr = self.buffer

    def release(self, error: bool = False) -> None:
        if not self.active:
            return
        self.active = False
        sys.stderr = self.real
        text = self.buffer.getvalue()
        lines = [x.strip() for x in text.splitlines() if x.strip() and "HYDRA_FULL_ERROR" not in x]
        if error and lines and not any(x.startswith("Traceback") for x in lines):
            self.real.write(f"{self.tool}: error: {' | '.join(lines)}\n")
        else:
            self.real.write(text)
        self.real.flush()

    def __exit__(self, kind, value, tb) -> None:
        failed = kind is SystemExit and value.code not in (0, None)
        self.release(error=failed)


def _extra_config_dirs(argv: list[str]) -> list[Path]:
    """The directories given with Hydra's ``--config-dir[=]DIR`` or ``-cd DIR``."""
    dirs = []
    for i, arg in enumerate(argv):
        if arg.startswith("--config-dir="):
            dirs.append(Path(arg.split("=", 1)[1]))
        elif arg in ("--config-dir", "-cd") and i + 1 < len(argv):
            dirs.append(Path(argv[i + 1]))
    return dirs


def check_config_files(tool: str, directories: list[Path]) -> None:
    """Parse every YAML file of the config tree first, so a damaged one is one line naming the
    file, line and column (Hydra would print the YAML parser's traceback)."""
    import yaml

    for directory in directories:
        for path in sorted(Path(directory).rglob("*.yaml")):
            data = path.read_bytes()
            try:
                yaml.safe_load(data)
            except yaml.YAMLError as err:
                mark = getattr(err, "problem_mark", None)
                where = f", line {mark.line + 1}, column {mark.column + 1}" if mark else ""
                if isinstance(err, yaml.reader.ReaderError):  # bad bytes: no mark, a position
                    line = data[: err.position].count(b"\n") + 1
                    where = f", line {line}"
                problem = getattr(err, "problem", None) or " ".join(str(err).split())
                logging.basicConfig(stream=sys.stderr, format="%(message)s")
                log.error("%s: error: %s%s: not valid YAML (%s)", tool, path, where, problem)
                raise SystemExit(1) from None


def _user_error_types() -> tuple[type[BaseException], ...]:
    """Exceptions that describe a problem with the user's files, lines or settings (their
    messages name it); anything else is a bug and keeps its traceback."""
    from omegaconf.errors import OmegaConfBaseException

    from mt.checkpoint import CheckpointError
    from mt.distributed import LauncherError, RankError
    from mt.train.lock import LockError
    from mt.train.update import NonFiniteError

    return (
        ValueError,  # DataError, TokenizerError, TextError, UnicodeDecodeError, bad settings
        OSError,  # missing files, permissions, a full disk
        CheckpointError,
        LockError,
        LauncherError,
        RankError,
        NonFiniteError,
        OmegaConfBaseException,
    )


@contextlib.contextmanager
def user_errors(tool: str):
    """Turn a user error into one line on stderr (``<tool>: error: <message>``) and exit
    status 1, instead of a traceback. ``MT_DEBUG=1`` keeps the traceback."""
    try:
        yield
    except Exception as err:
        if os.environ.get("MT_DEBUG") or not isinstance(err, _user_error_types()):
            raise
        message = " ".join(str(err).split()) or type(err).__name__
        if isinstance(err, OSError) and err.filename and str(err.filename) not in message:
            message = f"{err.filename}: {message}"
        log.error("%s: error: %s", tool, message)
        sys.stderr.flush()
        raise SystemExit(1) from None


def _prepare(cfg: Config) -> None:
    import time

    from mt.data.build import prepare
    from mt.evaluation.report import record_stage_time

    start = time.perf_counter()
    prepare(cfg)
    if int(os.environ.get("RANK", "0")) == 0:
        record_stage_time(cfg.run_dir, "prepare", time.perf_counter() - start)


def _train(cfg: Config) -> float | None:
    """Train; returns the best validation value (what a Hydra sweeper such as Optuna's
    optimises: valid BLEU, or valid loss with ``train.best_metric=loss``)."""
    from mt.train.preempt import exit_status
    from mt.train.recipe import train

    result = train(cfg)
    status = exit_status(result.get("signal"))
    if status:  # stopped by a signal after saving: 75 = requeue me, 130 = Ctrl-C
        raise SystemExit(status)
    if cfg.train.evaluate and int(os.environ.get("RANK", "0")) == 0:
        # the trial's own run directory (trial_config): a multirun's trials each scored
        _evaluate(cfg)
    return result["best"]


def _stage(module: str, function: str, converter: bool = False) -> Callable[[Config], object]:
    """The stage ``module.function(cfg)``, imported when its command runs: a command loads only
    its own stage's modules. ``converter``: the stage also takes the CTranslate2 engine's
    converter, handed down from here because mt.export is above mt.decode."""

    def task(cfg: Config) -> object:
        from importlib import import_module

        stage = getattr(import_module(module), function)
        if not converter:
            return stage(cfg)
        from mt.export import ct2

        return stage(cfg, ct2)

    return task


def _evaluate(cfg: Config) -> object:
    from mt.evaluation.evaluate import evaluate_main
    from mt.train.tracking import track_scores

    result = evaluate_main(cfg)
    if cfg.eval.hyp is None:  # a run's split decoded: its MLflow run, if any, gets the scores
        track_scores(cfg.run_dir, result)
    return result


prepare_main = _hydra_app(_prepare, "prepare")
train_main = _hydra_app(_train, "train")
translate_main = _hydra_app(
    _stage("mt.decode.translate", "translate_main", converter=True), "translate"
)
evaluate_main = _hydra_app(_evaluate, "evaluate")
export_main = _hydra_app(_stage("mt.export", "export_main"), "export")
serve_main = _hydra_app(_stage("mt.serve.server", "serve_main", converter=True), "serve")
score_main = _hydra_app(_stage("mt.decode.rescore", "score_main", converter=True), "score")
backtranslate_main = _hydra_app(
    _stage("mt.decode.backtranslate", "backtranslate_main"), "backtranslate"
)
