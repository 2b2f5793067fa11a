"""Average the parameters of several checkpoints (the paper averages the last 5 or 20).

Usage:
    python scripts/average_checkpoints.py -o averaged.pt ckpt_a.pt ckpt_b.pt ...
    python scripts/average_checkpoints.py -o averaged.pt --last 5 runs/NAME/checkpoints

The output is a self-describing checkpoint (model config, tokenizer, step of the last input)
that mt-evaluate and mt-translate load like any other (``checkpoint=averaged.pt``).
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from mt.checkpoint import (
    CheckpointError,
    average_checkpoints,
    periodic_checkpoints,
    save_checkpoint,
)

log = logging.getLogger("mt.average")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("inputs", nargs="+", help="checkpoint files, or one directory with --last")
    parser.add_argument("-o", "--output", required=True, help="where to write the average")
    parser.add_argument(
        "--last", type=int, default=0, help="average the newest N checkpoint_<step>.pt of a dir"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s | %(message)s")
    paths = [Path(p) for p in args.inputs]
    if args.last:
        if len(paths) != 1 or not paths[0].is_dir():
            parser.error("--last N takes exactly one checkpoint directory")
        paths = periodic_checkpoints(paths[0])[-args.last :]
        if len(paths) < args.last:
            log.warning("only %d periodic checkpoints found", len(paths))
    try:
        avg = average_checkpoints(paths)
    except CheckpointError as e:
        log.error("%s", e)
        return 1
    save_checkpoint(args.output, avg)
    log.info("averaged %d checkpoints -> %s", len(paths), args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
