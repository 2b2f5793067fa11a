"""Summarise a Hydra multirun sweep of mt-train: one row per trial, ranked by valid BLEU.

Each trial's run directory holds config.yaml and metrics.jsonl; the table shows the settings
that differ between trials, the best validation BLEU (greedy, on the valid split: never the
test sets), the best valid loss, the updates done and the median training throughput.

Usage:
    python scripts/sweep.py runs/sweep_multi30k_de_en [--output sweep.md]

The sweep itself (see README.md, "Choosing the settings"):
    mt-train -m experiment=multi30k_de_en train.max_minutes=8 \\
        model.dropout=0.1,0.2 train.lr=1e-3,2e-3 \\
        hydra.sweep.dir=runs/sweep_multi30k_de_en \\
        'run_dir=${hydra:sweep.dir}/${hydra:job.num}'
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import yaml


def _flatten(tree: dict, prefix: str = "") -> dict:
    flat = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(_flatten(value, name + "."))
        else:
            flat[name] = value
    return flat


def trial(run_dir: Path) -> dict | None:
    """The settings and figures of one trial (None when it has no metrics yet)."""
    metrics = run_dir / "metrics.jsonl"
    if not metrics.is_file():
        return None
    records = []
    for line in metrics.read_text(encoding="utf-8").splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    valid = [r for r in records if "valid_loss" in r]
    train = [r for r in records if "loss" in r]
    config = yaml.safe_load((run_dir / "config.yaml").read_text(encoding="utf-8"))
    return {
        "run": run_dir.name,
        "config": _flatten(config),
        "valid_bleu": max((r.get("valid_bleu", float("nan")) for r in valid), default=None),
        "valid_loss": min((r["valid_loss"] for r in valid), default=None),
        "steps": max((r["step"] for r in records if "step" in r), default=0),
        "tok_s": statistics.median(r["tgt_tok_per_s"] for r in train) if train else None,
    }


def table(trials: list[dict]) -> str:
    """A Markdown table of the trials, best valid BLEU first, with the varied settings."""
    keys = sorted({k for t in trials for k in t["config"]})
    varied = [
        k
        for k in keys
        if len({json.dumps(t["config"].get(k)) for t in trials}) > 1 and k != "run_dir"
    ]
    head = ["run", *varied, "valid BLEU", "valid loss", "updates", "tgt tok/s"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    ranked = sorted(trials, key=lambda t: -(t["valid_bleu"] or 0.0))
    for t in ranked:
        cells = [t["run"], *(str(t["config"].get(k)) for k in varied)]
        cells += [
            f"{t['valid_bleu']:.2f}" if t["valid_bleu"] is not None else "-",
            f"{t['valid_loss']:.3f}" if t["valid_loss"] is not None else "-",
            str(t["steps"]),
            f"{t['tok_s']:.0f}" if t["tok_s"] else "-",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("sweep_dir", type=Path)
    parser.add_argument("--output", type=Path, help="also write the table to this file")
    args = parser.parse_args(argv)
    dirs = sorted(p for p in args.sweep_dir.iterdir() if (p / "config.yaml").is_file())
    trials = [t for t in map(trial, dirs) if t is not None]
    if not trials:
        print(f"no trials with metrics under {args.sweep_dir}", file=sys.stderr)
        return 1
    text = table(trials)
    print(text)
    if args.output:
        args.output.write_text(text + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
