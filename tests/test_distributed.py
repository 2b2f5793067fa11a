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


def inductor_ranks(tmp_path: Path, script_text: str) -> list[dict]:
    """Run ``script_text`` as 2 gloo ranks under torchrun, with Inductor's kernels kept scalar
    (what these tests prove is the tracing, the DDP split and the guards, not the kernels a GPU
    would run), and return each rank's ``rank<r>.json``."""
    root = Path(__file__).resolve().parents[1]
    script = tmp_path / "rank.py"
    script.write_text(script_text)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(root), TORCHINDUCTOR_VEC_ISA_OK="0")
    launch = ["--nproc_per_node=2", f"--master_port={_free_port()}"]
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", *launch, str(script), str(tmp_path)],
        capture_output=True, text=True, cwd=root, env=env, timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]


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
    calls = []
    assert distributed.decide_on_rank0(lambda: calls.append(1) or {"k": "v"}) == {"k": "v"}
    assert calls == [1]  # once, here: a single process is rank 0
    with pytest.raises(KeyError, match="its own error"):  # raised as it is, not as a RankError
        distributed.decide_on_rank0(lambda: {}["its own error"], "a choice")
    model = torch.nn.Linear(2, 2)
    assert distributed.wrap(model, info) is model
    distributed.barrier()
    distributed.cleanup()
    assert distributed.resolve_device("cuda:1") == torch.device("cuda", 1)
    assert distributed.resolve_device("cuda", local_rank=3) == torch.device("cuda", 3)
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert distributed.resolve_device("auto").type == expected


@pytest.mark.slow
@pytest.mark.parametrize("buckets", [0, 3])
def test_two_ranks_equal_one_rank_with_accumulation(tmp_path, monkeypatch, buckets):
    """Per-update losses of 2 gloo ranks x max_tokens=M equal 1 rank x accum_steps=2 (dropout 0):
    the gradient is normalised by the tokens of the whole update across ranks; with shape
    buckets too (train.shape_buckets: the same shapes and plan on every rank)."""
    import mt.fast.probe

    # The kernels from the probes' cache file, as the ranks take them, not from what this
    # process decided in an earlier test: the key projection's bias has a gradient of pure
    # rounding (softmax ignores a constant), which Adam turns into steps of lr's size, so the
    # two runs must round alike to end with the same weights.
    monkeypatch.setattr(mt.fast.probe, "_DECIDED", {})
    common = ["model.dropout=0.0", "train.max_steps=6", "train.max_tokens=300", "train.ema=0.5",
              f"train.shape_buckets={buckets}"]
    single = tmp_path / "single"
    train_cfg = _cfg(single, *common, "train.accum_steps=2")
    from mt.train.recipe import train

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
    # the moving average of the weights (train.ema) too, and rank 0 validated it into ema.pt
    ema_a = load_checkpoint(single / "checkpoints" / "last.pt")["ema"]
    assert b["ema"]["updates"] == ema_a["updates"] == 6
    for x, y in zip(ema_a["weights"], b["ema"]["weights"]):
        torch.testing.assert_close(y, x, rtol=1e-4, atol=1e-5)
    assert load_checkpoint(ddp / "checkpoints" / "ema.pt")["ema_updates"] == 6


@pytest.mark.slow
def test_two_nodes_rendezvous_and_finish(tmp_path):
    """Two torchrun "nodes" of one process each meet through c10d rendezvous on 127.0.0.1."""
    from mt.data.build import prepare

    port = _free_port()
    run = tmp_path / "run"
    prepare(_cfg(run))  # under torchrun ranks only load prepared data (cached: a no-op)
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


# -- rank 0 decides, every rank checks (2 gloo ranks started by hand, no training) ----------

RANKS_SCRIPT = r"""
import json, sys
from pathlib import Path
from mt import distributed
from mt.train.state import agree_on_resume

root = Path(sys.argv[1])
info = distributed.setup("cpu", timeout_minutes=2)
out = {}
for case in sorted(p.name for p in root.iterdir() if p.is_dir()):
    d = root / case / ("shared" if (root / case / "shared").is_dir() else f"rank{info.rank}")
    try:
        ckpt, path = agree_on_resume(d / "checkpoints", info.is_main)
        out[case] = ["ok", None if ckpt is None else [path.name, ckpt["step"]]]
    except Exception as err:
        out[case] = [type(err).__name__, str(err)]
# Last: a prepared-data cache miss under 2 ranks (train() leaves the process group).
from test_train import _cfg
from mt.train.recipe import train
try:
    train(_cfg(root / "run", f"cache_dir={root / 'empty-cache'}", "train.max_steps=1"))
    out["cache"] = ["ok", None]
except Exception as err:
    out["cache"] = [type(err).__name__, str(err)]
print("RESULT " + json.dumps(out))
"""


DECIDE_SCRIPT = r"""
import json, sys
from pathlib import Path
from mt import distributed
from mt.train.recipe import _lock_run_dir

root = Path(sys.argv[1])
info = distributed.setup("cpu", timeout_minutes=2)
calls, out = [], {}
out["value"] = distributed.decide_on_rank0(lambda: calls.append(1) or [info.rank, "seen"])
out["calls"] = len(calls)

def fail():
    raise ValueError(f"rank {info.rank} cannot decide")

for case, decide, what in (("error", fail, "the test's choice"),
                           ("locked", lambda: _lock_run_dir(root / "locked"), None),
                           ("free", lambda: _lock_run_dir(root / "free"), None)):
    try:
        got = decide() if what is None else distributed.decide_on_rank0(decide, what)
        out[case] = ["ok", None if got is None else type(got).__name__]
        if got is not None:
            got.release()
    except Exception as err:
        out[case] = [type(err).__name__, str(err)]
distributed.cleanup()
print("RESULT " + json.dumps(out))
"""


def test_rank_0_decides_and_every_rank_takes_its_answer_or_its_error(tmp_path):
    """decide_on_rank0 under 2 gloo ranks: only rank 0 runs the decision and both return its
    value; an error on rank 0 is rank 0's own there and a RankError quoting it on rank 1 (no
    rank waits for a collective that never comes). The run directory's lock goes through it:
    held by another run, rank 0 says whose and rank 1 stops too; free, rank 0 alone holds it."""
    from mt.train.lock import RunLock

    for name in ("locked", "free"):
        (tmp_path / name).mkdir()
    held = RunLock(tmp_path / "locked").acquire()  # another run, alive: this process
    try:
        rank0, rank1 = _two_ranks(tmp_path, DECIDE_SCRIPT)
    finally:
        held.release()
    assert rank0["value"] == rank1["value"] == [0, "seen"]
    assert (rank0["calls"], rank1["calls"]) == (1, 0)
    assert rank0["error"] == ["ValueError", "rank 0 cannot decide"]
    assert rank1["error"][0] == "RankError"
    assert rank1["error"][1] == ("the test's choice failed on rank 0: ValueError: rank 0 "
                                 "cannot decide")
    assert rank0["locked"][0] == "LockError" and f"pid {os.getpid()}" in rank0["locked"][1]
    assert rank1["locked"][0] == "RankError" and "locking run_dir" in rank1["locked"][1]
    assert f"pid {os.getpid()}" in rank1["locked"][1]  # rank 0's reason, quoted
    assert rank0["free"] == ["ok", "RunLock"] and rank1["free"] == ["ok", None]


def _fake_checkpoint(path: Path, step: int) -> None:
    from mt.checkpoint import MODEL_KEYS, TRAINING_KEYS, save_checkpoint
    from mt.vocab import SPECIALS

    ckpt = {k: {} for k in MODEL_KEYS + TRAINING_KEYS}
    ckpt.update(specials=SPECIALS, step=step)
    save_checkpoint(path, ckpt)


def _two_ranks(tmp_path: Path, script: str) -> list[dict]:
    port = _free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=f"{ROOT}:{ROOT / 'tests'}",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2")  # fmt: skip
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", script, str(tmp_path)],
            env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(2)
    ]
    outs = [p.communicate(timeout=240)[0] for p in procs]
    results = []
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out
        line = [x for x in out.splitlines() if x.startswith("RESULT ")]
        assert line, out
        results.append(json.loads(line[-1][len("RESULT ") :]))
    return results


def test_resume_is_rank_0s_choice_checked_by_every_rank_and_a_cache_miss_says_prepare(tmp_path):
    """Each case gives the two ranks a view of the run directory: one shared directory, or one
    per rank (what ranks on nodes without a shared filesystem would see)."""
    views = {  # case -> checkpoint step per rank (None: no checkpoint; "shared": one directory)
        "agree": {"shared": 3},
        "new_run": {"shared": None},
        "other_step": {"rank0": 3, "rank1": 2},
        "missing_on_rank1": {"rank0": 3, "rank1": None},
        "only_rank1_has_one": {"rank0": None, "rank1": 4},
    }
    for case, dirs in views.items():
        for name, step in dirs.items():
            ckpt_dir = tmp_path / case / name / "checkpoints"
            ckpt_dir.mkdir(parents=True)
            if step is not None:
                _fake_checkpoint(ckpt_dir / "last.pt", step)
    (tmp_path / "unreadable" / "shared" / "checkpoints").mkdir(parents=True)
    (tmp_path / "unreadable" / "shared" / "checkpoints" / "last.pt").write_bytes(b"garbage")

    rank0, rank1 = _two_ranks(tmp_path, RANKS_SCRIPT)
    assert rank0["agree"] == rank1["agree"] == ["ok", ["last.pt", 3]]
    assert rank0["new_run"] == rank1["new_run"] == ["ok", None]
    # the rank that disagrees says why; the other one stops too, quoting it
    assert rank1["other_step"][0] == "CheckpointError"
    assert "reads step 2" in rank1["other_step"][1] and "shared" in rank1["other_step"][1]
    assert rank0["other_step"][0] == "RankError" and "rank 1" in rank0["other_step"][1]
    assert rank1["missing_on_rank1"][0] == "CheckpointError"
    assert "cannot read it" in rank1["missing_on_rank1"][1]
    assert rank0["missing_on_rank1"][0] == "RankError"
    assert rank1["only_rank1_has_one"][0] == "CheckpointError"
    assert "new run" in rank1["only_rank1_has_one"][1]
    assert rank0["only_rank1_has_one"][0] == "RankError"
    # rank 0 cannot resume at all: it says so, rank 1 stops with its message
    assert rank0["unreadable"][0] == "CheckpointError"
    assert rank1["unreadable"][0] == "RankError" and "rank 0" in rank1["unreadable"][1]
    # a cache miss: every rank stops and says to run mt-prepare (nothing was built)
    for r in (rank0, rank1):
        assert r["cache"][0] == "CacheError" and "mt-prepare" in r["cache"][1], r["cache"]
    assert not (tmp_path / "empty-cache").exists() or not any(
        p.name.startswith("multi30k") for p in (tmp_path / "empty-cache").iterdir()
    )


@pytest.mark.gpu
def test_control_collectives_do_not_synchronise_the_gpu(tmp_path):
    """Under NCCL the stop/wall-time collective of every update runs on the gloo control group:
    with sync debug mode "error", a device-side all-reduce read back with .tolist() would
    raise; the control collectives must not."""
    import datetime

    import torch.distributed as dist

    dev = torch.device("cuda", 0)
    dist.init_process_group("nccl", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1, device_id=dev)  # fmt: skip
    distributed.init_control_group(datetime.timedelta(minutes=1))
    try:
        torch.cuda.set_sync_debug_mode("error")
        assert distributed.max_over_ranks([1.0, 2.5]) == [1.0, 2.5]
        distributed.barrier()
    finally:
        torch.cuda.set_sync_debug_mode(0)
        distributed.cleanup()


def test_ddp_wrap_asks_for_no_buffer_sync_without_deprecation_warnings(tmp_path):
    """torch 2.13 deprecates broadcast_buffers (a FutureWarning on every DDP run): the wrap uses
    the keyword this torch has, and the model still trains through it."""
    import warnings

    import torch.distributed as dist

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    wrapped = None
    try:
        model = torch.nn.Linear(4, 2)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            wrapped = distributed.wrap(model, distributed.DistInfo(world_size=2))
        assert isinstance(wrapped, torch.nn.parallel.DistributedDataParallel)
        assert not [w for w in caught if issubclass(w.category, FutureWarning)], caught
        assert not getattr(wrapped, "forward_sync_buffers", wrapped.broadcast_buffers)
        wrapped(torch.randn(3, 4)).sum().backward()
        assert model.weight.grad is not None
    finally:
        # The DDP wrapper (its reducer holds the group) goes before the group: released after
        # destroy_process_group, gloo's destructor once hung joining its thread (a CI run).
        del wrapped
        distributed.cleanup()  # mt's own way out of the group


def test_the_other_ranks_take_rank_0s_kernel_choices(tmp_path, monkeypatch):
    """In a distributed run rank 0 builds the training module first, probing its kernels, and
    broadcasts its choices; another rank adopts them and probes nothing (all ranks probing at
    once on shared cores would skew the figures, and could choose differently)."""
    import mt.fast.probe
    import mt.train.recipe as recipe
    from mt.fast.onednn import Linear, linear, onednn_available
    from mt.model.transformer import build_model

    if not onednn_available():
        pytest.skip("no oneDNN linear kernel: nothing to choose between")
    cfg = _cfg(tmp_path / "run", "train.precision=fp32")
    raw = build_model(cfg.model, 40)
    monkeypatch.setattr(mt.fast.probe.ProbeCache, "get", lambda self, key: None)
    monkeypatch.setattr(mt.fast.probe.ProbeCache, "put", lambda self, key, entry: None)
    sent = []

    def on_rank0(decide, what=""):  # rank 0: decides, and its answer goes to every rank
        sent.append(decide())
        return sent[-1]

    monkeypatch.setattr(distributed, "decide_on_rank0", on_rank0)
    monkeypatch.setattr(mt.fast.probe, "_DECIDED", {})
    monkeypatch.setattr(
        mt.fast.probe, "measure", lambda *a, **k: {"torch": 2.0, "onednn": 1.0}
    )  # oneDNN measured faster on rank 0
    rank0 = recipe._training_forward(raw, cfg, distributed.DistInfo(rank=0, world_size=2))
    (decisions,) = sent
    assert sorted(k.split("|")[0] for k in decisions) == ["train.products", "train.projection"]

    monkeypatch.setattr(mt.fast.probe, "_DECIDED", {})  # rank 1: a process of its own
    monkeypatch.setattr(mt.fast.probe, "measure", lambda *a, **k: pytest.fail("rank 1 probed"))
    monkeypatch.setattr(distributed, "decide_on_rank0", lambda decide, what="": decisions)
    rank1 = recipe._training_forward(raw, cfg, distributed.DistInfo(rank=1, world_size=2))
    for forward in (rank0, rank1):
        assert forward.product is linear
        assert any(type(m) is Linear for m in forward.modules())
