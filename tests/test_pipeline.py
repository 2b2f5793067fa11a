"""End to end: the smoke experiment on real Multi30k data, through the command-line tools.

This is what `make smoke` runs (prepare -> train -> evaluate), in a temporary run directory,
checking every artifact the run directory contract promises.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def _cli(tool: str, *overrides: str, env: dict) -> subprocess.CompletedProcess:
    code = f"from mt.cli import {tool}_main as m; m()"
    proc = subprocess.run(
        [sys.executable, "-c", code, *overrides],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=600,
    )
    assert proc.returncode == 0, f"{tool} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc


@pytest.mark.slow
def test_smoke_pipeline_end_to_end(real_data, tmp_path):
    run_dir = tmp_path / "run"
    env = dict(os.environ, MT_DATA_DIR=str(real_data), MT_CACHE_DIR=str(tmp_path / "cache"))
    # the smoke experiment, 60 of its 200 updates (the loss falls by 2, BLEU > 0 at 60)
    args = ["experiment=smoke", f"run_dir={run_dir}", "train.max_steps=60", "train.eval_every=30"]
    _cli("prepare", *args, env=env)
    _cli("train", *args, env=env)
    out = _cli("evaluate", *args, env=env)

    # The last line printed is the run directory; BLEU and its signature come before it.
    lines = out.stdout.strip().splitlines()
    assert lines[-1].strip() == str(run_dir)
    assert "nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|version:" in out.stdout

    assert (run_dir / "config.yaml").is_file()
    for name in ("last.pt", "best.pt"):
        ckpt = torch.load(run_dir / "checkpoints" / name, weights_only=True)
        assert ckpt["step"] > 0 and "model_cfg" in ckpt

    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train_records = [r for r in records if "loss" in r]
    assert {"step", "loss", "nll", "lr", "tgt_tok_per_s"} <= set(train_records[0])
    steps = [r["step"] for r in train_records]
    assert steps == sorted(set(steps)), "each step is logged once"
    assert train_records[-1]["loss"] < train_records[0]["loss"] - 1.0, "the loss went down"
    assert any("valid_bleu" in r for r in records)

    hyps = (run_dir / "translations" / "test.txt").read_text(encoding="utf-8").split("\n")
    refs = (real_data / "multi30k" / "test_2016_flickr.en").read_text(encoding="utf-8")
    assert len(hyps) - 1 == len(refs.split("\n")) - 1 == 1000

    results = json.loads((run_dir / "results.json").read_text())
    assert isinstance(results["bleu"], float) and results["bleu"] > 0
    assert results["signature"].startswith("nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp")
    assert results["split"] == "test" and "chrf" in results and "checkpoint" in results
    report = (run_dir / "report.md").read_text(encoding="utf-8")
    assert "Wall time per stage" in report and "prepare" in report and "evaluate" in report
    timings = json.loads((run_dir / "timings.json").read_text())
    assert {"prepare", "evaluate"} <= set(timings)
