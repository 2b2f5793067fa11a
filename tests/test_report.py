"""The run report: a synthetic run directory in, report.md and valid PNG files out."""

from __future__ import annotations

import json
import re
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest

from mt.decode.alignment import plot_attention
from mt.evaluation.report import (
    bleu_levels,
    load_metrics,
    series,
    stage_times,
    time_to_levels,
    wall_series,
    write_report,
)

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def png_size(path: Path) -> tuple[int, int]:
    """(width, height) read from the IHDR chunk, checking signature and CRC by hand."""
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE, f"{path} is not a PNG"
    length, kind = struct.unpack(">I4s", data[8:16])
    assert kind == b"IHDR" and length == 13
    body = data[16 : 16 + length]
    (crc,) = struct.unpack(">I", data[16 + length : 20 + length])
    assert zlib.crc32(kind + body) == crc, "IHDR CRC mismatch"
    assert data.rstrip(b"\0").endswith(b"IEND\xaeB`\x82"), "PNG truncated"
    width, height = struct.unpack(">II", body[:8])
    return width, height


def make_run(tmp_path: Path, with_extras: bool = True) -> Path:
    run = tmp_path / "run"
    run.mkdir()
    lines = [json.dumps({"stage": "prepare", "seconds": 12.5})]
    for step in range(10, 210, 10):
        rec = {
            "step": step,
            "epoch": step / 100,
            "loss": 8.0 / (1 + step / 50),
            "nll": 7.0 / (1 + step / 50),
            "lr": 1e-3 * min(step / 100, (100 / step) ** 0.5),
            "tgt_tok_per_s": 1900.0 + step,
            "wall": step * 0.5,
        }
        if step % 50 == 0:
            rec.update(
                valid_loss=rec["loss"] + 0.3, valid_nll=rec["nll"] + 0.2, valid_bleu=step / 10
            )
        lines.append(json.dumps(rec))
    lines.append('{"step": 210, "loss": 0.1')  # a truncated last line (killed run)
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    if with_extras:
        (run / "timings.json").write_text(json.dumps({"train": 100.0, "evaluate": 30.0}))
        results = {
            "bleu": 41.23,
            "chrf": 63.4,
            "signature": "nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|version:2.4.0",
            "chrf_signature": "nrefs:1|case:mixed|eff:yes|nc:6|nw:0|space:no|version:2.4.0",
            "split": "test",
            "checkpoint": "runs/x/checkpoints/best.pt",
            "beam_size": 4,
        }
        (run / "results.json").write_text(json.dumps(results))
        (run / "translations").mkdir()
        (run / "translations" / "test.txt").write_text("A dog | runs.\nTwo men talk.\n")
        (run / "config.yaml").write_text("model:\n  d_model: 256\n")
    return run


def test_full_report(tmp_path):
    run = make_run(tmp_path)
    examples = {
        "sources": ["Ein Hund rennt.", "Zwei Männer reden."],
        "references": ["A dog runs.", "Two men talk."],
    }
    src, tgt = ["Ein", "Hund", "rennt", ".", "</s>"], ["A", "dog", "runs", ".", "</s>"]
    attn = np.full((5, 5), 0.02) + np.eye(5) * 0.9
    path = write_report(run, examples=examples, attention=(src, tgt, attn))
    assert path == run / "report.md"
    text = path.read_text()
    images = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", text)
    assert set(images) == {
        "loss.png", "lr.png", "bleu.png", "bleu_minutes.png", "throughput.png", "attention.png"
    }
    for name in images:
        width, height = png_size(run / name)
        assert width > 100 and height > 100
    # Final scores with both signatures, the run's split and checkpoint.
    assert "41.23" in text and "63.4" in text
    assert "tok:13a" in text and "nc:6" in text and "best.pt" in text
    assert "| beam_size | 4 |" in text  # further scalar results as details
    # Stage times from the stage record and timings.json; total = 12.5 + 100 + 30.
    assert "prepare" in text and "evaluate" in text and "2 min 22.5 s" in text
    # Examples: source, reference and translation side by side; the pipe is escaped.
    assert "| 1 | Ein Hund rennt. | A dog runs. | A dog \\| runs. |" in text
    # Summary: last update, best validation BLEU (step 200 -> 20.0).
    assert "| updates | 200 |" in text and "20 (step 200)" in text
    assert "d_model: 256" in text
    # Time to BLEU: valid BLEU step / 10 at steps 50..200, wall step / 2 seconds.
    assert "| 5 | 0.4 |" in text and "| 10 | 0.8 |" in text and "| 20 | 1.7 |" in text


def test_minimal_run_dir_skips_missing_pieces(tmp_path):
    run = make_run(tmp_path, with_extras=False)
    # Only training records: drop the validation fields to check those figures are skipped.
    records = [
        {k: v for k, v in r.items() if not k.startswith("valid")}
        for r in load_metrics(run / "metrics.jsonl")
    ]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    text = write_report(run).read_text()
    images = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", text)
    assert set(images) == {"loss.png", "lr.png", "throughput.png"}
    assert not (run / "bleu.png").exists() and not (run / "attention.png").exists()
    assert "Final scores" not in text and "Example translations" not in text


def test_empty_run_dir(tmp_path):
    path = write_report(tmp_path / "empty")
    text = path.read_text()
    assert text.startswith("# Run report")
    assert "![" not in text
    assert list(path.parent.glob("*.png")) == []


def test_bad_attention_is_skipped_not_fatal(tmp_path):
    run = make_run(tmp_path)
    text = write_report(run, attention=(["a", "b"], ["x"], np.ones((2, 2)))).read_text()
    assert "attention.png" not in text


def test_hypotheses_alone(tmp_path):
    run = make_run(tmp_path)
    text = write_report(run).read_text()
    assert "| 2 | Two men talk. |" in text


def test_load_metrics_and_series(tmp_path):
    run = make_run(tmp_path, with_extras=False)
    records = load_metrics(run / "metrics.jsonl")
    assert len(records) == 21  # the stage record + 20 steps; the truncated line is dropped
    steps, bleu = series(records, "valid_bleu")
    np.testing.assert_array_equal(steps, [50, 100, 150, 200])
    np.testing.assert_allclose(bleu, [5.0, 10.0, 15.0, 20.0])
    # Repeated step after a resume: the last record wins; non-finite values are ignored.
    recs = [{"step": 2, "loss": 3.0}, {"step": 1, "loss": 5.0}, {"step": 2, "loss": 4.0}]
    recs.append({"step": 3, "loss": float("nan")})
    steps, loss = series(recs, "loss")
    np.testing.assert_array_equal(steps, [1, 2])
    np.testing.assert_array_equal(loss, [5.0, 4.0])
    assert load_metrics(tmp_path / "nope.jsonl") == []


def test_stage_times_merge(tmp_path):
    (tmp_path / "timings.json").write_text(json.dumps({"train": 5.0, "decode": 2}))
    recs = [{"stage": "train", "seconds": 1.0}, {"stage": "prepare", "seconds": 3}]
    assert stage_times(tmp_path, recs) == {"train": 5.0, "prepare": 3.0, "decode": 2.0}


def test_plot_attention_shapes(tmp_path):
    src, tgt = ["a", "b", "c"], ["x", "y"]
    out = plot_attention(src, tgt, np.random.default_rng(0).random((2, 3)), tmp_path / "a.png")
    assert png_size(out)[0] > 50
    with pytest.raises(ValueError, match="attention matrix"):
        plot_attention(src, tgt, np.ones((3, 2)), tmp_path / "b.png")


def test_plot_attention_accepts_torch(tmp_path):
    torch = pytest.importorskip("torch")
    out = plot_attention(["a", "b"], ["x"], torch.tensor([[0.25, 0.75]]), tmp_path / "t.png")
    png_size(out)


def test_record_stage_time_merges_stages(tmp_path):
    from mt.evaluation.report import record_stage_time, stage_times

    record_stage_time(tmp_path / "run", "prepare", 1.25)
    record_stage_time(tmp_path / "run", "evaluate", 30.0)
    record_stage_time(tmp_path / "run", "prepare", 2.5)  # a rerun replaces its own entry
    times = stage_times(tmp_path / "run", [{"stage": "train", "seconds": 600.0}])
    assert times == {"train": 600.0, "prepare": 2.5, "evaluate": 30.0}


def test_wall_series_interpolates_records_without_wall():
    records = [
        {"step": 100, "loss": 3.0, "wall": 60.0},
        {"step": 200, "loss": 2.0, "wall": 180.0},
        {"step": 150, "valid_bleu": 12.0},  # an older run: no wall on validation records
        {"step": 200, "valid_bleu": 20.0, "wall": 186.0},  # its own wall (after validating)
        {"valid_bleu": 30.0},  # no step, no wall: left out
    ]
    minutes, bleu = wall_series(records, "valid_bleu")
    # step 150: halfway between 60 s (step 100) and 186 s (step 200, the last record wins)
    np.testing.assert_allclose(minutes, [123 / 60, 186 / 60])
    np.testing.assert_allclose(bleu, [12.0, 20.0])


def test_time_to_levels_and_levels():
    assert bleu_levels(33.9) == [5, 10, 15, 20, 25, 30, 31, 32, 33]
    assert bleu_levels(12.0) == [5, 10]
    minutes = np.array([1.0, 2.0, 3.0, 4.0])
    values = np.array([9.0, 21.0, 19.0, 31.0])  # not monotone: the first crossing counts
    got = time_to_levels(minutes, values, [10, 20, 30, 40])
    assert got == [(10, 2.0), (20, 2.0), (30, 4.0), (40, None)]


def test_training_summary_says_what_ended_the_run_and_where():
    from mt.evaluation.report import _training_summary

    base = [{"step": 1, "loss": 5.0, "wall": 1.0}, {"step": 2800, "loss": 2.0, "wall": 2520.0}]
    machine = {"device": "cpu", "cpu": "AMD EPYC", "native_bf16": False, "threads": 2}
    budget = {"max_steps": 4000, "max_minutes": 42, "max_epochs": 0, "patience": 4}
    end = {"stage": "train", "seconds": 2520.0, "step": 2800, "stop": "max_minutes",
           "budget": budget, "precision": "fp32", "machine": machine}  # fmt: skip
    text = "\n".join(_training_summary([*base, end]))
    assert "| ended by | the time cap (42 min) after 2,800 updates of 4,000 planned |" in text
    assert "| machine | AMD EPYC (no native bf16, 2 threads), fp32 |" in text
    text = "\n".join(_training_summary([*base, {**end, "stop": "max_steps"}]))
    assert "| ended by | the update budget (4,000 updates) |" in text
    text = "\n".join(_training_summary([*base, {**end, "stop": "patience"}]))
    assert "| ended by | patience (4 validations without improvement) |" in text
    assert "ended by" not in "\n".join(_training_summary(base))  # older runs: no such row


def test_updates_count_the_last_record_not_the_last_log():
    """A run stopped between two log records: its last validation's step is the update count,
    and the last logged loss says which step it is from."""
    from mt.evaluation.report import _training_summary

    records = [{"step": 50, "loss": 3.0}, {"step": 100, "loss": 2.5},
               {"step": 110, "valid_loss": 2.7, "valid_bleu": 12.0}]  # fmt: skip
    text = "\n".join(_training_summary(records))
    assert "| updates | 110 |" in text and "| last training loss | 2.5 (step 100) |" in text
