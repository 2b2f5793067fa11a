"""Checkpoints: atomic writes, weights_only loading, clear errors, rotation, averaging, RNG."""

from __future__ import annotations

import gc
import random
import subprocess
import sys
import textwrap
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pytest
import torch

from mt.checkpoint import (
    CheckpointError,
    average_checkpoints,
    load_checkpoint,
    model_cfg_from,
    periodic_checkpoints,
    rotate_checkpoints,
    save_checkpoint,
)
from mt.schema import ModelConfig
from mt.train.state import rng_state, set_rng_state
from mt.vocab import SPECIALS

ROOT = Path(__file__).resolve().parents[1]


def _state(value: float, step: int = 1, **extra) -> dict:
    return {
        "model": {
            "w": torch.full((3, 2), value),
            "b": torch.full((2,), -value),
            "count": torch.tensor(step),
        },
        "model_cfg": asdict(ModelConfig(d_model=8)),
        "vocab_size": 16,
        "specials": dict(SPECIALS),
        "tokenizer": {"joint": True, "models": [torch.arange(5, dtype=torch.uint8)]},
        "step": step,
        "epoch": 0,
        **extra,
    }


def test_roundtrip_weights_only_with_training_state(tmp_path):
    random.random()
    state = _state(
        1.5,
        rng=rng_state(),
        optimizer={"state": {}, "param_groups": []},
        scheduler={"last_epoch": 3},
        data={"epoch": 1, "batch": 7},
    )
    save_checkpoint(tmp_path / "c.pt", state)
    # the file itself must load with the safe unpickler
    raw = torch.load(tmp_path / "c.pt", weights_only=True)
    assert raw["data"] == {"epoch": 1, "batch": 7}
    ckpt = load_checkpoint(tmp_path / "c.pt", require_training=True)
    torch.testing.assert_close(ckpt["model"]["w"], state["model"]["w"])
    assert model_cfg_from(ckpt) == ModelConfig(d_model=8)
    assert not list(tmp_path.glob(".*tmp*"))


def test_rng_state_restores_every_generator():
    state = rng_state()
    a = (random.random(), float(np.random.rand()), float(torch.rand(1)))
    random.random(), np.random.rand(), torch.rand(1)
    set_rng_state(state)
    b = (random.random(), float(np.random.rand()), float(torch.rand(1)))
    assert a == b


def test_crash_mid_save_keeps_previous(tmp_path, monkeypatch):
    path = tmp_path / "last.pt"
    save_checkpoint(path, _state(1.0))

    def broken_save(obj, f):
        f.write(b"PK\x03\x04 half a zip")
        raise KeyboardInterrupt  # e.g. Ctrl-C in the middle of the write

    monkeypatch.setattr(torch, "save", broken_save)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(path, _state(2.0))
    assert float(load_checkpoint(path)["model"]["w"][0, 0]) == 1.0
    assert [p.name for p in tmp_path.iterdir()] == ["last.pt"]


def test_process_killed_mid_save_keeps_previous(tmp_path):
    """A process that dies (os._exit) in the middle of writing leaves the old file intact."""
    path = tmp_path / "last.pt"
    save_checkpoint(path, _state(1.0))
    code = textwrap.dedent(f"""
        import os, torch
        from mt.checkpoint import save_checkpoint
        real = torch.save
        def dying_save(obj, f):
            real(obj, f)
            f.flush()
            f.truncate(100)
            os._exit(9)
        torch.save = dying_save
        save_checkpoint({str(path)!r}, {{"model": {{"w": torch.zeros(1000)}}}})
    """)
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True)
    assert r.returncode == 9
    assert float(load_checkpoint(path)["model"]["w"][0, 0]) == 1.0


def test_clear_errors(tmp_path):
    with pytest.raises(CheckpointError, match="no checkpoint"):
        load_checkpoint(tmp_path / "missing.pt")
    (tmp_path / "text.pt").write_text("hello, I am not a checkpoint\n")
    with pytest.raises(CheckpointError, match="not a readable"):
        load_checkpoint(tmp_path / "text.pt")
    save_checkpoint(tmp_path / "full.pt", _state(1.0))
    data = (tmp_path / "full.pt").read_bytes()
    (tmp_path / "trunc.pt").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="not a readable"):
        load_checkpoint(tmp_path / "trunc.pt")
    torch.save([1, 2, 3], tmp_path / "list.pt")
    with pytest.raises(CheckpointError, match="not a checkpoint dict"):
        load_checkpoint(tmp_path / "list.pt")
    bad = _state(1.0)
    del bad["tokenizer"]
    save_checkpoint(tmp_path / "nokeys.pt", bad)
    with pytest.raises(CheckpointError, match="missing checkpoint keys.*tokenizer"):
        load_checkpoint(tmp_path / "nokeys.pt")
    with pytest.raises(CheckpointError, match="missing checkpoint keys"):
        load_checkpoint(tmp_path / "full.pt", require_training=True)
    bad = _state(1.0)
    bad["specials"] = {"pad": 1, "unk": 0, "bos": 2, "eos": 3}
    save_checkpoint(tmp_path / "specials.pt", bad)
    with pytest.raises(CheckpointError, match="special ids"):
        load_checkpoint(tmp_path / "specials.pt")


def test_pickled_objects_are_refused(tmp_path):
    torch.save({**_state(1.0), "obj": Path("a pickled object")}, tmp_path / "pickled.pt")
    with pytest.raises(CheckpointError):
        load_checkpoint(tmp_path / "pickled.pt")


def test_rotation_keeps_newest(tmp_path):
    for step in (5, 10, 100, 20, 15):
        save_checkpoint(tmp_path / f"checkpoint_{step}.pt", _state(1.0, step))
    (tmp_path / "last.pt").write_bytes(b"")
    deleted = rotate_checkpoints(tmp_path, keep_last=2)
    assert sorted(p.name for p in deleted) == [
        "checkpoint_10.pt",
        "checkpoint_15.pt",
        "checkpoint_5.pt",
    ]
    assert [p.name for p in periodic_checkpoints(tmp_path)] == [
        "checkpoint_20.pt",
        "checkpoint_100.pt",
    ]
    assert (tmp_path / "last.pt").exists()
    assert rotate_checkpoints(tmp_path, keep_last=0) == []


def test_average_is_elementwise_mean(tmp_path):
    values = [1.0, 2.0, 6.0]
    paths = []
    for i, v in enumerate(values):
        paths.append(tmp_path / f"checkpoint_{i + 1}.pt")
        save_checkpoint(paths[-1], _state(v, step=i + 1, optimizer={"x": 1}))
    avg = average_checkpoints(paths)
    torch.testing.assert_close(avg["model"]["w"], torch.full((3, 2), sum(values) / 3))
    torch.testing.assert_close(avg["model"]["b"], torch.full((2,), -sum(values) / 3))
    assert int(avg["model"]["count"]) == 3 and avg["step"] == 3
    assert "optimizer" not in avg and len(avg["averaged"]) == 3


def test_average_maps_its_inputs_and_keeps_nothing_of_them(tmp_path):
    """The checkpoints are mapped, not read (load_checkpoint(mmap=True) gives what a read
    gives); the average owns its tensors, so it outlives its input files."""
    paths = [tmp_path / f"checkpoint_{i}.pt" for i in (1, 2)]
    for p, v in zip(paths, (1.0, 3.0)):
        save_checkpoint(p, _state(v, optimizer={"x": torch.ones(5)}))
    mapped, read = load_checkpoint(paths[0], mmap=True), load_checkpoint(paths[0])
    for k, v in read["model"].items():
        assert torch.equal(mapped["model"][k], v)
    del mapped
    avg = average_checkpoints(paths)
    if Path("/proc/self/maps").is_file():  # Linux: no file stays mapped (its pages resident)
        gc.collect()
        maps = Path("/proc/self/maps").read_text()
        assert not [p for p in paths if str(p) in maps]
    for p in paths:
        p.unlink()
    save_checkpoint(tmp_path / "averaged.pt", avg)
    again = load_checkpoint(tmp_path / "averaged.pt")
    torch.testing.assert_close(again["model"]["w"], torch.full((3, 2), 2.0))
    assert int(again["model"]["count"]) == int(read["model"]["count"])


def test_average_into_a_model_sums_in_its_own_tensors(tmp_path):
    """``into``: the mean lands in the given tensors (no second copy of the weights), equal to
    the float64 mean to float32 rounding; integers are the last checkpoint's; a model of
    another shape is refused by name."""
    g = torch.Generator().manual_seed(0)
    paths = []
    for i in range(5):
        state = _state(0.0, step=i + 1)
        state["model"]["w"] = torch.randn(3, 2, generator=g) * 10 ** (i - 2)
        paths.append(tmp_path / f"checkpoint_{i + 1}.pt")
        save_checkpoint(paths[-1], state)
    into = {"w": torch.zeros(3, 2), "b": torch.ones(2), "count": torch.tensor(0)}
    held = {k: v.data_ptr() for k, v in into.items()}
    avg = average_checkpoints(paths, into=into)
    exact = average_checkpoints(paths)
    for k in into:
        assert avg["model"][k].data_ptr() == held[k]  # the same storage, not a copy
        torch.testing.assert_close(avg["model"][k], exact["model"][k], rtol=2e-7, atol=0)
    assert int(into["count"]) == 5 and avg["step"] == 5 and len(avg["averaged"]) == 5
    with pytest.raises(CheckpointError, match="shape"):
        average_checkpoints(paths, into={**into, "w": torch.zeros(4, 2)})
    with pytest.raises(CheckpointError, match="the model averaged into"):
        average_checkpoints(paths, into={"w": torch.zeros(3, 2)})


def test_average_rejects_mismatch(tmp_path):
    save_checkpoint(tmp_path / "a.pt", _state(1.0))
    other = _state(1.0)
    other["model"]["w"] = torch.zeros(4, 2)
    save_checkpoint(tmp_path / "b.pt", other)
    with pytest.raises(CheckpointError, match="shape"):
        average_checkpoints([tmp_path / "a.pt", tmp_path / "b.pt"])
    with pytest.raises(CheckpointError):
        average_checkpoints([])


def test_average_script(tmp_path):
    for step, v in [(1, 0.0), (2, 3.0), (3, 5.0), (4, 7.0)]:
        save_checkpoint(tmp_path / f"checkpoint_{step}.pt", _state(v, step))
    out = tmp_path / "avg.pt"
    r = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "average_checkpoints.py"),
            "-o",
            str(out),
            "--last",
            "2",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stderr
    torch.testing.assert_close(load_checkpoint(out)["model"]["w"], torch.full((3, 2), 6.0))
    r = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "average_checkpoints.py"),
            "-o",
            str(out),
            str(tmp_path / "checkpoint_1.pt"),
            str(tmp_path / "checkpoint_2.pt"),
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stderr
    torch.testing.assert_close(load_checkpoint(out)["model"]["w"], torch.full((3, 2), 1.5))
