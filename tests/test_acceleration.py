"""Speed settings that leave the math alone: padded lengths rounded up for torch.compile,
compile before the DDP wrap (torch's documented order), compiled graphs counted in the log,
TF32 on CUDA only."""

from __future__ import annotations

import functools
import json
import time

import numpy as np
import pytest
import torch

import mt.fast.precision
import mt.fast.probe
import mt.train.recipe
from mt.data.batches import collate
from mt.fast.compile import compile_model, pad_multiple
from mt.fast.precision import native_bf16, resolve_precision, set_fp32_precision
from mt.model.transformer import build_model
from mt.schema import ModelConfig, TrainConfig
from mt.train.update import batch_loss

V = 40


def _pairs():
    rng = np.random.default_rng(3)
    return [(rng.integers(4, V, s), rng.integers(4, V, t)) for s, t in [(9, 3), (2, 6), (5, 12)]]


def test_padding_to_a_multiple_keeps_tokens_positions_and_loss():
    plain, bucketed = collate(_pairs()), collate(_pairs(), pad_multiple=8)
    assert plain.src.shape == (3, 10) and plain.tgt_in.shape == (3, 13)
    assert bucketed.src.shape == (3, 16) and bucketed.tgt_in.shape == (3, 16)
    assert bucketed.ntokens == plain.ntokens == 4 + 7 + 13
    for name in ("src", "tgt_in", "tgt_out"):
        a, b = getattr(plain, name), getattr(bucketed, name)
        assert torch.equal(b[:, : a.size(1)], a) and not b[:, a.size(1) :].any()
    # the real positions select the same tokens
    assert torch.equal(
        bucketed.tgt_out.flatten()[bucketed.real.tgt], plain.tgt_out.flatten()[plain.real.tgt]
    )
    assert torch.equal(
        bucketed.src.flatten()[bucketed.real.src], plain.src.flatten()[plain.real.src]
    )
    torch.manual_seed(0)
    model = build_model(ModelConfig(N=1, d_model=16, d_ff=32, h=2, dropout=0.0), V)
    ref = batch_loss(model, plain, 0.1, "fp32")
    got = batch_loss(model, bucketed, 0.1, "fp32")
    for g, r in zip(got, ref):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="pad_multiple"):
        collate(_pairs(), pad_multiple=0)


def test_pad_multiple_setting():
    """Compiled steps take dynamic shapes: no padding to multiples unless asked for."""
    assert pad_multiple(TrainConfig()) == 1
    assert pad_multiple(TrainConfig(compile=True)) == 1
    assert pad_multiple(TrainConfig(compile=True, pad_multiple=16)) == 16
    assert pad_multiple(TrainConfig(pad_multiple=4)) == 4
    with pytest.raises(ValueError, match="train.pad_multiple"):
        pad_multiple(TrainConfig(pad_multiple=-1))


def test_compile_model_wraps_only_when_asked():
    model = torch.nn.Linear(2, 2)
    assert compile_model(model, TrainConfig()) is model
    compiled = compile_model(model, TrainConfig(compile=True))
    assert compiled is not model and compiled._orig_mod is model  # the raw model stays eager


@pytest.mark.parametrize(
    ("avx512_bf16", "amx", "native"),
    [(False, False, False), (True, False, True), (False, True, True), (True, True, True)],
)
def test_native_bf16_on_cpu_follows_the_cpu_features(monkeypatch, avx512_bf16, amx, native):
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16, raising=False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx, raising=False)
    assert native_bf16(torch.device("cpu")) is native


def test_native_bf16_on_a_torch_without_the_feature_checks(monkeypatch):
    for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"):
        monkeypatch.delattr(torch.cpu, name, raising=False)
    assert native_bf16(torch.device("cpu")) is False  # unknown: fp32, the safe choice


@pytest.mark.parametrize("native", [False, True])
def test_resolve_precision(monkeypatch, caplog, native):
    """auto follows the measured figures (here given: bf16 faster exactly where 'native'),
    not the flag; an explicit bf16 warns where the flag says it is emulated."""
    monkeypatch.setattr(mt.fast.precision, "native_bf16", lambda device: native)
    figures = {"fp32": 1.0, "bf16": 0.5 if native else 2.0}
    monkeypatch.setattr(mt.fast.probe, "measure", lambda *a, **k: dict(figures))
    monkeypatch.setattr(mt.fast.probe, "_DECIDED", {})
    cpu = torch.device("cpu")
    assert resolve_precision("auto", cpu) == ("bf16" if native else "fp32")
    assert resolve_precision("fp32", cpu) == "fp32"
    assert resolve_precision("fp16", cpu) == "fp16"
    caplog.clear()
    assert resolve_precision("bf16", cpu) == "bf16"  # an explicit choice is kept ...
    emulated = [r for r in caplog.records if "emulated" in r.getMessage()]
    assert len(emulated) == (0 if native else 1)  # ... with a warning where it is emulated
    with pytest.raises(ValueError, match="train.precision must be one of"):
        resolve_precision("bf17", cpu)


@pytest.mark.parametrize("one_graph", [True, False])
def test_compiled_training_makes_one_graph_whatever_the_padding(monkeypatch, one_graph):
    """Batches as compiled training collates them (``one_graph``) run one graph: padding on both
    sides, on one, on none, and sizes equal by chance in the first batch (24 real source and
    target tokens: duck sizing would have given them one symbol). Collated as for eager
    training, the same batches make a graph for each combination of padded sides. Dynamo
    traces for real; its "eager" backend stands in for Inductor (the guards are Dynamo's)."""
    import torch.fx.experimental._config as fx_config
    from torch._dynamo.utils import counters

    from mt.fast import for_training

    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="eager"))
    rng = np.random.default_rng(0)

    def batch(src_lengths, tgt_lengths):
        pairs = [(rng.integers(4, V, s), rng.integers(4, V, t))
                 for s, t in zip(src_lengths, tgt_lengths)]  # fmt: skip
        return collate(pairs, one_graph=one_graph)

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    raw = build_model(ModelConfig(N=1, d_model=16, d_ff=32, h=2), V)
    dev = torch.device("cpu")
    graphs = []
    with fx_config.patch(use_duck_shape=True):  # torch's default, restored after the test
        model = compile_model(for_training(raw, dev, cpu_kernels=False, compiled=True),
                              TrainConfig(compile=True))  # fmt: skip
        assert not fx_config.use_duck_shape
        train_on_batches(model, batch, graphs)
    assert not counters["graph_break"]
    if one_graph:
        assert graphs == [1] * 6
    else:  # the check above can fail: the same batches collated for eager training
        assert graphs[-1] >= 4, graphs


def train_on_batches(model, batch, graphs: list) -> None:
    """One loss and backward pass on each padding combination, the compiled graphs counted."""
    from torch._dynamo.utils import counters

    for src_lengths, tgt_lengths in [
        ([5, 9, 7], [4, 11, 6]),  # both padded, 24 real tokens a side
        ([6, 3, 12, 4], [8, 2, 5, 9]),  # both padded, the sides' counts differ
        ([7, 7, 7], [3, 9, 5]),  # no source padding
        ([3, 9, 5], [6, 6, 6]),  # no target padding
        ([8, 8], [5, 5]),  # none
        ([20, 31, 7, 9, 12], [22, 17, 30, 8, 9]),
    ]:
        loss, _ = batch_loss(model, batch(src_lengths, tgt_lengths), 0.1, "fp32")
        loss.backward()
        graphs.append(int(counters["stats"]["unique_graphs"]))


def test_tf32_only_on_cuda():
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        set_fp32_precision(torch.device("cpu"), True)
        assert torch.get_float32_matmul_precision() == "highest"
        set_fp32_precision(torch.device("cuda", 0), True)
        assert torch.get_float32_matmul_precision() == "high"
        set_fp32_precision(torch.device("cuda", 0), False)
        assert torch.get_float32_matmul_precision() == "highest"
    finally:
        torch.set_float32_matmul_precision(before)


@pytest.mark.slow
def test_compiled_training_runs_compile_then_ddp_wrap_and_logs_graphs(
    real_data, tmp_path, monkeypatch
):
    """A short run with train.compile=true: the model handed to the DDP wrap is the compiled
    one around the raw model, batches keep their own lengths (dynamic shapes: no padding to
    multiples), the log counts compiled graphs. Dynamo traces for real; its "eager" backend
    stands in for Inductor here (Inductor itself: test_inductor_compiles_a_ddp_training_step)."""
    from test_train import _cfg, _records

    monkeypatch.setenv("MT_DATA_DIR", str(real_data))
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="eager"))
    wrapped, shapes = [], []
    real_wrap, real_update = mt.train.recipe.distributed.wrap, mt.train.recipe.Updater.__call__

    def wrap(model, info):
        wrapped.append(model)
        return real_wrap(model, info)

    def update(self, batches, state):
        shapes.extend((b.src.size(1), b.tgt_in.size(1)) for b in batches)
        return real_update(self, batches, state)

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    monkeypatch.setattr(mt.train.recipe.distributed, "wrap", wrap)
    monkeypatch.setattr(mt.train.recipe.Updater, "__call__", update)
    run = tmp_path / "run"
    result = mt.train.recipe.train(_cfg(run, "train.compile=true", "train.max_steps=4"))
    assert result["step"] == 4
    (model,) = wrapped
    assert isinstance(model, torch._dynamo.eval_frame.OptimizedModule)
    assert shapes and not all(s % 8 == 0 and t % 8 == 0 for s, t in shapes)
    logged = [r for r in _records(run) if "loss" in r]
    assert [r["step"] for r in logged] == [1, 2, 3, 4]
    # dynamic shapes from the start, batches collated for one graph: one graph
    assert [r["compiled_graphs"] for r in logged] == [1, 1, 1, 1]
    assert not torch._dynamo.utils.counters["graph_break"]
    assert json.dumps(logged)  # plain numbers


def test_the_probe_picks_the_fastest_allowed_candidate():
    from mt.fast.probe import fastest

    assert fastest({"fp32": 0.2, "bf16": 0.1}, ["fp32", "bf16"]) == "bf16"
    assert fastest({"fp32": 0.1, "bf16": 0.2}, ["fp32", "bf16"]) == "fp32"
    assert fastest({"fp32": 0.1, "bf16": 0.1}, ["fp32", "bf16"]) == "fp32"  # tie: the exact one
    assert fastest({"fp32": 0.3, "bf16": None}, ["fp32", "bf16"]) == "fp32"  # ruled out
    assert fastest({"fp32": 0.3, "bf16": 0.1}, ["fp32"]) == "fp32"  # bf16 not allowed


def test_the_probe_screens_out_a_slow_candidate_at_the_small_size():
    """A candidate more than SCREEN_RATIO times the best at the small size is not timed at the
    full size (emulated bf16 would take seconds there)."""
    from mt.fast.probe import measure

    calls = []

    def make(candidate, size):
        def run():
            calls.append((candidate, size))
            time.sleep({"fast": 0.001, "slow": 0.02}[candidate] * size / 10)

        return run

    figures = measure(make, ["fast", "slow"], size=20, screen_size=10)
    assert figures["slow"] is None and figures["fast"] > 0
    assert ("slow", 20) not in calls and calls.count(("fast", 20)) == 4  # warm-up + 3 timed


def test_the_probe_times_the_candidates_in_turns_and_keeps_medians():
    """A busy moment slows both candidates alike: the calls alternate (a, b, a, b, ...), and
    one slow call of the faster candidate (its median ignores it) neither rules it out nor
    makes it lose."""
    from mt.fast.probe import measure

    calls, slowed = [], {"n": 0}

    def make(candidate, size):
        def run():
            calls.append(candidate)
            seconds = {"a": 0.002, "b": 0.003}[candidate]
            if candidate == "a" and size == 10 and len(calls) == 3:  # the first timed call
                seconds *= 10  # a busy moment
                slowed["n"] += 1
            time.sleep(seconds)

        return run

    figures = measure(make, ["a", "b"], size=20, screen_size=10)
    assert slowed["n"] == 1 and figures["a"] is not None and figures["b"] is not None
    assert figures["a"] < figures["b"]
    assert calls == ["a", "b"] * 8  # warm-up + 3 turns, at the small size, then the full


def test_a_probe_is_cached_per_machine_and_reused(tmp_path, monkeypatch, caplog):
    from mt.fast.probe import ProbeCache, choose

    monkeypatch.setattr(mt.fast.probe, "_DECIDED", {})
    monkeypatch.setattr(mt.fast.probe, "measure", lambda *a, **k: {"a": 0.3, "b": 0.1})
    cpu = torch.device("cpu")
    with caplog.at_level("INFO", logger="mt.fast.probe"):
        assert choose("x", cpu, "shape", None, ["a", "b"], 8, 2, tmp_path) == "b"
    assert "x=auto: b (probe at shape on cpu" in caplog.text and "a 300.0 ms" in caplog.text
    (key,) = ProbeCache(tmp_path)._read()  # keyed by machine and torch version
    assert "threads=" in key and torch.__version__ in key
    monkeypatch.setattr(mt.fast.probe, "_DECIDED", {})  # a later process: the file answers
    monkeypatch.setattr(mt.fast.probe, "measure", lambda *a, **k: pytest.fail("probed again"))
    assert choose("x", cpu, "shape", None, ["a", "b"], 8, 2, tmp_path) == "b"


def test_the_real_training_probe_runs_quickly_on_this_cpu(tmp_path, monkeypatch):
    """The probe itself, at a small model's shapes: fp32 or bf16, well under a few seconds even
    where bf16 is emulated (it is screened out at the small size), and cached."""
    monkeypatch.setattr(mt.fast.probe, "_DECIDED", {})
    start = time.perf_counter()
    choice = resolve_precision("auto", torch.device("cpu"), (512, 64, 256), True, tmp_path)
    assert choice in ("fp32", "bf16") and time.perf_counter() - start < 10
    assert (tmp_path / "probes.json").is_file()


def test_the_real_projection_probe_runs_quickly_and_is_cached(tmp_path, monkeypatch):
    """The loss projection's probe itself (torch's products against oneDNN's at the loss's
    block shape), on this CPU: quick, and cached with both figures."""
    from mt.fast.loss import projected_block_rows
    from mt.fast.onednn import bucket_rows, onednn_available
    from mt.fast.training import onednn_projection

    monkeypatch.setattr(mt.fast.probe, "_DECIDED", {})
    model = build_model(ModelConfig(N=1, d_model=64, d_ff=128, h=4), 1000)
    start = time.perf_counter()
    on_onednn = onednn_projection(model, torch.device("cpu"), tmp_path)
    assert isinstance(on_onednn, bool) and time.perf_counter() - start < 10
    if not onednn_available():
        assert not on_onednn
        return
    entries = json.loads((tmp_path / "probes.json").read_text())
    rows = projected_block_rows(1000, "cpu", bucket_rows)  # 4,194 rows' scores: 16 MB
    (key,) = [k for k in entries if k.startswith(f"train.projection|projection {rows}x64x1000|")]
    assert entries[key]["choice"] == ("onednn" if on_onednn else "torch")
    assert set(entries[key]["figures"]) == {"torch", "onednn"}


INDUCTOR_RANK = """
import json, sys
import numpy as np
import torch
import torch._dynamo
from torch._dynamo.utils import counters
from mt import distributed
from mt.config import load_config
from mt.data.batches import collate
from mt.fast import for_training
from mt.fast.compile import compile_model
from mt.model import build_model
from mt.train.state import TrainState
from mt.train.update import Updater, build_optimizer

torch.set_num_threads(1)
info = distributed.setup("cpu")
cfg = load_config(["model.N=1", "model.d_model=16", "model.d_ff=32", "model.h=2",
                   "model.dropout=0.0", "train.compile=true",
                   "train.max_tokens=64", "train.clip_norm=1.0", "train.precision=fp32"])
torch.manual_seed(0)
raw = build_model(cfg.model, 40)
step_model = for_training(raw, info.device, cfg.train.cpu_kernels, compiled=True)  # default: on
model = distributed.wrap(compile_model(step_model, cfg.train), info)
opt = build_optimizer(raw.parameters(), cfg.train, info.device)
sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1e-3)
scaler = torch.amp.GradScaler("cpu", enabled=False)
update = Updater(model, raw.parameters(), opt, sched, scaler, cfg, info.world_size)
rng = np.random.default_rng(info.rank)
losses = []
for step in range(5):  # batches of other lengths every step, and on every rank
    lens = [(int(rng.integers(2, 12)), int(rng.integers(2, 12))) for _ in range(3)]
    batch = collate([(rng.integers(4, 40, s), rng.integers(4, 40, t)) for s, t in lens])
    losses.append(update([batch], TrainState()).loss)
out = {"graphs": int(counters["stats"]["unique_graphs"]),
       "breaks": sum(counters["graph_break"].values()), "losses": losses,
       "checksum": float(sum(p.double().sum() for p in raw.parameters()))}
with open(f"{sys.argv[1]}/rank{info.rank}.json", "w") as f:
    json.dump(out, f)
distributed.cleanup()
"""


@pytest.mark.slow
def test_inductor_compiles_a_ddp_training_step(tmp_path):
    """Inductor (real C++ code generation, not the eager backend) compiles the training step
    of the GPU path (the model itself, the fused loss outside the graph) under 2-rank gloo
    DDP: no graph break, one graph for five updates of varying lengths (dynamic shapes, no
    recompile storm), and the ranks stay in step.

    Inductor's C++ kernels cost ~1.5 s of compiling each on a 2-core CPU with nothing cached (a
    fresh machine): the kernels are kept scalar (no vector ISA) and dropout off, which leaves 19
    kernels instead of 29 and halves the test's time. What the GPU path needs proved is the
    tracing, the DDP split and the lowering; the kernels a GPU runs are Triton's, not these."""
    from test_distributed import inductor_ranks

    ranks = inductor_ranks(tmp_path, INDUCTOR_RANK)
    for r in ranks:
        assert r["breaks"] == 0 and 1 <= r["graphs"] <= 2, r
        assert all(np.isfinite(r["losses"]))
    assert ranks[0]["checksum"] == pytest.approx(ranks[1]["checksum"], rel=1e-6)
    assert ranks[0]["losses"] == ranks[1]["losses"]  # the update's loss is all ranks'


def test_the_training_probe_runs_a_layers_products_at_the_row_counts_batches_have():
    """layer_step: the four products of a layer (QKV, output, FFN in and out) forward and
    backward, each call at the next of n x (1.0, 0.85, 0.7) rows, every row count met once
    before the timing starts (kernels built per row count are built then)."""
    import torch.nn.functional as F

    from mt.fast.precision import ROW_SHARES, layer_step

    seen = []

    def product(x, w):
        seen.append((x.size(0), tuple(w.shape)))
        return F.linear(x, w)

    step = layer_step("fp32", 40, 8, 32, torch.device("cpu"), product)
    shapes = [(24, 8), (8, 8), (32, 8), (8, 32)]
    assert ROW_SHARES == (1.0, 0.85, 0.7)
    assert seen == [(n, s) for n in (40, 34, 28) for s in shapes]  # the warm-up, before timing
    seen.clear()
    for _ in range(4):
        step()
    assert [n for n, _ in seen[::4]] == [40, 34, 28, 40]
    assert [s for _, s in seen[:4]] == shapes
