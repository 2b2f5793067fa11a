"""Command-line entry points: ``mt-prepare``, ``mt-train``, ``mt-translate``, ``mt-evaluate``.

Each is a Hydra app over the same config tree (conf/), so every setting can be overridden on
the command line and every tool accepts ``experiment=NAME``. The stages themselves live in
their modules; this file only composes the configuration, sets up logging and dispatches.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable

from mt.config import conf_dir, register_schema, to_config
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


def _hydra_app(task: Callable[[Config], object]) -> Callable[[], None]:
    """Wrap a stage function ``task(cfg)`` as a Hydra command-line app."""

    def main() -> None:
        import hydra

        register_schema()

        @hydra.main(config_path=str(conf_dir()), config_name="config", version_base=None)
        def app(dcfg) -> None:
            setup_logging()
            task(to_config(dcfg))

        app()

    return main


def _prepare(cfg: Config) -> None:
    import time

    from mt.prepare import prepare
    from mt.report import record_stage_time

    start = time.perf_counter()
    prepare(cfg)
    if int(os.environ.get("RANK", "0")) == 0:
        record_stage_time(cfg.run_dir, "prepare", time.perf_counter() - start)


def _train(cfg: Config) -> None:
    from mt.train import train

    train(cfg)


def _translate(cfg: Config) -> None:
    from mt.translate import translate_main

    translate_main(cfg)


def _evaluate(cfg: Config) -> None:
    from mt.evaluate import evaluate_main

    evaluate_main(cfg)


prepare_main = _hydra_app(_prepare)
train_main = _hydra_app(_train)
translate_main = _hydra_app(_translate)
evaluate_main = _hydra_app(_evaluate)
