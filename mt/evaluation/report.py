"""The run report: ``run_dir/report.md`` with the PNG figures it shows, written beside it.

A report is built from what a run leaves on disk, so it needs no model and no data:

- ``metrics.jsonl``: one JSON record per line. Training records carry ``step``, ``epoch``,
  ``loss``, ``nll``, ``lr``, ``tgt_tok_per_s``, ``wall`` (seconds of training so far);
  validation records add ``valid_loss``, ``valid_nll``, ``valid_bleu`` (``valid_chrf`` where
  chrF chose best.pt; and ``wall``); records with ``stage`` and ``seconds`` give the wall time
  of a pipeline stage, the training one also ``selection`` (what chose best.pt, and the
  search validation decoded with).
- ``timings.json`` (optional): ``{stage: seconds}``, merged with the stage records above.
- ``results.json`` (optional): the final scores (``bleu``, ``chrf``, ``signature``,
  ``chrf_signature``, ``split``, ``checkpoint``).
- ``translations/<split>.txt`` (optional): the system output of the scored split.
- ``config.yaml`` (optional): shown folded at the end.

Example translations need the sources and references, and the attention heatmap needs a model;
the caller passes both in (``examples``, ``attention``), typically ``mt.evaluation.evaluate`` with
``mt.decode.translate.Translator``. Every piece is optional: a missing file or an empty series
skips its section. matplotlib is imported lazily, so ``import mt.evaluation.report`` is cheap.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from mt.evaluation.metrics import METRICS
from mt.files import atomic_path, read_json, write_json, write_text

log = logging.getLogger(__name__)

MAX_EXAMPLES = 5  # example translations shown in the report


# --------------------------------------------------------------------------- reading the run dir


def load_metrics(path: str | Path) -> list[dict[str, Any]]:
    """Read a JSONL metrics file; a missing file gives ``[]``, and a corrupt line (a run killed
    mid-write leaves a truncated one) is logged and skipped."""
    path = Path(path)
    if not path.is_file():
        return []
    records = []
    for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        line = line.strip()
        if not line:
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            log.warning("%s:%d: not JSON, skipped", path, lineno)
            continue
        if isinstance(record, dict):
            records.append(record)
    return records


def series(records: Sequence[Mapping[str, Any]], key: str) -> tuple[np.ndarray, np.ndarray]:
    """``(steps, values)`` of every record holding a finite number under ``key`` and a ``step``.

    Records are sorted by step; on a repeated step (a resumed run re-logging it) the last wins.
    """
    points: dict[float, float] = {}
    for record in records:
        step, value = record.get("step"), record.get(key)
        if _is_number(step) and _is_number(value) and math.isfinite(value):
            points[float(step)] = float(value)
    steps = np.array(sorted(points), dtype=np.float64)
    return steps, np.array([points[s] for s in steps], dtype=np.float64)


def stage_times(run_dir: str | Path, records: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """Wall seconds per stage: ``stage``/``seconds`` records, then ``timings.json`` (wins)."""
    times: dict[str, float] = {}
    for record in records:
        if isinstance(record.get("stage"), str) and _is_number(record.get("seconds")):
            times[record["stage"]] = float(record["seconds"])
    for stage, seconds in read_json(Path(run_dir) / "timings.json").items():
        if _is_number(seconds):
            times[str(stage)] = float(seconds)
    return times


def record_stage_time(run_dir: str | Path, stage: str, seconds: float) -> None:
    """Add ``stage``'s wall time to ``run_dir/timings.json`` (written atomically)."""
    path = Path(run_dir) / "timings.json"
    times = read_json(path)
    times[stage] = round(float(seconds), 3)
    write_json(path, times, indent=1)


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


# --------------------------------------------------------------------------- figures


def wall_series(records: Sequence[Mapping[str, Any]], key: str) -> tuple[np.ndarray, np.ndarray]:
    """``(minutes, values)`` of ``key``: minutes of training (``wall``) when each value was logged.

    A record without its own ``wall`` (validation records of runs before it was logged) gets
    the wall time of its step, interpolated between the training records around it.
    """
    steps, wall = series(records, "wall")
    points: dict[float, float] = {}
    for record in records:
        value, step = record.get(key), record.get("step")
        if not (_is_number(value) and math.isfinite(value)):
            continue
        if _is_number(record.get("wall")):
            seconds = float(record["wall"])
        elif _is_number(step) and len(steps):
            seconds = float(np.interp(float(step), steps, wall))
        else:
            continue
        points[seconds / 60] = float(value)
    minutes = np.array(sorted(points), dtype=np.float64)
    return minutes, np.array([points[m] for m in minutes], dtype=np.float64)


def bleu_levels(best: float) -> list[float]:
    """The BLEU levels a time-to-quality table lists: every 5 up to 25, then every point."""
    coarse = [5.0, 10.0, 15.0, 20.0, 25.0]
    fine = [float(b) for b in range(30, int(best) + 1)]
    return [level for level in coarse + fine if level <= best]


def time_to_levels(
    minutes: np.ndarray, values: np.ndarray, levels: Sequence[float]
) -> list[tuple[float, float | None]]:
    """``(level, first minute a value reached it or None)`` for each level."""
    out = []
    for level in levels:
        reached = np.nonzero(values >= level)[0]
        out.append((level, float(minutes[reached[0]]) if len(reached) else None))
    return out


def plot_lines(
    curves: Sequence[tuple[str, np.ndarray, np.ndarray]],
    path: str | Path,
    ylabel: str,
    title: str,
    xlabel: str = "step",
) -> Path | None:
    """Draw ``(label, x, values)`` curves against the step (or ``xlabel``); ``None`` when all
    are empty."""
    curves = [c for c in curves if len(c[1])]
    if not curves:
        return None
    from mt.decode.alignment import pyplot  # (torch, matplotlib: imported when drawing)

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for label, steps, values in curves:
        marker = "o" if len(steps) <= 30 else None
        ax.plot(steps, values, label=label, marker=marker, markersize=3)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    if len(curves) > 1:
        ax.legend()
    fig.tight_layout()
    path = Path(path)
    atomic_path(path, lambda f: fig.savefig(f, dpi=100, format="png"))
    plt.close(fig)
    return path


def plot_curves(records: Sequence[Mapping[str, Any]], out_dir: str | Path) -> dict[str, Path]:
    """Write the standard figures of a run into ``out_dir``; returns ``{name: png}`` drawn.

    Names: ``loss`` (training and validation loss/NLL), ``lr``, ``bleu`` (validation BLEU),
    ``throughput`` (target tokens per second), ``bleu_minutes`` (validation BLEU against
    minutes of training: time to quality). A figure without data is not drawn.
    """
    out_dir = Path(out_dir)

    def curves(*keys: tuple[str, str]) -> list[tuple[str, np.ndarray, np.ndarray]]:
        return [(label, *series(records, key)) for label, key in keys]

    loss = curves(("train loss", "loss"), ("train nll", "nll"), ("valid loss", "valid_loss"),
                  ("valid nll", "valid_nll"))  # fmt: skip
    specs = {
        "loss": (loss, "loss (nats per token)", "Training and validation loss"),
        "lr": (curves(("lr", "lr")), "learning rate", "Learning rate"),
        "bleu": (curves(("valid BLEU", "valid_bleu")), "BLEU", "Validation BLEU"),
        "throughput": (
            curves(("target tokens/s", "tgt_tok_per_s")),
            "target tokens / s",
            "Training throughput",
        ),
        "bleu_minutes": (
            [("valid BLEU", *wall_series(records, "valid_bleu"))],
            "BLEU",
            "Validation BLEU against training time",
        ),
    }
    figures = {}
    for name, (lines, ylabel, title) in specs.items():
        xlabel = "minutes of training (validation included)" if name == "bleu_minutes" else "step"
        png = plot_lines(lines, out_dir / f"{name}.png", ylabel, title, xlabel)
        if png is not None:
            figures[name] = png
    return figures


def _time_to_bleu(records: Sequence[Mapping[str, Any]]) -> list[str]:
    """The table of minutes to each validation BLEU level (empty without validation BLEU)."""
    minutes, bleu = wall_series(records, "valid_bleu")
    if not len(bleu):
        return []
    search = _selection(records).get("search") or "greedy"
    lines = [
        "### Time to BLEU",
        "",
        f"The first validation at or above each level ({search} BLEU on the validation set, "
        "as logged during training; minutes of training, validation included).",
        "",
        "| valid BLEU | minutes |",
        "|---|---|",
    ]
    for level, minute in time_to_levels(minutes, bleu, bleu_levels(float(bleu.max()))):
        lines.append(f"| {level:g} | {minute:.1f} |")
    return lines + [""]


# --------------------------------------------------------------------------- markdown


def _cell(text: Any) -> str:
    """One markdown table cell: pipes escaped, newlines flattened."""
    return str(text).replace("\\", "\\\\").replace("|", "\\|").replace("\n", " ")


def _fmt(x: Any) -> str:
    if _is_number(x) and isinstance(x, float):
        return f"{x:.4g}" if abs(x) < 1e4 else f"{x:,.0f}"
    return str(x)


def _duration(seconds: float) -> str:
    minutes, sec = divmod(seconds, 60)
    return f"{int(minutes)} min {sec:04.1f} s" if minutes else f"{sec:.1f} s"


def _results_section(results: Mapping[str, Any]) -> list[str]:
    lines = ["## Final scores", ""]
    split = results.get("split")
    if split is not None:
        lines.append(
            f"Split: `{split}`"
            + (f", checkpoint `{results['checkpoint']}`" if results.get("checkpoint") else "")
        )
        lines.append("")
    lines += ["| metric | score | signature |", "|---|---|---|"]
    scores = results.get("scores") or {
        metric: {"score": results[metric], "signature": results.get(sig, "")}
        for metric, sig in (("bleu", "signature"), ("chrf", "chrf_signature"))
        if results.get(metric) is not None
    }
    for metric, value in scores.items():
        lines.append(
            f"| {METRICS.get(metric, metric)} | {_fmt(value['score'])} "
            f"| `{_cell(value.get('signature', ''))}` |"
        )
    split_bleu = results.get("compound_split_bleu")
    if split_bleu:
        lines.append(
            f"| tokenized BLEU, compound-split | {_fmt(split_bleu['score'])} "
            f"| {_cell(split_bleu['note'])} |"
        )
    for name, part in (results.get("directions") or {}).items():  # data.directions
        lines += [f"| {_cell(name)}: {METRICS.get(metric, metric)} | {_fmt(value['score'])} "
                  f"| `{_cell(value.get('signature', ''))}` |"
                  for metric, value in part["scores"].items()]  # fmt: skip
    shown = {"bleu", "chrf", "signature", "chrf_signature", "split", "checkpoint"}
    extra = [
        (key, value)
        for key, value in results.items()
        if key not in shown and (_is_number(value) or isinstance(value, str))
    ]
    if extra:  # decoding settings and speed, as evaluation recorded them
        lines += ["", "| detail | value |", "|---|---|"]
        lines += [f"| {_cell(key)} | {_cell(_fmt(value))} |" for key, value in extra]
    return lines + [""]


def _training_summary(records: Sequence[Mapping[str, Any]]) -> list[str]:
    steps, loss = series(records, "loss")
    if not len(steps):
        return []
    lines = ["## Training", ""]
    # The last update is the last record's step (a validation after the last logged update).
    last = max(int(r["step"]) for r in records if _is_number(r.get("step")))
    facts = [("updates", last)]
    for key, label, fmt in (("epoch", "epochs", _fmt), ("wall", "training wall time", _duration)):
        _, values = series(records, key)
        if len(values):
            facts.append((label, fmt(values[-1])))
    facts.append(("last training loss", f"{_fmt(loss[-1])} (step {int(steps[-1])})"))
    best_of = {"valid_loss": np.argmin, "valid_bleu": np.argmax, "valid_chrf": np.argmax}
    for key, best in best_of.items():
        vsteps, values = series(records, key)
        if len(values):
            i = int(best(values))
            facts.append(
                (f"best {_METRIC_NAMES[key]}", f"{_fmt(values[i])} (step {int(vsteps[i])})")
            )
    chosen = _chosen_by(_selection(records))
    if chosen:
        facts.append(("best.pt chosen by", chosen))
    _, tps = series(records, "tgt_tok_per_s")
    if len(tps):
        facts.append(("median target tokens/s", f"{np.median(tps):,.0f}"))
    end = train_end(records)
    if end.get("stop"):
        facts.append(("ended by", _ended_by(end)))
    if isinstance(end.get("machine"), Mapping):
        m = end["machine"]
        bf16 = "native bf16" if m.get("native_bf16") else "no native bf16"
        where = f"{m.get('gpu') or m.get('cpu')} ({bf16}, {m.get('threads')} threads)"
        facts.append(("machine", f"{where}, {end.get('precision')}"))
    lines += ["| | |", "|---|---|"] + [f"| {k} | {_cell(v)} |" for k, v in facts]
    return lines + [""]


def train_end(records: Sequence[Mapping[str, Any]]) -> Mapping[str, Any]:
    """The last end-of-training record (``{}`` when there is none)."""
    return next((r for r in reversed(records) if r.get("stage") == "train"), {})


def _selection(records: Sequence[Mapping[str, Any]]) -> Mapping[str, Any]:
    """The training record's ``selection`` (what chose best.pt; ``{}`` when not logged)."""
    selection = train_end(records).get("selection")
    return selection if isinstance(selection, Mapping) else {}


_METRIC_NAMES = {"valid_bleu": "validation BLEU", "valid_chrf": "validation chrF",
                 "valid_loss": "validation loss"}  # fmt: skip


def _chosen_by(selection: Mapping[str, Any]) -> str:
    """``selection`` in words: ``validation chrF (higher is better) of beam 5 (...) search``;
    empty when not logged."""
    metric = selection.get("metric")
    if not isinstance(metric, str):
        return ""
    text = _METRIC_NAMES.get(metric, metric)
    if selection.get("better") in ("higher", "lower"):
        text += f" ({selection['better']} is better)"
    if metric != "valid_loss" and selection.get("search"):
        text += f" of {selection['search']} search"
    return text


def _ended_by(end: Mapping[str, Any]) -> str:
    """Which budget ended training, in words: the update budget, the time cap, patience..."""
    budget = end.get("budget") if isinstance(end.get("budget"), Mapping) else {}
    stop, step = end.get("stop"), end.get("step")
    if stop == "max_steps":
        return f"the update budget ({budget.get('max_steps', step):,} updates)"
    if stop == "max_minutes":
        planned = budget.get("max_steps") or 0
        of = f" of {planned:,} planned" if planned else ""
        return f"the time cap ({budget.get('max_minutes'):g} min) after {step:,} updates{of}"
    if stop == "patience":
        return f"patience ({budget.get('patience')} validations without improvement)"
    if stop == "max_epochs":
        return f"the epoch budget ({budget.get('max_epochs')} epochs)"
    return "a stop signal" if stop == "signal" else str(stop)


def _examples_section(
    hypotheses: Sequence[str] | None, examples: Mapping[str, Sequence[str]] | None
) -> list[str]:
    sources = list((examples or {}).get("sources") or [])
    references = list((examples or {}).get("references") or [])
    hyps = list((examples or {}).get("hypotheses") or hypotheses or [])
    if not hyps:
        return []
    n = min(MAX_EXAMPLES, len(hyps))
    columns = [("source", sources), ("reference", references), ("translation", hyps)]
    columns = [(name, col) for name, col in columns if len(col) >= n]
    lines = ["## Example translations", ""]
    lines.append("| # | " + " | ".join(name for name, _ in columns) + " |")
    lines.append("|---|" + "---|" * len(columns))
    for i in range(n):
        lines.append(f"| {i + 1} | " + " | ".join(_cell(col[i]) for _, col in columns) + " |")
    return lines + [""]


def write_report(
    run_dir: str | Path,
    examples: Mapping[str, Sequence[str]] | None = None,
    attention: Any = None,
) -> Path:
    """Build ``run_dir/report.md`` (returned) and its PNG figures from the files of a run.

    ``examples``: ``{"sources": [...], "references": [...]}`` of the scored split, line by line,
    and ``"hypotheses"`` (else ``translations/<split>.txt`` is read). ``attention``: the heatmap
    input ``(src_tokens, tgt_tokens, matrix (T, S))`` (``mt.decode.alignment.plot_attention``).
    """
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    records = load_metrics(run_dir / "metrics.jsonl")
    results = read_json(run_dir / "results.json")
    lines = [f"# Run report: {run_dir.resolve().name}", ""]
    if results:
        lines += _results_section(results)
    lines += _training_summary(records)

    figures = plot_curves(records, run_dir)
    captions = {
        "loss": "Loss against updates (label-smoothed loss and NLL, nats per target token)",
        "lr": "Learning rate against updates",
        "bleu": "Validation BLEU against updates",
        "bleu_minutes": "Validation BLEU against minutes of training",
        "throughput": "Training throughput (non-pad target tokens per second)",
    }
    if figures:
        lines += ["## Curves", ""]
        for name, png in figures.items():
            lines += [f"### {captions[name]}", "", f"![{name}]({png.name})", ""]
            if name == "bleu_minutes":
                lines += _time_to_bleu(records)

    times = stage_times(run_dir, records)
    if times:
        lines += ["## Wall time per stage", "", "| stage | time |", "|---|---|"]
        lines += [f"| {_cell(stage)} | {_duration(sec)} |" for stage, sec in times.items()]
        lines += [f"| **total** | {_duration(sum(times.values()))} |", ""]

    hyp_path = run_dir / "translations" / f"{results.get('split', 'test')}.txt"
    hypotheses = hyp_path.read_text(encoding="utf-8").splitlines() if hyp_path.is_file() else None
    lines += _examples_section(hypotheses, examples)

    if attention is not None:
        from mt.decode.alignment import plot_attention

        try:
            src_tokens, tgt_tokens, matrix = attention
            png = plot_attention(src_tokens, tgt_tokens, matrix, run_dir / "attention.png")
        except (ValueError, KeyError, TypeError) as err:
            log.warning("attention heatmap skipped: %s", err)
        else:
            lines += [
                "## Encoder-decoder attention",
                "",
                "Last decoder layer, averaged over heads; rows are output pieces, columns source "
                "pieces.",
                "",
                f"![attention]({png.name})",
                "",
            ]

    config_path = run_dir / "config.yaml"
    if config_path.is_file():
        text = config_path.read_text(encoding="utf-8").rstrip()
        lines += ["## Configuration", "", "<details><summary>config.yaml</summary>", ""]
        lines += ["```yaml", text, "```", "", "</details>", ""]

    path = run_dir / "report.md"
    write_text(path, "\n".join(lines))
    log.info("report written to %s", path)
    return path
