"""DDP on CPU with gloo: 2 ranks = 1 rank with accumulation; 2 "nodes" rendezvous and finish."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_train import TINY, _cfg, _losses

from mt import distributed
from mt.checkpoint import load_checkpoint

ROOT = Path(__file__).resolve().parents[1]
ENTRY = 'from mt.cli import train_main\n\nif __name__ == "__main__":\n    train_main()\n'


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(tmp_path: Path, launch: list[str], overrides: list[str]) -> subprocess.Popen:
    script = tmp_path / "mt_train_entry.py"
    script.write_text(ENTRY)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    return subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", *launch, str(script), *TINY, *overrides],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


@pytest.fixture(autouse=True)
def _data_env(real_data, monkeypatch):
    monkeypatch.setenv("MT_DATA_DIR", str(real_data))


def test_single_process_helpers_are_noops(monkeypatch):
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    info = distributed.setup("cpu")
    assert (info.rank, info.world_size, info.is_main, info.distributed) == (0, 1, True, False)
    assert info.device == torch.device("cpu")
    t = torch.tensor([1.5, 2.0])
    assert distributed.all_reduce_sum(t) is t and t.tolist() == [1.5, 2.0]
    assert distributed.all_gather_object({"a": 1}) == [{"a": 1}]
    assert distributed.broadcast_float(None, info.device) is None
    model = torch.nn.Linear(2, 2)
    assert distributed.wrap(model, info) is model
    distributed.barrier()
    distributed.cleanup()
    assert distributed.resolve_device("cuda:1") == torch.device("cuda", 1)
    assert distributed.resolve_device("cuda", local_rank=3) == torch.device("cuda", 3)
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert distributed.resolve_device("auto").type == expected


@pytest.mark.slow
def test_two_ranks_equal_one_rank_with_accumulation(tmp_path):
    """Per-update losses of 2 gloo ranks x max_tokens=M equal 1 rank x accum_steps=2 (dropout 0):
    the gradient is normalised by the tokens of the whole update across ranks."""
    common = ["model.dropout=0.0", "train.max_steps=6", "train.max_tokens=300"]
    single = tmp_path / "single"
    train_cfg = _cfg(single, *common, "train.accum_steps=2")
    from mt.train import train

    train(train_cfg)
    expected = _losses(single)

    ddp = tmp_path / "ddp"
    launch = ["--nproc_per_node=2", f"--master_port={_free_port()}"]
    proc = _torchrun(tmp_path, launch, [*common, f"run_dir={ddp}"])
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out
    got = _losses(ddp)
    assert sorted(got) == sorted(expected) == list(range(1, 7))
    for step in expected:
        assert got[step] == pytest.approx(expected[step], rel=1e-4), step
    # the same model at the end, and only rank 0 wrote (one record per step)
    lines = [json.loads(x) for x in (ddp / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines if "loss" in r] == list(range(1, 7))
    a = load_checkpoint(single / "checkpoints" / "last.pt")["model"]
    b = load_checkpoint(ddp / "checkpoints" / "last.pt", require_training=True)
    assert len(b["rng"]) == 2  # each rank's RNG streams are kept for exact resume
    for k in a:
        torch.testing.assert_close(b["model"][k], a[k], rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_two_nodes_rendezvous_and_finish(tmp_path):
    """Two torchrun "nodes" of one process each meet through c10d rendezvous on 127.0.0.1."""
    port = _free_port()
    run = tmp_path / "run"
    procs = []
    for node in range(2):
        (tmp_path / f"node{node}").mkdir()
        launch = [
            "--nnodes=2",
            f"--node_rank={node}",
            "--nproc_per_node=1",
            "--rdzv_backend=c10d",
            f"--rdzv_endpoint=127.0.0.1:{port}",
            "--rdzv_id=mt-test",
        ]
        procs.append(
            _torchrun(tmp_path / f"node{node}", launch, ["train.max_steps=3", f"run_dir={run}"])
        )
    outs = [p.communicate(timeout=300)[0] for p in procs]
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out
    ckpt = load_checkpoint(run / "checkpoints" / "last.pt", require_training=True)
    assert ckpt["step"] == 3 and len(ckpt["rng"]) == 2
