"""scripts/sweep.py: the table that records a sweep, for training and for decoding trials."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

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


def _make_commands(target: str, args: str) -> list[list[str]]:
    """The mt commands that ``make TARGET ARGS=...`` runs (``make -n``, this interpreter)."""
    out = subprocess.run(
        ["make", "-n", "--no-print-directory", "VENV=", f"PYTHON={sys.executable}", target,
         f"ARGS={args}"], cwd=ROOT, capture_output=True, text=True, check=True,
    )  # fmt: skip
    return [shlex.split(line) for line in out.stdout.splitlines()
            if line.startswith(f"{sys.executable} -m mt ")]  # fmt: skip


@pytest.mark.parametrize("target", ["train", "smoke"])
def test_make_train_with_a_multirun_trains_and_evaluates_each_trial(target):
    """`make train ARGS="-m ..."` is one mt-train multirun that evaluates each trial as it ends
    (not a second `mt-evaluate -m`, which would look in a sweep directory of its own); without
    -m it is prepare -> train -> evaluate."""
    mt = [sys.executable, "-m", "mt"]
    smoke = ["experiment=smoke"] if target == "smoke" else []
    for flag in ("-m", "--multirun"):
        commands = _make_commands(target, f"{flag} model.dropout=0.0,0.2")
        assert commands == [[*mt, "train", flag, *smoke, "model.dropout=0.0,0.2",
                             "train.evaluate=true"]]  # fmt: skip
    commands = _make_commands(target, "model.dropout=0.2")
    assert [c[3] for c in commands] == ["prepare", "train", "evaluate"]
    assert all(c[4:] == [*smoke, "model.dropout=0.2"] for c in commands)


@pytest.fixture(scope="module")
def smoke_cache(tmp_path_factory) -> Path:
    """One prepared-data cache for this file's sweeps (the same experiment): the first sweep
    prepares the data, the second finds it, as the trials of one sweep do."""
    return tmp_path_factory.mktemp("cache")


@pytest.mark.slow
def test_a_two_trial_multirun_trains_two_runs_and_summarises_them(real_data, tmp_path,
                                                                   smoke_cache):  # fmt: skip
    """`make train ARGS="-m ..."` (its command) with no run_dir of its own per trial: each
    trial trains in its own run directory under the sweep directory (none resumes another) and
    is evaluated there, and the sweep ends with a summary table (their test scores too) and
    plot naming both."""
    env = dict(os.environ, MT_DATA_DIR=str(real_data), MT_CACHE_DIR=str(smoke_cache))
    (command,) = _make_commands(
        "smoke", f"-m train.max_steps=3 train.eval_every=3 train.eval_max_sentences=10 "
        f"decode.max_len_b=5 model.dropout=0.0,0.2 run_dir={tmp_path / 'runs'}",
    )  # fmt: skip
    proc = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env=env,
                          timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "resuming" not in proc.stderr
    (sweep,) = (tmp_path / "runs").glob("sweep-*")
    for job, dropout in (("0", 0.0), ("1", 0.2)):
        config = yaml.safe_load((sweep / job / "config.yaml").read_text())
        assert config["run_dir"] == str(sweep / job) and config["model"]["dropout"] == dropout
        steps = [json.loads(x).get("step") for x in (sweep / job / "metrics.jsonl").open()]
        assert max(s for s in steps if s is not None) == 3  # each trial trained its own 3
    summary = (sweep / "summary.md").read_text()
    rows = [line for line in summary.splitlines() if line.startswith("| ")]
    assert rows[0].startswith("| run | model.dropout |") and rows[0].endswith("| best |")
    assert len(rows) == 3 and sum("**best**" in r for r in rows) == 1
    assert (sweep / "summary.png").read_bytes()[:4] == b"\x89PNG"
    head = [c.strip() for c in rows[0].strip("|").split("|")]
    for row in rows[2:] + rows[1:2]:
        cells = dict(zip(head, (c.strip() for c in row.strip("|").split("|"))))
        result = json.loads((sweep / cells["run"] / "results.test.json").read_text())
        assert result["split"] == "test" and result["checkpoint"].endswith("best.pt")
        assert cells["test BLEU"] == f"{result['scores']['bleu']['score']:.2f}"
        assert cells["test chrF"] == f"{result['scores']['chrf']['score']:.2f}"


@pytest.mark.slow
def test_optuna_sweeper_optimises_the_best_valid_metric(real_data, tmp_path, smoke_cache):
    """hydra/sweeper=optuna: mt-train returns its best valid BLEU as the objective; the trials
    get their own run directories and the sweep its summary, as with the basic sweeper."""
    pytest.importorskip("hydra_plugins.hydra_optuna_sweeper")
    env = dict(os.environ, MT_DATA_DIR=str(real_data), MT_CACHE_DIR=str(smoke_cache))
    proc = subprocess.run(
        [sys.executable, "-m", "mt", "train", "-m", "hydra/sweeper=optuna",
         "hydra.sweeper.n_trials=2", "hydra.sweeper.direction=maximize",
         "model.dropout=interval(0.0,0.3)", "experiment=smoke", "train.max_steps=2",
         "train.eval_every=2", "train.eval_max_sentences=10", "decode.max_len_b=5",
         f"run_dir={tmp_path / 'runs'}"],
        capture_output=True, text=True, cwd=ROOT, env=env, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (sweep,) = (tmp_path / "runs").glob("sweep-*")
    result = yaml.safe_load((sweep / "optimization_results.yaml").read_text())
    assert 0.0 <= result["best_params"]["model.dropout"] <= 0.3
    assert isinstance(result["best_value"], float)
    rows = [r for r in (sweep / "summary.md").read_text().splitlines() if r.startswith("| ")]
    assert len(rows) == 3 and (sweep / "0" / "config.yaml").is_file()  # header, 2 trials
