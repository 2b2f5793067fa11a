"""The summary of a Hydra multirun sweep: one row per trial, ranked by valid BLEU, and a plot.

A sweep's trials are the run directories under its sweep directory (``mt-train -m ...`` puts
each trial in ``<hydra.sweep.dir>/<job number>``, see ``mt.cli``). A training trial holds
``config.yaml`` and ``metrics.jsonl``; a decoding trial (``mt-evaluate -m split=valid ...``)
holds ``results.json``. The table shows the settings that differ between trials and each
trial's figures (valid BLEU ranks them, never a test set: test scores of ``train.evaluate``
are shown only). :class:`SweepSummary` writes ``summary.md`` and ``summary.png`` into the sweep
directory when the sweep ends; ``scripts/sweep.py`` prints the same table for any sweep directory.
"""

from __future__ import annotations

import json
import logging
import statistics
from pathlib import Path
from typing import Any

import numpy as np
from hydra.experimental.callback import Callback

from mt.config import flatten_keys
from mt.evaluation.report import load_metrics, plot_lines
from mt.files import read_json, write_text

log = logging.getLogger(__name__)


def decode_trial(run_dir: Path) -> dict | None:
    """A decoding trial: ``mt-evaluate split=valid`` results (None for any other split: the
    test sets never choose settings)."""
    result = read_json(run_dir / "results.json")
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
    import yaml

    records = load_metrics(metrics)
    valid = [r for r in records if "valid_loss" in r]
    train = [r for r in records if "loss" in r]
    config = yaml.safe_load((run_dir / "config.yaml").read_text(encoding="utf-8"))
    bleu = max((r.get("valid_bleu", float("nan")) for r in valid), default=None)
    loss = min((r["valid_loss"] for r in valid), default=None)
    tok_s = statistics.median(r["tgt_tok_per_s"] for r in train) if train else None
    wall = max((r["wall"] for r in records if isinstance(r.get("wall"), (int, float))), default=0)
    # reported beside the valid figures, never ranked by (train.evaluate wrote them)
    test = {}
    scores = read_json(run_dir / "results.test.json").get("scores") or {}
    for metric, label in (("bleu", "test BLEU"), ("chrf", "test chrF")):
        value = scores.get(metric) or {}
        if value.get("score") is not None:
            test[label] = f"{value['score']:.2f}"
    return {
        "run": run_dir.name,
        "config": flatten_keys(config),
        "valid_bleu": bleu,
        "curve": [(r["step"], r["valid_bleu"]) for r in valid if "valid_bleu" in r],
        "figures": {
            "valid BLEU": f"{bleu:.2f}" if bleu is not None else "-",
            "valid loss": f"{loss:.3f}" if loss is not None else "-",
            "updates": str(max((r["step"] for r in records if "step" in r), default=0)),
            "tgt tok/s": f"{tok_s:.0f}" if tok_s else "-",
            "minutes": f"{wall / 60:.1f}",
            **test,
        },
    }


def trials(sweep_dir: Path) -> list[dict]:
    """The trials under ``sweep_dir``, in job order (2 before 10)."""
    dirs = sorted((p for p in Path(sweep_dir).iterdir() if p.is_dir()),
                  key=lambda p: (len(p.name), p.name))  # fmt: skip
    return [t for t in map(trial, dirs) if t is not None]


def table(found: list[dict]) -> str:
    """A Markdown table of the trials, best valid BLEU first, with the varied settings and the
    figures of the trials' kind (training or decoding); training trials mark the best."""
    keys = sorted({k for t in found for k in t["config"]} - {"run_dir"})
    varied = [k for k in keys if len({json.dumps(t["config"].get(k)) for t in found}) > 1]
    figures = list(dict.fromkeys(name for t in found for name in t["figures"]))
    training = any("curve" in t for t in found)
    head = ["run", *varied, *figures] + (["best"] if training else [])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    ranked = sorted(found, key=lambda t: -(t["valid_bleu"] or 0.0))
    for i, t in enumerate(ranked):
        cells = [t["run"], *(str(t["config"].get(k)) for k in varied)]
        cells += [t["figures"].get(name, "-") for name in figures]
        if training:
            cells.append("**best**" if i == 0 and t["valid_bleu"] is not None else "")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(found: list[dict], path: Path) -> Path | None:
    """Validation BLEU against updates, one line per training trial (None: nothing to draw)."""
    curves = []
    for t in found:
        if t.get("curve"):
            steps, bleu = zip(*t["curve"])
            curves.append((f"trial {t['run']}", np.array(steps), np.array(bleu)))
    return plot_lines(curves, path, "valid BLEU", "Sweep: validation BLEU", xlabel="update")


def summarize(sweep_dir: str | Path) -> str | None:
    """Write ``summary.md`` (and ``summary.png``) into ``sweep_dir``; returns the table, or
    None when no trial has results."""
    sweep_dir = Path(sweep_dir)
    found = trials(sweep_dir) if sweep_dir.is_dir() else []
    if not found:
        return None
    text = table(found)
    lines = [f"# Sweep {sweep_dir}", "", text, ""]
    try:
        png = plot(found, sweep_dir / "summary.png")
    except Exception as err:  # matplotlib missing or broken: the table is enough
        log.info("sweep plot skipped: %s", err)
        png = None
    if png is not None:
        lines += [f"![validation BLEU]({png.name})", ""]
    write_text(sweep_dir / "summary.md", "\n".join(lines))
    return text


class SweepSummary(Callback):
    """A Hydra callback (``hydra.callbacks`` in conf/config.yaml): when a multirun ends, the
    summary of its sweep directory is written and logged."""

    def on_multirun_end(self, config: Any, **kwargs: Any) -> None:
        sweep_dir = Path(str(config.hydra.sweep.dir))
        text = summarize(sweep_dir)
        if text is None:
            log.warning("sweep %s: no trial has results to summarise", sweep_dir)
            return
        log.info("sweep summary (%s):\n%s", sweep_dir / "summary.md", text)
