"""The whole step of a shape-bucketed batch compiled (mt.fast.graphs): its masked loss against
the reference on the real rows, the mode each device gets, the routing of known and unknown
shapes, one graph per bucket with Inductor under 2-rank gloo DDP, CUDA graphs on a GPU."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

import mt.fast.graphs as graphs
from mt.data.batches import collate, collate_flat
from mt.fast import for_training
from mt.fast.compile import compile_step, step_loss
from mt.fast.graphs import BucketStep, ShapeRouter, bucket_loss, masked_smoothed_loss, step_mode
from mt.model.loss import label_smoothed_nll_loss
from mt.model.transformer import build_model
from mt.schema import ModelConfig, TrainConfig
from mt.train.update import batch_loss
from mt.vocab import PAD

V = 40
CPU = torch.device("cpu")


def test_the_masked_loss_is_the_reference_over_the_real_rows():
    torch.manual_seed(0)
    h = torch.randn(12, 8, dtype=torch.float64, requires_grad=True)
    w = torch.randn(V + 3, 8, dtype=torch.float64, requires_grad=True)  # padded vocabulary rows
    target = torch.randint(4, V, (12,))
    target[[2, 5, 11]] = PAD
    loss, nll = masked_smoothed_loss(h, w, target, 0.1, V)
    keep = target != PAD
    lp = torch.log_softmax(h[keep] @ w[:V].t(), -1)
    ref_loss, ref_nll = label_smoothed_nll_loss(lp, target[keep], 0.1)
    tol = dict(rtol=1e-5, atol=1e-6)  # the scores in float32, as training's
    torch.testing.assert_close(loss.double(), ref_loss.double(), **tol)
    torch.testing.assert_close(nll.double(), ref_nll.double(), **tol)
    grads = torch.autograd.grad(loss, (h, w))
    ref = torch.autograd.grad(ref_loss, (h, w))
    for g, r in zip(grads, ref):
        torch.testing.assert_close(g, r, **tol)
    assert not grads[0][~keep].any()  # a pad row gets no gradient


def _flat(pairs):
    srcs, tgts = zip(*pairs)
    return (np.concatenate(srcs), np.array([len(x) for x in srcs]),
            np.concatenate(tgts), np.array([len(x) for x in tgts]))  # fmt: skip


def test_the_bucket_step_on_a_bucketed_batch_is_the_update_loss_of_the_unpadded_batch():
    rng = np.random.default_rng(1)
    pairs = [(rng.integers(4, V, s), rng.integers(4, V, t)) for s, t in [(9, 3), (2, 6), (5, 12)]]
    torch.manual_seed(0)
    raw = build_model(ModelConfig(N=1, d_model=16, d_ff=32, h=2, dropout=0.0), V)
    step = BucketStep(for_training(raw, CPU, cpu_kernels=False, compiled=True))
    results = []
    for fn, batch in ((batch_loss, collate(pairs)), (bucket_loss, collate_flat(*_flat(pairs),
                                                                             shape=(5, 12, 16)))):
        raw.zero_grad()
        loss, nll = fn(raw if fn is batch_loss else step, batch, 0.1, "fp32")
        loss.backward()
        results.append((loss.detach(), nll, [p.grad.clone() for p in raw.parameters()]))
    torch.testing.assert_close(results[1][0], results[0][0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(results[1][1], results[0][1], rtol=1e-5, atol=1e-5)
    for g, r in zip(results[1][2], results[0][2]):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-5)


def test_cuda_graphs_only_on_cuda_with_buckets():
    assert step_mode("cuda", 8) == "reduce-overhead"
    assert step_mode("cuda", 0) == "default"  # every batch its own shape: nothing to replay
    assert step_mode("cpu", 8) == "default"


def test_known_shapes_take_the_fixed_step_and_others_the_plain_one(monkeypatch, caplog):
    calls, marks = [], []
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: marks.append(1))
    step = torch.nn.Linear(2, 2)
    router = ShapeRouter(
        step, [(4, 8, 6), (2, 16, 12)], fixed=lambda *a: calls.append("fixed") or 1,
        plain=lambda *a: calls.append("plain") or 2, graphs=True,
    )  # fmt: skip
    assert [name for name, _ in router.named_parameters()] == ["step.weight", "step.bias"]

    def run(b, s, t):
        return router(torch.zeros(b, s), torch.zeros(b, t), torch.zeros(b, t), 0.1)

    assert run(4, 8, 6) == 1 and run(2, 16, 12) == 1
    assert run(4, 8, 7) == 2 and run(3, 8, 6) == 2  # a width or a row count outside the set
    assert calls == ["fixed", "fixed", "plain", "plain"]
    assert len(marks) == 2  # each replay starts a step of the cudagraph trees; plain ones none
    assert router.calls == {"fixed": 2, "plain": 2}
    assert sum("outside the shape buckets" in r.message for r in caplog.records) == 1


def test_compile_step_compiles_the_whole_step_only_with_buckets(monkeypatch):
    compiled = []
    monkeypatch.setattr(torch, "compile", lambda m, **kw: compiled.append(kw) or m)
    torch.manual_seed(0)
    forward = for_training(build_model(ModelConfig(N=1, d_model=16, d_ff=32, h=2), V), CPU,
                           cpu_kernels=False, compiled=True)  # fmt: skip
    assert compile_step(forward, TrainConfig(), CPU) is forward  # no compile: as before
    assert step_loss(forward) is None
    compile_step(forward, TrainConfig(compile=True), CPU)
    assert compiled == [{"dynamic": True}]  # the model alone, as before
    compiled.clear()
    router = compile_step(forward, TrainConfig(compile=True, shape_buckets=2), CPU, [(4, 8, 8)])
    assert isinstance(router, ShapeRouter) and router.step.training_model is forward
    assert compiled == [{"dynamic": True, "mode": "default"}]  # a CPU: no graphs, one step
    assert step_loss(router) is bucket_loss and not router.graphs
    compiled.clear()
    router = compile_step(forward, TrainConfig(compile=True, shape_buckets=2),
                          torch.device("cuda"), [(4, 8, 8)])  # fmt: skip
    assert compiled == [{"dynamic": True, "mode": "reduce-overhead"}, {"dynamic": True}]
    assert router.graphs


def test_a_compiled_bucketed_run_trains_with_one_graph_per_shape(real_data, tmp_path, monkeypatch):
    """train.compile=true with train.shape_buckets: every batch has a bucket shape, runs the
    fixed-shape step, and the graphs stay within the shapes met. Dynamo traces for real; its
    "eager" backend stands in for Inductor (Inductor itself: the DDP test below)."""
    from test_train import _cfg, _records

    import mt.train.recipe

    monkeypatch.setenv("MT_DATA_DIR", str(real_data))
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="eager"))
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    routers = []
    real_wrap = mt.train.recipe.distributed.wrap
    monkeypatch.setattr(mt.train.recipe.distributed, "wrap",
                        lambda m, info: routers.append(m) or real_wrap(m, info))  # fmt: skip
    run = tmp_path / "run"
    result = mt.train.recipe.train(
        _cfg(run, "train.compile=true", "train.shape_buckets=3", "train.max_steps=6")
    )
    assert result["step"] == 6
    (router,) = routers
    assert isinstance(router, ShapeRouter) and len(router.shapes) == 3
    assert router.calls == {"fixed": 6, "plain": 0}
    logged = [r for r in _records(run) if "loss" in r]
    assert all(np.isfinite(r["loss"]) for r in logged)
    assert 1 <= logged[-1]["compiled_graphs"] <= 3
    assert not torch._dynamo.utils.counters["graph_break"]


INDUCTOR_RANK = """
import json, sys
import numpy as np
import torch
from torch._dynamo.utils import counters
from mt import distributed
from mt.config import load_config
from mt.data.batches import collate_flat
from mt.fast import for_training
from mt.fast.compile import compile_step, step_loss
from mt.model import build_model
from mt.train.state import TrainState
from mt.train.update import Updater, build_optimizer

torch.set_num_threads(1)
info = distributed.setup("cpu")
cfg = load_config(["model.N=1", "model.d_model=16", "model.d_ff=32", "model.h=2",
                   "model.dropout=0.0", "train.compile=true", "train.shape_buckets=2",
                   "train.max_tokens=64", "train.clip_norm=1.0", "train.precision=fp32"])
torch.manual_seed(0)
raw = build_model(cfg.model, 40)
SHAPES = [(8, 8, 8), (4, 16, 14)]
step = for_training(raw, info.device, cfg.train.cpu_kernels, compiled=True)
model = distributed.wrap(compile_step(step, cfg.train, info.device, SHAPES), info)
opt = build_optimizer(raw.parameters(), cfg.train, info.device)
sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1e-3)
scaler = torch.amp.GradScaler("cpu", enabled=False)
update = Updater(model, raw.parameters(), opt, sched, scaler, cfg, info.world_size,
                 loss_fn=step_loss(model))
rng = np.random.default_rng(info.rank)
losses, graphs = [], []
for i in range(6):  # the two shapes in turn, other pairs every step and on every rank
    rows, S, T = SHAPES[i % 2]
    n = int(rng.integers(1, rows + 1))
    s = rng.integers(1, S, n)
    t = rng.integers(1, T - 1, n)
    batch = collate_flat(rng.integers(4, 40, s.sum()), s, rng.integers(4, 40, t.sum()), t,
                         shape=(rows, S, T))
    losses.append(update([batch], TrainState()).loss)
    graphs.append(int(counters["stats"]["unique_graphs"]))
out = {"graphs": graphs, "breaks": sum(counters["graph_break"].values()), "losses": losses,
       "routes": distributed.unwrap(model).calls,
       "checksum": float(sum(p.double().sum() for p in raw.parameters()))}
with open(f"{sys.argv[1]}/rank{info.rank}.json", "w") as f:
    json.dump(out, f)
distributed.cleanup()
"""


@pytest.mark.slow
def test_inductor_compiles_the_bucketed_step_once_per_shape_under_ddp(tmp_path):
    """Inductor compiles the whole bucketed step (forward, masked loss, their backward) under
    2-rank gloo DDP: no graph break, at most one graph per bucket shape (2 shapes, 6 updates;
    dynamic shapes make it one), the ranks in step. Kernels kept scalar, as in
    test_acceleration's Inductor test (what is proved is the tracing and the guards)."""
    from test_distributed import inductor_ranks

    ranks = inductor_ranks(tmp_path, INDUCTOR_RANK)
    for r in ranks:
        assert r["breaks"] == 0, r
        assert 1 <= max(r["graphs"]) <= 2 and r["graphs"][-1] == r["graphs"][1], r  # <= buckets
        assert r["routes"] == {"fixed": 6, "plain": 0}
        assert all(np.isfinite(r["losses"]))
    assert ranks[0]["checksum"] == pytest.approx(ranks[1]["checksum"], rel=1e-6)
    assert ranks[0]["losses"] == ranks[1]["losses"]


@pytest.mark.gpu
def test_cuda_graphs_replay_the_bucketed_step_on_a_gpu():
    """On CUDA: the bucketed step replayed as CUDA graphs (reduce-overhead), at most one Dynamo
    graph per shape over 8 updates of 2 shapes, the losses those of the eager step, the graph
    pools' memory reported."""
    from torch._dynamo.utils import counters

    dev = torch.device("cuda")
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    raw = build_model(ModelConfig(N=1, d_model=64, d_ff=128, h=4, dropout=0.0), V).to(dev)
    shapes = [(8, 8, 8), (4, 16, 16)]
    forward = for_training(raw, dev)
    router = compile_step(forward, TrainConfig(compile=True, shape_buckets=2), dev, shapes)
    assert router.graphs
    rng = np.random.default_rng(0)
    for i in range(8):
        rows, S, T = shapes[i % 2]
        n = int(rng.integers(1, rows + 1))
        s, t = rng.integers(1, S, n), rng.integers(1, T - 1, n)
        batch = collate_flat(rng.integers(4, V, s.sum()), s, rng.integers(4, V, t.sum()), t,
                             shape=(rows, S, T)).to(dev)  # fmt: skip
        loss, _ = bucket_loss(router, batch, 0.1, "fp32")
        eager, _ = bucket_loss(router.step, batch, 0.1, "fp32")
        torch.testing.assert_close(loss, eager, rtol=1e-3, atol=1e-3)
        loss.backward()
        raw.zero_grad(set_to_none=True)
    assert 1 <= int(counters["stats"]["unique_graphs"]) <= 2
    assert router.calls["plain"] == 0
    memory = graphs.graph_memory_gb(dev)
    assert memory["reserved_gb"] > 0
