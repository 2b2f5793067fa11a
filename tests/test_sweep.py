"""scripts/sweep.py: the table that records a sweep, for training and for decoding trials."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(*args) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "sweep.py"), *map(str, args)],
        capture_output=True,
        text=True,
        check=False,
    )


def _train_trial(path: Path, lr: float, bleus: list[float]) -> None:
    path.mkdir(parents=True)
    (path / "config.yaml").write_text(f"train:\n  lr: {lr}\n  seed: 1\n")
    records = [{"step": 10, "loss": 5.0, "tgt_tok_per_s": 100.0 + lr}]
    records += [{"step": 10 * (i + 1), "valid_loss": 4.0 - i, "valid_bleu": b}
                for i, b in enumerate(bleus)]  # fmt: skip
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def _decode_trial(path: Path, beam: int, bleu: float, split: str = "valid") -> None:
    path.mkdir(parents=True)
    result = {"split": split, "bleu": bleu, "beam_size": beam, "alpha": 0.6, "step": 99,
              "sent_per_s": 50.0, "checkpoint": "best.pt"}  # fmt: skip
    (path / "results.json").write_text(json.dumps(result))


def test_training_trials_ranked_by_best_valid_bleu(tmp_path):
    _train_trial(tmp_path / "0", 1e-3, [3.0, 5.0])
    _train_trial(tmp_path / "1", 2e-3, [4.0, 9.5])
    out = _run(tmp_path, "--output", tmp_path / "t.md")
    assert out.returncode == 0, out.stderr
    rows = [line for line in out.stdout.splitlines() if line.startswith("| ")]
    assert rows[0].startswith("| run | train.lr |")  # only the varied setting is shown
    assert rows[1].startswith("| 1 | 0.002 | 9.50 | 3.000 | 20 |")
    assert rows[2].startswith("| 0 | 0.001 | 5.00 |")
    assert (tmp_path / "t.md").read_text().strip() == out.stdout.strip()


def test_decoding_trials_use_valid_results_only(tmp_path):
    _decode_trial(tmp_path / "0", 1, 30.0)
    _decode_trial(tmp_path / "1", 4, 31.5)
    _decode_trial(tmp_path / "2", 8, 99.0, split="test")  # never used to choose
    out = _run(tmp_path)
    assert out.returncode == 0, out.stderr
    rows = [line for line in out.stdout.splitlines() if line.startswith("| ")]
    assert len(rows) == 3 and "99.00" not in out.stdout
    assert rows[0] == "| run | decode.beam_size | valid BLEU | step | sent/s |"
    assert rows[1] == "| 1 | 4 | 31.50 | 99 | 50.0 |"


def test_empty_sweep_is_an_error(tmp_path):
    out = _run(tmp_path)
    assert out.returncode == 1 and "no trials" in out.stderr
