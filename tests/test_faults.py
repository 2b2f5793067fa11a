"""Fault injection: SIGKILL at random moments (scripts/fault_inject.py), a full disk during a
save, two runs started at once on one run directory, a damaged byte in each kind of file read.

Tiny model, small synthetic corpus; every test is bounded in time."""

from __future__ import annotations

import json
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mt.checkpoint import load_checkpoint
from mt.config import load_config
from mt.train.preempt import EXIT_PREEMPTED
from mt.train.recipe import train

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
from fault_inject import make_corpus, overrides  # noqa: E402


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> tuple[Path, Path]:
    base = tmp_path_factory.mktemp("faults")
    data, cache = make_corpus(base / "data"), base / "cache"
    from mt.data.build import prepare

    prepare(load_config(overrides(data, cache, base / "unused", 1)))  # children only load
    return data, cache


def train_cmd(corpus, run_dir: Path, max_steps: int, *extra: str) -> list[str]:
    data, cache = corpus
    return [
        sys.executable,
        "-m",
        "mt",
        "train",
        *overrides(data, cache, run_dir, max_steps),
        *extra,
    ]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_sigkill_at_random_moments_resumes_exactly():
    """≥ 20 SIGKILLs (a third of them the moment a checkpoint write begins); every restart
    resumes, and the final weights and logged losses equal an uninterrupted run's."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "fault_inject.py"), "--kills", "20", "--json"],
        cwd=ROOT, capture_output=True, text=True, timeout=230,
    )  # fmt: skip
    assert proc.returncode in (0, 1), proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    print(
        f"fault injection: {result['kills']} SIGKILLs, {result['kills_inside_checkpoint_writes']} "
        f"inside a checkpoint write, final step {result['final_step']}, max |weight diff| "
        f"{result['max_weight_diff']:.3g}"
    )
    assert result["kills"] >= 20
    assert result["final_step"] == result["reference_step"]
    assert result["max_weight_diff"] <= 1e-6 and result["max_loss_diff"] <= 1e-6
    assert result["steps_logged_once"] and not result["temporary_files_left"]
    assert result["ok"]


def _limit_file_size(limit: int):
    def preexec() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return preexec


@pytest.mark.slow
def test_full_disk_during_a_save_keeps_the_previous_checkpoint(corpus, tmp_path):
    run = tmp_path / "run"
    train(load_config(overrides(*corpus, run, 3)))
    last = run / "checkpoints" / "last.pt"
    before = last.read_bytes()
    # The resumed run may write its logs but no checkpoint: files stop at half a checkpoint.
    proc = subprocess.run(
        train_cmd(corpus, run, 6), cwd=ROOT, capture_output=True, text=True, timeout=120,
        preexec_fn=_limit_file_size(len(before) // 2),
    )  # fmt: skip
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and "disk full" in errors[0] and "previous" in errors[0], errors
    print(errors[0])
    assert last.read_bytes() == before
    assert load_checkpoint(last, require_training=True)["step"] == 3
    assert not [p for p in (run / "checkpoints").iterdir() if ".tmp" in p.name]


@pytest.mark.slow
def test_two_runs_started_at_once_on_one_run_dir(corpus, tmp_path):
    """Exactly one trains; the other stops at once naming the holder's host and pid."""
    run = tmp_path / "run"
    procs = [
        subprocess.Popen(train_cmd(corpus, run, 100_000, "train.save_every=5"), cwd=ROOT,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for _ in range(2)
    ]  # fmt: skip
    end = time.monotonic() + 120
    while all(p.poll() is None for p in procs):
        assert time.monotonic() < end, "neither run stopped"
        time.sleep(0.05)
    loser = next(p for p in procs if p.poll() is not None)
    winner = next(p for p in procs if p is not loser)
    out = loser.communicate()[0]
    assert loser.returncode == 1, out
    print(out.strip().splitlines()[-1])
    assert "in use by another run: host" in out and f"pid {winner.pid}" in out, out
    assert "Traceback" not in out
    while not (run / "checkpoints" / "checkpoint_5.pt").exists():
        assert winner.poll() is None and time.monotonic() < end, winner.communicate()[0]
        time.sleep(0.05)
    winner.send_signal(signal.SIGTERM)
    out = winner.communicate(timeout=120)[0]
    assert winner.returncode == EXIT_PREEMPTED, out
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in records if "loss" in r]
    assert steps == list(range(1, len(steps) + 1))  # one writer: each step once, in order


def _flip(path: Path, where: float = 0.5) -> None:
    data = bytearray(path.read_bytes())
    data[int(len(data) * where)] ^= 0x5A
    path.write_bytes(bytes(data))


def test_damaged_prepared_data_is_detected_and_rebuilt(corpus, tmp_path, caplog):
    import logging
    import shutil

    from mt.data.build import prepare

    cfg = load_config(overrides(corpus[0], tmp_path / "cache", tmp_path / "run", 1))
    good = prepare(cfg)
    expected = [good.split("train").src[i].tolist() for i in range(20)]
    for name in ("train.src.ids", "spm.model", "valid.raw.tgt"):
        _flip(good.dir / name)
        with caplog.at_level(logging.WARNING, logger="mt.data.build"):
            again = prepare(cfg)
        assert f"{good.dir / name} is damaged" in caplog.text and "rebuilding" in caplog.text
        assert [again.split("train").src[i].tolist() for i in range(20)] == expected
        caplog.clear()
    shutil.rmtree(tmp_path / "cache")


def test_a_cache_hit_reads_no_prepared_file_unless_asked_or_changed(tmp_path, monkeypatch):
    """At start a cache hit checks sizes, times and the meta's digest; it reads (CRC) a file only
    when its time changed, or every file with data.verify=full."""
    import json
    import os

    from mt import files
    from mt.data.build import prepare
    from mt.data.store import CacheError, Prepared

    data = make_corpus(tmp_path / "data")
    cfg = load_config(overrides(data, tmp_path / "cache", tmp_path / "run", 1))
    good = prepare(cfg)
    read = []
    crc = files.file_crc
    monkeypatch.setattr(files, "file_crc", lambda p: read.append(p.name) or crc(p))
    assert prepare(cfg).dir == good.dir and read == []  # stat only
    full = load_config(
        [*overrides(data, tmp_path / "cache", tmp_path / "run", 1), "data.verify=full"]
    )
    assert prepare(full).dir == good.dir  # the same cache: data.verify is not in the key
    assert sorted(read) == sorted(json.loads((good.dir / "meta.json").read_text())["files"])
    read.clear()
    ids = good.dir / "train.src.ids"
    os.utime(ids, ns=(ids.stat().st_atime_ns, ids.stat().st_mtime_ns + 1))  # a copy's new time
    Prepared(good.dir)
    assert read == ["train.src.ids"]
    recorded = json.loads((good.dir / "meta.json").read_text())["files"][ids.name][2]
    _flip(ids)  # damage that keeps size and the recorded time: only a full check can see it
    os.utime(ids, ns=(recorded, recorded))
    Prepared(good.dir)
    with pytest.raises(CacheError, match="train.src.ids is damaged"):
        Prepared(good.dir, verify="full")
    _flip(ids)  # back as it was
    meta = good.dir / "meta.json"
    text = meta.read_text()
    meta.write_text(text.replace('"vocab_size": 120', '"vocab_size": 121'))
    with pytest.raises(CacheError, match="meta.json is damaged"):
        Prepared(good.dir)
    meta.write_text(text)
    with pytest.raises(ValueError, match="data.verify='some'"):
        Prepared(good.dir, verify="some")


def test_damaged_sentencepiece_model_is_an_error_naming_the_file(tmp_path):
    from mt.data.tokenizer import Tokenizer, TokenizerError

    bad = tmp_path / "spm.model"
    bad.write_bytes(b"\x0a\xff\xff\xff garbage")
    with pytest.raises(TokenizerError, match=rf"{bad} is not a readable SentencePiece model"):
        Tokenizer.load([bad])


def test_damaged_checkpoint_and_config_through_the_command_line(corpus, tmp_path):
    """mt-translate with a damaged checkpoint and mt-train with a damaged YAML file of the
    config tree: one line naming the file, no traceback."""
    run = tmp_path / "run"
    train(load_config(overrides(*corpus, run, 2)))
    ckpt = run / "checkpoints" / "last.pt"
    _flip(ckpt)
    proc = subprocess.run(
        [sys.executable, "-m", "mt", "translate", f"checkpoint={ckpt}", "train.device=cpu"],
        cwd=ROOT, input="ein hund\n", capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert f"mt-translate: {ckpt}" in proc.stderr and "corrupted" in proc.stderr
    conf = tmp_path / "conf" / "experiment"
    conf.mkdir(parents=True)
    (conf / "mine.yaml").write_bytes(b"# @package _global_\ntrain: {max_steps: 3\n")
    proc = subprocess.run(
        [sys.executable, "-m", "mt", "train", f"--config-dir={tmp_path / 'conf'}",
         "experiment=mine", f"run_dir={run}"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert f"{conf / 'mine.yaml'}, line 3" in proc.stderr and "not valid YAML" in proc.stderr
