"""Print the summary table of a Hydra multirun sweep (``mt.evaluation.sweep``): one row per
trial, ranked by valid BLEU. A sweep writes the same table to ``<sweep dir>/summary.md`` when it
ends; this prints it for any sweep directory, finished or not.

Usage:
    python scripts/sweep.py runs/multi30k_de_en/sweep-<time> [--output sweep.md]

The sweep itself (see README.md, "Choosing the settings"); each trial trains in its own run
directory under the sweep directory:
    mt-train -m train.max_steps=1200 model.dropout=0.05,0.1 train.lr=1e-3,2e-3

Decoding settings of a trained model are swept the same way with mt-evaluate on split=valid
(each trial's results.json is read; other splits are ignored):
    mt-evaluate -m split=valid report=false checkpoint=RUN/checkpoints/best.pt \\
        decode.beam_size=1,4,8 decode.alpha=0.6,1.0
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from mt.evaluation.sweep import table, trials
from mt.files import write_text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("sweep_dir", type=Path)
    parser.add_argument("--output", type=Path, help="also write the table to this file")
    args = parser.parse_args(argv)
    found = trials(args.sweep_dir)
    if not found:
        print(f"no trials with metrics under {args.sweep_dir}", file=sys.stderr)
        return 1
    text = table(found)
    print(text)
    if args.output:
        write_text(args.output, text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
