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

Decoding settings of a trained model are swept the same way with mt-evaluate on split=valid
(each trial's results.json is read; other splits are ignored):
    mt-evaluate -m split=valid report=false checkpoint=RUN/checkpoints/best.pt \\
        decode.beam_size=1,4,8 decode.alpha=0.6,1.0 \\
        hydra.sweep.dir=runs/beam_sweep 'run_dir=${hydra:sweep.dir}/${hydra:job.num}'
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import yaml

from mt.files import write_text


def _flatten(tree: dict, prefix: str = "") -> dict:
    flat = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(_flatten(value, name + "."))
        else:
            flat[name] = value
    return flat


def decode_trial(run_dir: Path) -> dict | None:
    """A decoding trial: ``mt-evaluate split=valid`` results (None for any other split: the
    test sets never choose settings)."""
    result = json.loads((run_dir / "results.json").read_text(encoding="utf-8"))
    if result.get("split") != "valid":
        return None
    keys = ("beam_size", "alpha", "max_len_a", "max_len_b", "precision", "checkpoint")
    return {
        "run": run_dir.name,
        "config": {f"decode.{k}" if k != "checkpoint" else k: result.get(k) for k in keys},
        "valid_bleu": result["bleu"],
        "figures": {
            "valid BLEU": f"{result['bleu']:.2f}",
            "step": str(result.get("step", 0)),
            "sent/s": f"{result.get('sent_per_s') or 0:.1f}",
        },
    }


def trial(run_dir: Path) -> dict | None:
    """The settings and figures of one trial (None when it has no metrics yet): a training run
    (config.yaml + metrics.jsonl) or a decoding run (results.json of mt-evaluate)."""
    metrics = run_dir / "metrics.jsonl"
    if not metrics.is_file():
        return decode_trial(run_dir) if (run_dir / "results.json").is_file() else None
    records = []
    for line in metrics.read_text(encoding="utf-8").splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    valid = [r for r in records if "valid_loss" in r]
    train = [r for r in records if "loss" in r]
    config = yaml.safe_load((run_dir / "config.yaml").read_text(encoding="utf-8"))
    bleu = max((r.get("valid_bleu", float("nan")) for r in valid), default=None)
    loss = min((r["valid_loss"] for r in valid), default=None)
    tok_s = statistics.median(r["tgt_tok_per_s"] for r in train) if train else None
    return {
        "run": run_dir.name,
        "config": _flatten(config),
        "valid_bleu": bleu,
        "figures": {
            "valid BLEU": f"{bleu:.2f}" if bleu is not None else "-",
            "valid loss": f"{loss:.3f}" if loss is not None else "-",
            "updates": str(max((r["step"] for r in records if "step" in r), default=0)),
            "tgt tok/s": f"{tok_s:.0f}" if tok_s else "-",
        },
    }


def table(trials: list[dict]) -> str:
    """A Markdown table of the trials, best valid BLEU first, with the varied settings and the
    figures of the trials' kind (training or decoding)."""
    keys = sorted({k for t in trials for k in t["config"]})
    varied = [
        k
        for k in keys
        if len({json.dumps(t["config"].get(k)) for t in trials}) > 1 and k != "run_dir"
    ]
    figures = list(dict.fromkeys(name for t in trials for name in t["figures"]))
    head = ["run", *varied, *figures]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    ranked = sorted(trials, key=lambda t: -(t["valid_bleu"] or 0.0))
    for t in ranked:
        cells = [t["run"], *(str(t["config"].get(k)) for k in varied)]
        cells += [t["figures"].get(name, "-") for name in figures]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("sweep_dir", type=Path)
    parser.add_argument("--output", type=Path, help="also write the table to this file")
    args = parser.parse_args(argv)
    dirs = sorted(
        (p for p in args.sweep_dir.iterdir() if p.is_dir()),
        key=lambda p: (len(p.name), p.name),  # 2 before 10
    )
    trials = [t for t in map(trial, dirs) if t is not None]
    if not trials:
        print(f"no trials with metrics under {args.sweep_dir}", file=sys.stderr)
        return 1
    text = table(trials)
    print(text)
    if args.output:
        write_text(args.output, text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
