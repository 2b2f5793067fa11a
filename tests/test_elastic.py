"""Elastic restart under torchrun: a killed worker's group restarts, resumes from the last
checkpoint and trains on to the losses of an uninterrupted run (2 gloo ranks, tiny model)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_train import TINY, _cfg, _losses

ROOT = Path(__file__).resolve().parents[1]

# Rank 1 of the first round kills itself (SIGKILL, as the OOM killer would) once the first
# checkpoint is on disk; in the next round it comes up a few seconds after rank 0, as a worker on
# a slower or busier node does: the case where a restarted rank finds the last round's
# addresses in torchrun's store before its peers have replaced them.
ENTRY = r"""
import os, signal, sys, threading, time
from pathlib import Path

run_dir = Path(sys.argv[1]); del sys.argv[1]
restart = os.environ["TORCHELASTIC_RESTART_COUNT"]
if os.environ["LOCAL_RANK"] == "1":
    if restart == "0":
        def kill_after_first_checkpoint():
            while not (run_dir / "checkpoints" / "last.pt").exists():
                time.sleep(0.005)
            os.kill(os.getpid(), signal.SIGKILL)
        threading.Thread(target=kill_after_first_checkpoint, daemon=True).start()
    else:
        time.sleep(float(os.environ.get("LATE_SECONDS", "4")))
from mt.cli import train_main
train_main()
"""

COMMON = ["train.max_steps=16", "train.save_every=4", "model.dropout=0.0", "train.device=cpu"]


def _torchrun(tmp_path: Path, run: Path, restarts: int) -> subprocess.CompletedProcess:
    script = tmp_path / "entry.py"
    script.write_text(ENTRY if restarts else "from mt.cli import train_main\ntrain_main()\n")
    args = [str(run)] if restarts else []
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    launch = ["--standalone", "--nproc_per_node=2", f"--max-restarts={restarts}"]
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", *launch, str(script), *args, *TINY,
         *COMMON, f"run_dir={run}"],  # fmt: skip
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        timeout=400,
    )  # fmt: skip


@pytest.fixture(autouse=True)
def _data_env(real_data, monkeypatch):
    monkeypatch.setenv("MT_DATA_DIR", str(real_data))


def test_a_killed_worker_restarts_the_group_and_trains_on_to_the_same_losses(tmp_path):
    from mt.data.build import prepare

    whole, killed = tmp_path / "whole", tmp_path / "killed"
    prepare(_cfg(whole, *COMMON))  # under torchrun ranks only load prepared data
    ref = _torchrun(tmp_path, whole, restarts=0)
    assert ref.returncode == 0, ref.stdout[-4000:]
    out = _torchrun(tmp_path, killed, restarts=1)
    assert out.returncode == 0, out.stdout[-6000:]
    assert "exitcode: -9" in out.stdout  # the kill happened, and the agent saw it
    assert "resuming" in out.stdout and "from last.pt" in out.stdout, out.stdout[-4000:]
    expected, got = _losses(whole), _losses(killed)
    assert sorted(got) == list(range(1, 17)) == sorted(expected)
    assert got == pytest.approx(expected, rel=1e-6, abs=1e-7)
