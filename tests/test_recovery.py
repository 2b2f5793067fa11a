"""Runs that survive their users: the run-directory lock, crash-safe files, resume fixes
(metrics appended, original config kept, stale temporaries removed, last.pt fallback, batch
plan, best.pt across resumes), empty validation, preemption status, progress lines.

In-process training on a tiny model over a small synthetic corpus (scripts/fault_inject.py's),
prepared once per test run."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from mt import files
from mt.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from mt.config import load_config
from mt.distributed import LauncherError, check_launcher
from mt.train.lock import LockError, RunLock
from mt.train.preempt import EXIT_INTERRUPTED, EXIT_PREEMPTED, exit_status
from mt.train.progress import LogProgress, progress
from mt.train.recipe import train

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
from fault_inject import make_corpus, overrides  # noqa: E402


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> tuple[Path, Path]:
    base = tmp_path_factory.mktemp("recovery")
    return make_corpus(base / "data"), base / "cache"


def cfg_for(corpus, run_dir: Path, max_steps: int, *extra: str):
    data, cache = corpus
    return load_config([*overrides(data, cache, run_dir, max_steps), *extra])


def steps_logged(run_dir: Path) -> list[int]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r["step"] for r in map(json.loads, lines) if "loss" in r]


# ---------------------------------------------------------------------------------- the lock


def test_a_held_lock_names_its_holder(tmp_path):
    with RunLock(tmp_path):
        with pytest.raises(LockError, match=rf"host \S+, pid {os.getpid()}"):
            RunLock(tmp_path).acquire()
    RunLock(tmp_path).acquire().release()  # free again once released


def test_a_lock_just_taken_names_its_holder_once_written(tmp_path, monkeypatch):
    """Between a run's flock and the write of its record the lock file is empty: a second run
    arriving then waits for the record instead of naming "host ?, pid ?" (seen in CI)."""
    import threading

    holder = RunLock(tmp_path)
    real_pwrite, locked, written = os.pwrite, threading.Event(), threading.Event()

    def slow_pwrite(fd, data, offset):  # the winner holds the flock, slow to write its record
        locked.set()
        written.wait(5)
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", slow_pwrite)
    winner = threading.Thread(target=holder.acquire)
    winner.start()
    assert locked.wait(5)
    threading.Timer(0.2, written.set).start()
    with pytest.raises(LockError, match=rf"host \S+, pid {os.getpid()}"):
        RunLock(tmp_path).acquire()
    winner.join()
    holder.release()


def test_a_lock_left_by_a_dead_process_is_taken_over(tmp_path, caplog):
    # A process that took the lock and was SIGKILLed: its record stays, the flock does not.
    code = "import sys, time; from mt.train.lock import RunLock; RunLock(sys.argv[1]).acquire(); " \
        "print('locked', flush=True); time.sleep(60)"  # fmt: skip
    proc = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], cwd=ROOT,
                            stdout=subprocess.PIPE, text=True)  # fmt: skip
    assert proc.stdout.readline().strip() == "locked"
    with pytest.raises(LockError, match=f"pid {proc.pid}"):
        RunLock(tmp_path).acquire()
    proc.kill()
    proc.wait()
    proc.stdout.close()
    with caplog.at_level(logging.INFO, logger="mt.train.lock"):
        lock = RunLock(tmp_path).acquire()
    assert f"pid {proc.pid}" in caplog.text and "taking over" in caplog.text
    assert lock.holder()["pid"] == os.getpid()
    lock.release()


def test_training_refuses_a_locked_run_dir(corpus, tmp_path):
    run = tmp_path / "run"
    with RunLock(run):
        with pytest.raises(LockError, match="in use by another run"):
            train(cfg_for(corpus, run, 2))
    assert not (run / "metrics.jsonl").exists()  # nothing written by the refused run


@pytest.mark.parametrize(
    "env",
    [
        {"SLURM_STEP_NUM_TASKS": "4", "SLURM_PROCID": "2"},
        {"OMPI_COMM_WORLD_SIZE": "2"},
        {"PMI_SIZE": "8"},
    ],
)
def test_several_tasks_without_torchrun_are_refused(env):
    with pytest.raises(LauncherError, match="torchrun"):
        check_launcher(env)
    check_launcher({**env, "RANK": "0", "WORLD_SIZE": "4"})  # under torchrun: fine
    check_launcher({"SLURM_NTASKS": "4", "SLURM_PROCID": "0"})  # the batch script itself


# ------------------------------------------------------------------------------ crash-safe files


def test_atomic_write_keeps_the_old_file_on_failure(tmp_path):
    path = tmp_path / "a.json"
    files.write_json(path, {"v": 1})

    def broken(f):
        f.write(b"half")
        raise RuntimeError("killed")

    with pytest.raises(RuntimeError):
        files.atomic_path(path, broken)
    assert json.loads(path.read_text()) == {"v": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["a.json"]


def test_jsonl_cuts_a_torn_line_and_the_resumed_steps_without_rewriting(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text('{"step": 1}\n{"step": 2}\n{"stage": "x"}\n{"step": 3}\n{"step": 4, "lo')
    inode = path.stat().st_ino
    log = files.JsonlAppender(path)  # a torn last line only
    log.write({"step": 5})
    log.close()
    assert path.read_text().splitlines()[-2:] == ['{"step": 3}', '{"step": 5}']
    log = files.JsonlAppender(path, keep_through_step=2)  # resume from step 2
    log.close()
    assert path.read_text() == '{"step": 1}\n{"step": 2}\n{"stage": "x"}\n'
    assert path.stat().st_ino == inode  # truncated in place, never replaced


def test_read_lines_splits_on_newline_only_and_names_bad_lines():
    import io

    text = b"a\rb\nc\r\n\nd"
    assert list(files.read_lines(io.BytesIO(text), "f")) == ["a\rb", "c", "", "d"]
    with pytest.raises(files.TextError, match=r"f, line 2: not valid UTF-8"):
        list(files.read_lines(io.BytesIO(b"ok\nbad \xff\n"), "f"))
    with pytest.raises(files.TextError, match=r"f, line 3: holds a NUL byte \(column 2\)"):
        list(files.read_lines(io.BytesIO(b"1\n2\nx\x00y\n"), "f"))


def test_write_lines_keeps_one_line_per_item(tmp_path):
    files.write_lines(tmp_path / "t.txt", ["a\nb", "c\rd", "e\r\nf", ""])
    assert (tmp_path / "t.txt").read_bytes() == b"a b\nc d\ne f\n\n"


def test_disk_full_is_recognised_through_torch_wrapping():
    import errno

    wrapped = RuntimeError("[enforce fail at inline_container.cc:672] unexpected pos")
    wrapped.__context__ = OSError(errno.EFBIG, "File too large")  # what torch.save raises
    assert files.disk_full(wrapped)
    assert files.disk_full(OSError(errno.ENOSPC, "No space left on device"))
    assert not files.disk_full(RuntimeError("other"))
    assert not files.disk_full(OSError(errno.ENOENT, "missing"))


# ------------------------------------------------------------------------------- resume fixes


def test_resume_keeps_config_records_changes_and_removes_stale_temps(corpus, tmp_path, caplog):
    run = tmp_path / "run"
    first = cfg_for(corpus, run, 3)
    train(first)
    original = (run / "config.yaml").read_text()
    stale = run / "checkpoints" / ".last.pt.tmp999999"
    stale.write_bytes(b"x" * 1000)
    with caplog.at_level(logging.WARNING):
        train(cfg_for(corpus, run, 5, "model.dropout=0.2"))
    assert not stale.exists() and "left by a killed save" in caplog.text
    assert not (run / "preempted.json").exists()
    assert (run / "config.yaml").read_text() == original
    changed = (run / "config.resume-1.yaml").read_text()
    assert "max_steps: 5" in changed and "dropout: 0.2" in changed
    assert (
        "train.max_steps: 3 -> 5" in caplog.text
        and f"model.dropout: {first.model.dropout} -> 0.2" in caplog.text
    )
    assert steps_logged(run) == [1, 2, 3, 4, 5]


def test_unreadable_last_pt_falls_back_to_the_newest_readable_checkpoint(corpus, tmp_path, caplog):
    run, ref = tmp_path / "run", tmp_path / "ref"
    train(cfg_for(corpus, run, 4))
    last = run / "checkpoints" / "last.pt"
    last.unlink()  # a hard link to checkpoint_4.pt: break it without touching that file
    last.write_bytes(b"garbage" * 100)
    data = bytearray((run / "checkpoints" / "checkpoint_4.pt").read_bytes())
    data[len(data) // 2] ^= 0xFF  # and damage the newest periodic one too
    (run / "checkpoints" / "checkpoint_4.pt").write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING):
        train(cfg_for(corpus, run, 6))
    assert "last.pt: resuming from checkpoint_3.pt (step 3) instead" in caplog.text
    train(cfg_for(corpus, ref, 6))
    a = load_checkpoint(run / "checkpoints" / "last.pt")["model"]
    b = load_checkpoint(ref / "checkpoints" / "last.pt")["model"]
    for k in a:  # resumed from step 3: the same weights as never interrupted
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-6)


def test_no_readable_checkpoint_is_an_error_naming_them(corpus, tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints" / "last.pt").write_bytes(b"junk")
    with pytest.raises(CheckpointError, match="no checkpoint .* can resume.*last.pt"):
        train(cfg_for(corpus, run, 2))


def test_corrupted_byte_in_a_checkpoint_is_an_error_not_a_wrong_weight(tmp_path):
    path = tmp_path / "c.pt"
    save_checkpoint(path, {"w": torch.randn(10_000)})
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01  # inside the tensor's bytes: torch.load alone would accept it
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="corrupted.*checksum"):
        load_checkpoint(path)


def test_other_world_size_mid_epoch_is_refused_at_an_epoch_boundary_accepted(corpus, tmp_path):
    run = tmp_path / "run"
    train(cfg_for(corpus, run, 2))
    with pytest.raises(CheckpointError, match=r"train.max_tokens: 300 in the checkpoint, 200 now"):
        train(cfg_for(corpus, run, 4, "train.max_tokens=200"))
    ckpt = load_checkpoint(run / "checkpoints" / "last.pt", require_training=True)
    ckpt["data"]["plan"]["world_size"] = 2  # as if written by 2 ranks
    save_checkpoint(run / "checkpoints" / "last.pt", ckpt)
    with pytest.raises(CheckpointError, match="number of ranks.*: 2 in the checkpoint, 1 now"):
        train(cfg_for(corpus, run, 4))
    # At an epoch boundary the new plan starts a new epoch: nothing skipped or repeated.
    ckpt["data"]["batch"] = 0
    ckpt["state"]["batch"] = 0
    save_checkpoint(run / "checkpoints" / "last.pt", ckpt)
    assert train(cfg_for(corpus, run, 4, "train.max_tokens=200"))["step"] == 4


def test_best_pt_is_only_replaced_by_a_better_model_across_resumes(corpus, tmp_path):
    args = ("train.eval_every=2", "train.best_metric=loss")
    for name in ("control", "run"):
        train(cfg_for(corpus, tmp_path / name, 2, *args))
    best_path = tmp_path / "run" / "checkpoints" / "best.pt"
    best = load_checkpoint(best_path)
    assert best["best_metric"] == "valid_loss" and best["step"] == 2
    # As if a better model had been saved as best.pt after last.pt's step (then a crash):
    # the resumed state's best value is older and must not let worse models replace it.
    best["best"] = 0.5
    save_checkpoint(best_path, best)
    result = train(cfg_for(corpus, tmp_path / "run", 6, *args))
    assert load_checkpoint(best_path)["step"] == 2 and result["best"] == 0.5
    # Without that better best.pt, the later validations (lower loss) do replace it.
    train(cfg_for(corpus, tmp_path / "control", 6, *args))
    assert load_checkpoint(tmp_path / "control" / "checkpoints" / "best.pt")["step"] == 6


def test_empty_validation_is_an_error_not_a_best_loss_of_zero(corpus, tmp_path):
    import numpy as np

    from mt.data.store import EncodedSplit, TokenArray
    from mt.train.validation import valid_loss

    cfg = cfg_for(corpus, tmp_path / "r", 1)
    empty = TokenArray(np.zeros(0, np.uint16), np.zeros(1, np.int64))
    with pytest.raises(ValueError, match="validation split has no target tokens"):
        valid_loss(torch.nn.Identity(), EncodedSplit(empty, empty), cfg, torch.device("cpu"))


# ------------------------------------------------------------------------------ preemption


def test_exit_status_tells_preemption_from_failure():
    assert exit_status(None) == 0
    assert exit_status(signal.SIGTERM) == exit_status(signal.SIGUSR1) == EXIT_PREEMPTED == 75
    assert exit_status(signal.SIGINT) == EXIT_INTERRUPTED == 130


@pytest.mark.slow
def test_sigusr1_saves_and_exits_75(corpus, tmp_path):
    data, cache = corpus
    run = tmp_path / "run"
    cfg = load_config(overrides(data, cache, run, 100_000))
    from mt.data.build import prepare

    prepare(cfg)  # the child only loads
    proc = subprocess.Popen(
        [sys.executable, "-m", "mt", "train", *overrides(data, cache, run, 100_000)],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    end = time.monotonic() + 120
    while not (run / "checkpoints" / "checkpoint_2.pt").exists():
        assert proc.poll() is None and time.monotonic() < end, proc.communicate()[0]
        time.sleep(0.01)
    proc.send_signal(signal.SIGUSR1)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == EXIT_PREEMPTED, out
    assert "SIGUSR1 received" in out and "Traceback" not in out
    assert load_checkpoint(run / "checkpoints" / "last.pt")["step"] == max(steps_logged(run))
    marker = json.loads((run / "preempted.json").read_text())
    assert marker == {"step": max(steps_logged(run)), "signal": "SIGUSR1"}
    # Not a terminal: progress comes as plain log lines, never carriage-return redraws.
    assert "\r" not in out and "train: " in out


def test_progress_is_log_lines_off_a_terminal(caplog):
    import io

    assert isinstance(progress("x", stream=io.StringIO()), LogProgress)
    bar = LogProgress("train", total=10, interval=0.0)
    with caplog.at_level(logging.INFO, logger="mt.train.progress"):
        bar.set_postfix_str("loss 1.0")
        bar.update(3)
        bar.close()
    assert "train: 3/10 | loss 1.0" in caplog.text
