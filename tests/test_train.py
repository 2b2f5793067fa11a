"""Training: exact resume after SIGKILL, SIGTERM, init_from, patience, non-finite updates,
averaging. Tiny model on a slice of real Multi30k, one thread, CPU."""

from __future__ import annotations

import json
import logging
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import mt.fast.precision
import mt.train.update
from mt.checkpoint import CheckpointError, load_checkpoint, periodic_checkpoints
from mt.config import load_config
from mt.fast.loss import label_smoothed_cross_entropy
from mt.model.loss import label_smoothed_nll_loss
from mt.train.preempt import EXIT_PREEMPTED
from mt.train.recipe import train
from mt.train.state import train_sampler
from mt.train.update import NonFiniteError

ROOT = Path(__file__).resolve().parents[1]

# Shared by every test so the prepared-data cache is built once per test run.
TINY = [
    "experiment=smoke",
    "data.max_train_pairs=500",
    "tokenizer.vocab_size=500",
    "model.N=1",
    "model.d_model=32",
    "model.d_ff=64",
    "model.h=2",
    "train.max_tokens=400",
    "train.threads=1",
    "train.warmup=10",
    "train.lr=3e-3",
    "train.log_every=1",
    "train.eval_every=0",
    "train.save_every=0",
    "train.eval_bleu=false",
    "train.eval_max_sentences=10",
]


def _cfg(run_dir: Path, *overrides: str):
    return load_config([*TINY, f"run_dir={run_dir}", *overrides])


def _records(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def _losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in _records(run_dir) if "loss" in r}


def _spawn(run_dir: Path, env_data: Path, *overrides: str) -> subprocess.Popen:
    env = dict(os.environ, MT_DATA_DIR=str(env_data))
    code = "from mt.cli import train_main; train_main()"
    return subprocess.Popen(
        [sys.executable, "-c", code, *TINY, f"run_dir={run_dir}", *overrides],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _wait_for(path: Path, proc: subprocess.Popen, timeout: float = 120.0) -> None:
    end = time.monotonic() + timeout
    while not path.exists():
        if proc.poll() is not None:
            pytest.fail(
                f"training exited ({proc.returncode}) before {path.name}:\n{proc.stdout.read()}"
            )
        if time.monotonic() > end:
            proc.kill()
            pytest.fail(f"timed out waiting for {path}")
        time.sleep(0.005)


@pytest.fixture(autouse=True)
def _data_env(real_data, monkeypatch):
    monkeypatch.setenv("MT_DATA_DIR", str(real_data))


@pytest.mark.slow
@pytest.mark.parametrize("buckets", [0, 4])
def test_exact_resume_after_sigkill(tmp_path, real_data, buckets):
    """A run killed (SIGKILL) after its checkpoint at step N and restarted logs the same losses,
    step for step, as an uninterrupted run (dropout on, so RNG states matter); with shape
    buckets too (train.shape_buckets)."""
    N, total = 5, 15
    common = ["model.dropout=0.1", f"train.save_every={N}", f"train.shape_buckets={buckets}"]
    full = tmp_path / "full"
    train(_cfg(full, *common, f"train.max_steps={total}"))
    expected = _losses(full)
    assert sorted(expected) == list(range(1, total + 1))

    run = tmp_path / "killed"
    proc = _spawn(run, real_data, *common, "train.max_steps=1000")
    _wait_for(run / "checkpoints" / f"checkpoint_{N}.pt", proc)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    proc.stdout.close()
    resumed_from = load_checkpoint(run / "checkpoints" / "last.pt")["step"]
    assert N <= resumed_from < total, "the kill came too late to test anything"

    proc = _spawn(run, real_data, *common, f"train.max_steps={total}")
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out
    got = _losses(run)
    steps = [r["step"] for r in _records(run) if "loss" in r]
    assert steps == list(range(1, total + 1)), "each step logged once after the resume"
    for step in range(1, total + 1):
        assert got[step] == pytest.approx(expected[step], abs=1e-6, rel=0), step
    worst = max(abs(got[s] - expected[s]) for s in range(resumed_from + 1, total + 1))
    print(
        f"resumed from step {resumed_from}; max |loss diff| over steps "
        f"{resumed_from + 1}..{total}: {worst:.3g}"
    )
    final_a = load_checkpoint(full / "checkpoints" / "last.pt")["model"]
    final_b = load_checkpoint(run / "checkpoints" / "last.pt")["model"]
    for k in final_a:
        torch.testing.assert_close(final_b[k], final_a[k], rtol=0, atol=1e-6)


@pytest.mark.slow
def test_sigterm_saves_last_and_exits_cleanly(tmp_path, real_data):
    run = tmp_path / "run"
    proc = _spawn(run, real_data, "train.save_every=3", "train.max_steps=100000")
    _wait_for(run / "checkpoints" / "checkpoint_3.pt", proc)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == EXIT_PREEMPTED, out  # saved; "run me again" for a requeue script
    assert "SIGTERM received" in out
    ckpt = load_checkpoint(run / "checkpoints" / "last.pt", require_training=True)
    last_logged = max(_losses(run))
    assert ckpt["step"] == last_logged >= 3
    assert ckpt["data"]["batch"] > 0


def test_run_directory_and_checkpoint_contents(tmp_path):
    run = tmp_path / "run"
    result = train(
        _cfg(
            run,
            "train.max_steps=6",
            "train.save_every=2",
            "train.keep_last=2",
            "train.eval_every=3",
            "train.eval_bleu=true",
            "train.average_last=2",
        )
    )
    assert result["step"] == 6 and result["stop"] == "max_steps"
    assert (run / "config.yaml").is_file() and (run / "train.log").is_file()
    assert load_config([*TINY, f"run_dir={run}"]).model.d_model == 32
    records = _records(run)
    train_records = [r for r in records if "loss" in r]
    assert {"step", "epoch", "loss", "nll", "ppl", "lr", "tgt_tok_per_s", "wall"} <= set(
        train_records[0]
    )
    for r in train_records:
        assert r["ppl"] == pytest.approx(math.exp(r["nll"]))
        assert r["loss"] > r["nll"]  # label smoothing costs something on top of NLL
    valid = [r for r in records if "valid_loss" in r]
    assert [r["step"] for r in valid] == [3, 6]
    assert all("valid_bleu" in r and "valid_nll" in r for r in valid)
    ckpts = run / "checkpoints"
    assert [p.name for p in periodic_checkpoints(ckpts)] == ["checkpoint_4.pt", "checkpoint_6.pt"]
    last = load_checkpoint(ckpts / "last.pt", require_training=True)
    assert last["step"] == 6 and last["train_cfg"]["max_steps"] == 6
    _assert_averaged(run, "checkpoint_4.pt", "checkpoint_6.pt")
    best = load_checkpoint(ckpts / "best.pt")
    assert best["step"] in (3, 6)
    # best.pt is self-contained: model and tokenizer come back without the training config
    from mt.checkpoint import load_model
    from mt.data.build import prepare

    model, tokenizer, ckpt = load_model(ckpts / "best.pt", "cpu")
    assert not model.training and ckpt["step"] == best["step"]
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, best["model"][k])
    prepared = prepare(_cfg(run))
    lines = prepared.sources("valid")[:5]
    assert tokenizer.encode(lines, "src") == prepared.tokenizer.encode(lines, "src")
    # the average was validated in the run's own model: its figures are those of a fresh model
    # loaded from averaged.pt (not of the trained weights the run's model held before)
    from mt.train.validation import validate

    cfg, cpu = _cfg(run, "train.eval_bleu=true"), torch.device("cpu")
    expected = validate(load_model(ckpts / "averaged.pt", "cpu")[0], prepared, cfg, cpu)
    (logged,) = [r for r in records if "averaged" in r]
    assert logged["averaged"] == 2 and 0 < logged["rss_mb"] <= logged["peak_rss_mb"]
    assert set(expected) == {"valid_loss", "valid_nll", "valid_ppl", "valid_bleu"}
    for k, v in expected.items():
        assert logged[f"avg_{k}"] == pytest.approx(v, rel=1e-5), k
    trained = validate(load_model(ckpts / "last.pt", "cpu")[0], prepared, cfg, cpu)
    assert trained["valid_loss"] != pytest.approx(expected["valid_loss"], rel=1e-5)


def _assert_averaged(run: Path, *names: str) -> None:
    """averaged.pt is the element-wise mean of the named periodic checkpoints, and validated."""
    ckpts = run / "checkpoints"
    avg = load_checkpoint(ckpts / "averaged.pt")["model"]
    parts = [load_checkpoint(ckpts / name)["model"] for name in names]
    for k, v in avg.items():
        if v.is_floating_point():
            torch.testing.assert_close(v, sum(p[k] for p in parts) / len(parts))
    assert any("avg_valid_loss" in r for r in _records(run))


@pytest.mark.gpu
def test_a_run_on_the_gpu_averages_its_checkpoints_and_loads_on_the_cpu(tmp_path):
    """The end of a run on CUDA: the average is summed in the model on the GPU from files read
    on the CPU (a device mismatch there ended make gpu-check's Multi30k run on an H100)."""
    run = tmp_path / "run"
    result = train(_cfg(run, "train.device=cuda", "train.max_steps=4", "train.save_every=2",
                        "train.eval_every=2", "train.average_last=2"))  # fmt: skip
    assert result["step"] == 4
    _assert_averaged(run, "checkpoint_2.pt", "checkpoint_4.pt")
    from mt.checkpoint import load_model

    model, _, ckpt = load_model(run / "checkpoints" / "best.pt", "cpu")
    assert next(model.parameters()).device.type == "cpu" and ckpt["step"] in (2, 4)


def test_lr_follows_the_schedule(tmp_path):
    from mt.train.schedule import noam_factor, noam_lr

    run = tmp_path / "run"
    train(_cfg(run, "train.max_steps=4"))
    f = noam_factor(32, 10, lr=3e-3)
    for r in _records(run):
        if "lr" in r:
            assert r["lr"] == pytest.approx(noam_lr(r["step"], 32, 10, f), rel=1e-9)


def test_cooldown_decays_the_rate_to_zero_over_the_end_of_the_budget(tmp_path):
    """Update k (1-based) of a 10-step budget with cooldown 0.5 uses
    noam(k) * min(1, (1 - (k - 1) / 10) / 0.5): full rate up to update 6, then 0.8 ... 0.2."""
    from mt.train.schedule import noam_factor, noam_lr

    run = tmp_path / "run"
    train(_cfg(run, "train.max_steps=10", "train.cooldown=0.5"))
    f = noam_factor(32, 10, lr=3e-3)
    lrs = {r["step"]: r["lr"] for r in _records(run) if "lr" in r}
    assert sorted(lrs) == list(range(1, 11))
    for k, lr in lrs.items():
        expected = noam_lr(k, 32, 10, f) * min(1.0, (1 - (k - 1) / 10) / 0.5)
        assert lr == pytest.approx(expected, rel=1e-9)
    assert lrs[10] == pytest.approx(0.2 * noam_lr(10, 32, 10, f), rel=1e-9)


def test_budget_progress_takes_the_nearer_limit():
    from mt.schema import TrainConfig
    from mt.train.schedule import budget_progress
    from mt.train.state import TrainState

    state = TrainState(step=30, wall=90.0)
    assert budget_progress(TrainConfig(max_steps=100), state) == pytest.approx(0.3)
    assert budget_progress(TrainConfig(max_minutes=2.0), state) == pytest.approx(0.75)
    assert budget_progress(TrainConfig(max_steps=100, max_minutes=2.0), state) == 0.75
    assert budget_progress(TrainConfig(max_steps=20), state) == 1.0
    assert budget_progress(TrainConfig(), state) == 0.0


def test_cooldown_without_a_budget_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="train.cooldown needs a budget"):
        train(
            _cfg(tmp_path / "run", "train.max_steps=0", "train.max_epochs=1", "train.cooldown=0.2")
        )


def test_init_from_uses_weights_with_fresh_optimizer(tmp_path):
    first = tmp_path / "first"
    train(_cfg(first, "train.max_steps=3"))
    src = first / "checkpoints" / "last.pt"
    second = tmp_path / "second"
    # a vanishing learning rate: after one update the weights are still the loaded ones
    result = train(_cfg(second, "train.max_steps=1", "train.lr=1e-12", f"train.init_from={src}"))
    assert result["step"] == 1
    after = load_checkpoint(second / "checkpoints" / "last.pt", require_training=True)
    before = load_checkpoint(src)["model"]
    for k in before:
        torch.testing.assert_close(after["model"][k], before[k], rtol=0, atol=1e-6)
    adam_steps = {float(s["step"]) for s in after["optimizer"]["state"].values()}
    assert adam_steps == {1.0}
    assert _records(second)[0]["step"] == 1
    with pytest.raises(CheckpointError, match="model shape"):
        train(_cfg(tmp_path / "third", "model.d_ff=48", f"train.init_from={src}"))


def test_patience_stops_and_best_follows_the_metric(tmp_path, monkeypatch):
    values = iter([5.0, 4.0, 4.5, 4.2, 3.0, 1.0])

    def fake_validate(model, prepared, cfg, device, rank=0, world_size=1, loss_model=None):
        return {"valid_loss": next(values), "valid_nll": 1.0}

    monkeypatch.setattr("mt.train.recipe.validate", fake_validate)
    run = tmp_path / "run"
    result = train(
        _cfg(
            run,
            "train.max_steps=50",
            "train.eval_every=1",
            "train.patience=2",
            "train.best_metric=loss",
        )
    )
    # best at step 2 (4.0); steps 3 and 4 do not improve -> stop after step 4
    assert result["stop"] == "patience" and result["step"] == 4
    assert result["best"] == 4.0
    assert load_checkpoint(run / "checkpoints" / "best.pt")["step"] == 2


def test_nonfinite_updates_are_skipped_then_stop(tmp_path, monkeypatch, caplog):
    real = mt.train.update.batch_loss
    calls = {"n": 0}

    def sometimes_nan(*args):
        calls["n"] += 1
        loss, nll = real(*args)
        if calls["n"] == 3:  # the third update (accum_steps=1, no validation batches yet)
            return loss * float("nan"), nll
        return loss, nll

    monkeypatch.setattr(mt.train.update, "batch_loss", sometimes_nan)
    run = tmp_path / "run"
    result = train(_cfg(run, "train.max_steps=4", "train.eval_every=0"))
    assert result["step"] == 4
    assert sorted(_losses(run)) == [1, 2, 3, 4]
    assert "non-finite loss at update 3" in caplog.text
    assert all(math.isfinite(v) for v in _losses(run).values())

    def always_nan(*args):
        loss, nll = real(*args)
        return loss * float("nan"), nll

    monkeypatch.setattr(mt.train.update, "batch_loss", always_nan)
    with pytest.raises(NonFiniteError, match="3 consecutive updates"):
        train(_cfg(tmp_path / "nan", "train.max_steps=10", "train.max_nonfinite=3"))


class _InfGradient(torch.autograd.Function):
    """The identity forward; backward, an infinite gradient: overflows at every loss scale."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return torch.full_like(grad, float("inf"))


def test_fp16_overflow_at_every_scale_stops_with_one_error(tmp_path, monkeypatch, caplog):
    """An fp16 run whose gradient overflows at every scale (its loss finite) ends at
    train.min_loss_scale with one error line naming it and what to try, instead of halving the
    scale for ever with the step count standing still."""
    from mt.cli import user_errors

    real = mt.train.update.batch_loss

    def overflowing(*args):
        loss, nll = real(*args)
        return _InfGradient.apply(loss), nll

    monkeypatch.setattr(mt.train.update, "batch_loss", overflowing)
    # max_epochs: without the floor the run ends there (0 updates) instead of never
    cfg = _cfg(tmp_path / "run", "train.precision=fp16", "train.max_steps=5",
               "train.max_epochs=3", "train.min_loss_scale=1")  # fmt: skip
    with caplog.at_level("INFO"), pytest.raises(SystemExit) as stop, user_errors("mt-train"):
        train(cfg)
    assert stop.value.code == 1
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 1 and "train.min_loss_scale=1" in errors[0], errors
    assert "after 17 consecutive updates" in errors[0] and "train.precision=bf16" in errors[0]
    assert not _losses(tmp_path / "run")  # no update was applied


def test_accumulation_equals_one_big_batch(tmp_path):
    """accum_steps=2 with max_tokens=M normalises by the tokens of the whole update: its first
    update's loss equals the token-weighted mean of the two batches' losses."""
    from mt.data.batches import iterate_batches
    from mt.data.build import prepare
    from mt.model.transformer import build_model

    run = tmp_path / "run"
    cfg = _cfg(run, "train.max_steps=1", "train.accum_steps=2")
    train(cfg)
    got = _losses(run)[1]

    prepared = prepare(cfg)
    torch.manual_seed(cfg.train.seed)
    model = build_model(cfg.model, prepared.vocab_size)
    split = prepared.split("train")
    sampler = train_sampler(split, cfg)
    batches = list(iterate_batches(split, sampler, 0))[:2]
    total = ntok = 0.0
    for b in batches:
        with torch.no_grad():
            lp = torch.log_softmax(model(b.src, b.tgt_in), -1)
            loss, _ = label_smoothed_nll_loss(lp.view(-1, lp.size(-1)), b.tgt_out.reshape(-1), 0.1)
        total += float(loss)
        ntok += b.ntokens
    assert got == pytest.approx(total / ntok, rel=1e-5)


@pytest.mark.parametrize(("precision", "master"), [("bf16", False), ("fp16", False),
                                                 ("bf16", True)])  # fmt: skip
def test_mixed_precision_trains(tmp_path, precision, master):
    """bf16 and fp16 (a dynamic loss scale) under autocast, and bf16 on a 16-bit copy with
    float32 master weights, run, log finite losses and save float32 weights and the scaler
    state (fp16) for resume (fp16 with master weights: ``tests/test_master.py``)."""
    run = tmp_path / precision
    result = train(_cfg(run, "train.max_steps=6", f"train.precision={precision}",
                        f"train.master_weights={str(master).lower()}"))  # fmt: skip
    losses = _losses(run)
    assert result["step"] == 6 and all(math.isfinite(v) for v in losses.values())
    assert losses[6] < losses[1]
    ckpt = load_checkpoint(run / "checkpoints" / "last.pt", require_training=True)
    assert all(v.dtype == torch.float32 for v in ckpt["model"].values() if v.is_floating_point())
    if precision == "fp16":
        assert ckpt["scaler"]["scale"] > 0
    else:
        assert not ckpt["scaler"]


@pytest.mark.parametrize("native", [False, True])
def test_auto_precision_is_bf16_only_where_the_hardware_has_it(tmp_path, monkeypatch, native):
    """train.precision=auto (the Multi30k experiments') becomes bf16 where the probe measures
    it faster and fp32 elsewhere: every forward pass, training and validation, runs in it."""
    import mt.fast.probe

    figures = {"fp32": 1.0, "bf16": 0.5 if native else 2.0}
    monkeypatch.setattr(mt.fast.probe, "measure", lambda *a, **k: dict(figures))
    monkeypatch.setattr(mt.fast.probe, "_DECIDED", {})
    monkeypatch.setattr(mt.fast.probe.ProbeCache, "get", lambda self, key: None)
    # the given figures must not reach the shared probe cache: later runs would read them
    monkeypatch.setattr(mt.fast.probe.ProbeCache, "put", lambda self, key, entry: None)
    seen = []
    autocast = mt.train.update.autocast

    def spy(device, precision):
        seen.append(precision)
        return autocast(device, precision)

    monkeypatch.setattr(mt.train.update, "autocast", spy)
    result = train(_cfg(tmp_path / "run", "train.max_steps=3", "train.precision=auto"))
    assert result["step"] == 3
    assert seen and set(seen) == {"bf16" if native else "fp32"}


class _Bigram(torch.nn.Module):
    """A stub model: logits depend on the previous target token only."""

    def __init__(self, V: int = 12):
        super().__init__()
        self.table = torch.nn.Parameter(
            torch.randn(V, V, generator=torch.Generator().manual_seed(0))
        )

    def forward(self, src, tgt_in, real=None, project=True):
        logits = self.table[tgt_in]  # (B, T, V): here the "features" are the logits
        if real is None:
            return logits
        flat = logits.reshape(-1, logits.size(-1))  # (B*T, V)
        return flat if real.tgt is None else flat[real.tgt]

    def loss(self, h, target, smoothing):
        return label_smoothed_cross_entropy(h, target, smoothing, None)


@pytest.mark.parametrize("clip", [0.0, 0.05])
def test_updater_normalises_by_update_tokens_and_clips(clip):
    """One update over 2 accumulated batches (one a zero-weight filler) moves the weights by
    -lr * grad(sum of smoothed losses / real tokens), clipped to clip_norm: checked against
    autograd on the real batch alone."""
    from mt.data.batches import collate
    from mt.train.state import TrainState
    from mt.train.update import Updater

    cfg = load_config([*TINY, f"train.clip_norm={clip}"])
    real = collate([(np.array([4, 5]), np.array([6, 7, 8])), (np.array([9]), np.array([5]))])
    filler = collate([(np.array([4]), np.array([10, 11]))])
    filler.weight = 0.0
    model = _Bigram()
    start = model.table.detach().clone()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    update = Updater(model, model.parameters(), opt, sched, scaler, cfg, world_size=1)
    result = update([real, filler], TrainState())

    ref = _Bigram()
    lp = torch.log_softmax(ref(real.src, real.tgt_in), -1)
    loss, nll = label_smoothed_nll_loss(lp.view(-1, 12), real.tgt_out.reshape(-1), 0.1)
    (loss / real.ntokens).backward()
    grad = ref.table.grad
    assert result.ntokens == real.ntokens == 6  # 3 + EOS, 1 + EOS
    assert result.loss == pytest.approx(float(loss.detach()) / 6, rel=1e-6)
    assert result.nll == pytest.approx(float(nll.detach()) / 6, rel=1e-6)
    assert result.gnorm == pytest.approx(float(grad.norm()), rel=1e-5)
    if clip:
        grad = grad * clip / float(grad.norm())
    torch.testing.assert_close(start - model.table.detach(), grad)


def test_max_epochs_is_one_pass_over_the_data(tmp_path):
    from mt.data.build import prepare

    run = tmp_path / "run"
    cfg = _cfg(run, "train.max_epochs=1", "train.accum_steps=3", "train.log_every=1000")
    result = train(cfg)
    split = prepare(cfg).split("train")
    sampler = train_sampler(split, cfg)
    n_batches = len(sampler.batches(0))
    assert result["stop"] == "max_epochs" and result["epoch"] == 1
    assert result["step"] == math.ceil(n_batches / 3)
    assert [r["step"] for r in _records(run) if "loss" in r] == [1]  # step 1 is always logged


def test_max_minutes_stops_on_time(tmp_path, caplog):
    run = tmp_path / "run"
    with caplog.at_level(logging.INFO, logger="mt.train"):
        result = train(_cfg(run, "train.max_minutes=1e-5", "train.max_steps=1000"))
    assert result["stop"] == "max_minutes" and result["step"] == 1
    assert load_checkpoint(run / "checkpoints" / "last.pt")["step"] == 1
    # The run says which budget ended it, what the budget was, and on what machine.
    (end,) = [r for r in _records(run) if r.get("stage") == "train"]
    assert end["stop"] == "max_minutes" and end["step"] == 1
    assert end["budget"] == {"max_steps": 1000, "max_minutes": 1e-5, "max_epochs": 0,
                             "patience": 0}  # fmt: skip
    assert end["precision"] == "fp32" and end["machine"]["device"] == "cpu"
    assert end["machine"]["cpu"] and isinstance(end["machine"]["native_bf16"], bool)
    log = caplog.text
    assert "budget: 1,000 updates, or 1e-05 minutes (a cap), whichever comes first" in log
    assert "training stopped at step 1: the time cap (max_minutes)" in log


def test_validation_records_resident_memory(tmp_path):
    run = tmp_path / "run"
    train(_cfg(run, "train.max_steps=2", "train.eval_every=1"))
    valid = [r for r in _records(run) if "valid_loss" in r]
    assert [r["step"] for r in valid] == [1, 2]
    assert all(0 < r["rss_mb"] <= r["peak_rss_mb"] for r in valid)


def test_resuming_with_a_new_learning_rate_applies_it_and_says_so(tmp_path, caplog):
    """OpenNMT-py #1911's trap: a resumed optimiser state carries the old settings. Here a
    changed peak lr, weight decay (and its form) and Adam betas are applied to the resumed run,
    each logged."""
    import mt.train.recipe as recipe
    from mt import distributed
    from mt.train.schedule import noam_factor, noam_lr

    run = tmp_path / "run"
    train(_cfg(run, "train.max_steps=4", "train.lr=1e-3", "train.warmup=2"))
    cfg = _cfg(run, "train.max_steps=8", "train.lr=4e-3", "train.warmup=2",
               "train.weight_decay=0.01", "train.decoupled_weight_decay=false",
               "train.beta2=0.99")  # fmt: skip
    with caplog.at_level(logging.INFO, logger="mt.train"):
        r = recipe.setup(cfg, distributed.setup("cpu"))
    group = r.update.optimizer.param_groups[0]
    assert group["weight_decay"] == 0.01 and group["betas"] == (0.9, 0.99)
    assert group["decoupled_weight_decay"] is False
    noam = noam_lr(5, cfg.model.d_model, 2, noam_factor(cfg.model.d_model, 2, 1.0, 4e-3))
    assert group["lr"] == pytest.approx(noam)  # the new schedule's rate for update 5
    for text in ("train.lr 0.001 -> 0.004: applied", "train.weight_decay 0.0 -> 0.01: applied",
                 "train.decoupled_weight_decay True -> False: applied",
                 "train.beta2 0.98 -> 0.99: applied"):
        assert text in caplog.text
    assert r.state.step == 4 and r.update.optimizer.state  # Adam's moments came back
    r.metrics.close()


def test_train_reset_starts_the_named_parts_afresh(tmp_path, caplog):
    import mt.train.recipe as recipe
    from mt import distributed

    run = tmp_path / "run"
    train(_cfg(run, "train.max_steps=4", "train.eval_every=2", "train.lr=1e-3",
               "train.warmup=2"))  # fmt: skip
    cfg = _cfg(run, "train.max_steps=8", "train.lr=1e-3", "train.warmup=2",
               "train.reset=[optimizer,schedule,meters,data]")  # fmt: skip
    with caplog.at_level(logging.INFO, logger="mt.train"):
        r = recipe.setup(cfg, distributed.setup("cpu"))
    assert not r.update.optimizer.state  # fresh moments
    assert r.update.scheduler.last_epoch == 0  # warm-up again
    assert r.state.best is None and r.state.bad_evals == 0 and r.state.step == 4
    assert r.state.batch == 0
    for part in ("optimizer", "schedule", "meters", "data"):
        assert f"train.reset: {part}:" in caplog.text
    r.metrics.close()
    with pytest.raises(ValueError, match=r"train.reset: unknown \['optimiser'\]"):
        recipe.setup(_cfg(run, "train.reset=[optimiser]"), distributed.setup("cpu"))


def test_train_reset_is_applied_once_through_a_kill_and_two_resumes(tmp_path, real_data, caplog):
    """A requeued job repeats its command line: train.reset=[schedule] restarts the warm-up on
    the resume that first names it, which the checkpoints record; a kill and a second resume
    with the same list do not restart it again; train.reset_again=true does."""
    common = ["train.warmup=10", "train.save_every=2"]
    run = tmp_path / "run"
    last = run / "checkpoints" / "last.pt"
    train(_cfg(run, *common, "train.max_steps=4"))

    proc = _spawn(run, real_data, *common, "train.reset=[schedule]", "train.max_steps=1000")
    _wait_for(run / "checkpoints" / "checkpoint_6.pt", proc)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    out = proc.stdout.read()
    proc.stdout.close()
    assert "train.reset=[schedule]: applied at step 4" in out, out
    killed = load_checkpoint(last, require_training=True)
    k = killed["step"]
    assert k >= 6 and killed["state"]["resets"] == [{"step": 4, "parts": ["schedule"]}]

    with caplog.at_level(logging.INFO, logger="mt.train"):
        train(_cfg(run, *common, "train.reset=[schedule]", f"train.max_steps={k + 2}"))
    assert "train.reset=[schedule]: not applied again: last.pt" in caplog.text
    assert "(applied at step 4)" in caplog.text
    lrs = {r["step"]: r["lr"] for r in _records(run) if "lr" in r}
    assert sorted(lrs) == list(range(1, k + 3))
    for step in range(5, k + 3):  # one warm-up from step 4 on, through the kill
        assert lrs[step] == pytest.approx(lrs[step - 4]), step
    assert load_checkpoint(last)["state"]["resets"] == killed["state"]["resets"]

    caplog.clear()
    with caplog.at_level(logging.INFO, logger="mt.train"):
        train(_cfg(run, *common, "train.reset=[schedule]", "train.reset_again=true",
                   f"train.max_steps={k + 4}"))  # fmt: skip
    assert f"train.reset=[schedule]: applied at step {k + 2}" in caplog.text
    lrs = {r["step"]: r["lr"] for r in _records(run) if "lr" in r}
    assert [lrs[k + 3], lrs[k + 4]] == pytest.approx([lrs[1], lrs[2]])
    assert load_checkpoint(last)["state"]["resets"] == [
        {"step": 4, "parts": ["schedule"]}, {"step": k + 2, "parts": ["schedule"]}
    ]


@pytest.mark.parametrize(("stored", "now", "again", "applied"), [
    (["schedule"], ["schedule"], False, []),  # the same list: applied when that run started
    (["schedule"], ["optimizer", "schedule"], False, ["optimizer", "schedule"]),  # a new list
    ([], ["schedule"], False, ["schedule"]),
    (["meters", "schedule"], ["schedule", "meters"], False, []),  # order does not matter
    (["schedule"], ["schedule"], True, ["schedule"]),  # train.reset_again
])  # fmt: skip
def test_which_resets_a_resume_applies(stored, now, again, applied):
    from mt.train.state import resets_to_apply

    cfg = load_config([f"train.reset=[{','.join(now)}]", f"train.reset_again={again}"])
    resume = {"train_cfg": {"reset": stored}, "state": {"resets": []}}
    assert resets_to_apply(cfg.train, resume, Path("last.pt")) == applied
    assert resets_to_apply(cfg.train, None, None) == now  # a new run: nothing to skip
