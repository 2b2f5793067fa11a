"""The update step waits for the device at most once: on a CPU the step-or-skip read of
``_all_finite``; with the check kept on the device (a GPU's default), not at all.

Method (CPU): a ``TorchFunctionMode`` sees every torch function and Tensor method called from
Python during one ``Updater`` call (forward, loss, backward of the fused loss, clipping, Adam,
schedule) and records each call that makes the host wait for a GPU: ``item``, ``tolist``,
``bool``/``float``/``int`` of a tensor, ``nonzero`` and other ops whose output size depends on
the data, boolean-mask indexing, copies to the host (``cpu``, ``numpy``), ``equal``... The one
allowed read goes through ``mt.train.update._all_finite``, which the test lets through and counts.
Kernels launched from C++ are not seen, but the synchronising calls are made from Python.
Each "would it catch it" test injects one such call into the step and expects it recorded.
On a GPU, ``torch.cuda.set_sync_debug_mode("error")`` checks the same on the device.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch.overrides import TorchFunctionMode

import mt.train.update
from mt.config import load_config
from mt.data.batches import collate
from mt.model.transformer import build_model
from mt.train.state import TrainState
from mt.train.update import Updater, batch_loss, build_optimizer
from mt.vocab import PAD

V = 40
# Calls that make the host wait for the device (or whose output size depends on the data).
SYNCING = {
    "item", "tolist", "__bool__", "__float__", "__int__", "__index__", "__complex__", "nonzero",
    "argwhere", "masked_select", "unique", "unique_consecutive", "equal", "allclose",
    "is_nonzero", "cpu", "numpy", "bincount", "histc", "_local_scalar_dense",
}  # fmt: skip


def _bool_index(args) -> bool:
    index = args[1] if len(args) > 1 else None
    parts = index if isinstance(index, (tuple, list)) else (index,)
    return any(isinstance(p, torch.Tensor) and p.dtype == torch.bool for p in parts)


class SyncRecorder(TorchFunctionMode):
    """Records the synchronising calls made while it is active (see the module docstring)."""

    def __init__(self):
        super().__init__()
        self.calls: list[str] = []
        self.paused = False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", str(func))
        if not self.paused:
            if name in SYNCING:
                self.calls.append(name)
            elif name == "__getitem__" and _bool_index(args):
                self.calls.append("boolean-mask indexing")
            elif name == "repeat_interleave" and "output_size" not in (kwargs or {}):
                self.calls.append(name)
        return func(*args, **(kwargs or {}))


def _update(precision="fp32", clip=1.0, loss_fn=None, device="cpu", defer_check=None):
    cfg = load_config(
        [
            "model.N=1", "model.d_model=16", "model.d_ff=32", "model.h=2", "model.dropout=0.1",
            f"train.precision={precision}", f"train.clip_norm={clip}",
        ]
    )  # fmt: skip
    torch.manual_seed(0)
    model = build_model(cfg.model, V).to(device).train()
    opt = build_optimizer(model.parameters(), cfg.train, torch.device(device))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1e-3)
    scaler = torch.amp.GradScaler(torch.device(device).type, enabled=precision == "fp16")
    return Updater(model, model.parameters(), opt, sched, scaler, cfg, 1, loss_fn, defer_check)


def _batches(device="cpu"):
    rng = np.random.default_rng(0)
    pairs = [(rng.integers(4, V, n), rng.integers(4, V, m)) for n, m in [(5, 2), (2, 6), (4, 4)]]
    real = collate(pairs)  # padding on both sides
    assert real.real.src is not None and real.real.tgt is not None
    filler = collate(pairs[:1])  # no padding, weight 0 (the shortfall of a rank)
    filler.weight = 0.0
    return [real.to(device), filler.to(device)]


def syncs_in_update(update: Updater, batches, monkeypatch) -> tuple[list[str], int]:
    """(the synchronising calls of one update, how often the allowed read was made)."""
    recorder = SyncRecorder()
    reads = []

    def allowed_read(flag):
        recorder.paused = True
        try:
            reads.append(flag)
            return bool(flag)
        finally:
            recorder.paused = False

    monkeypatch.setattr(mt.train.update, "_all_finite", allowed_read)
    with recorder:
        result = update(batches, TrainState())
    assert result is not None
    return recorder.calls, len(reads)


@pytest.mark.parametrize("precision,clip", [("fp32", 1.0), ("fp32", 0.0), ("bf16", 1.0)])
def test_update_reads_the_device_once(precision, clip, monkeypatch):
    update = _update(precision, clip)
    calls, reads = syncs_in_update(update, _batches(), monkeypatch)
    assert calls == [], f"the update step waits for the device: {calls}"
    assert reads == 1


def _item_loss(model, batch, eps, precision):
    loss, nll = batch_loss(model, batch, eps, precision)
    loss.item()  # the kind of call that must not creep in
    return loss, nll


def _masked_loss(model, batch, eps, precision):
    loss, nll = batch_loss(model, batch, eps, precision)
    _ = batch.tgt_out[batch.tgt_out != PAD]  # boolean-mask indexing: a nonzero inside
    return loss, nll


def _float_loss(model, batch, eps, precision):
    loss, nll = batch_loss(model, batch, eps, precision)
    if float(nll.detach()) < 0:  # a host-side decision on a device value
        raise AssertionError
    return loss, nll


@pytest.mark.parametrize(
    "loss_fn,expected",
    [(_item_loss, "item"), (_masked_loss, "boolean-mask indexing"), (_float_loss, "__float__")],
)
def test_the_check_catches_an_added_sync(loss_fn, expected, monkeypatch):
    """The recorder is not blind: one synchronising call per batch is found."""
    calls, _ = syncs_in_update(_update(loss_fn=loss_fn), _batches(), monkeypatch)
    assert calls == [expected, expected]


def test_the_update_figures_stay_on_the_device_until_read(monkeypatch):
    """UpdateResult holds a device tensor; its properties are the (only) reads."""
    update = _update()
    recorder = SyncRecorder()
    with recorder:
        result = update(_batches(), TrainState())
    assert isinstance(result.figures, torch.Tensor) and result.figures.shape == (4,)
    assert recorder.calls == ["__bool__"]  # the step-or-skip decision alone
    assert result.ntokens == 2 + 1 + 6 + 1 + 4 + 1  # each target + EOS (the filler: weight 0)


def test_one_collective_after_the_backward_passes(monkeypatch):
    """No barrier before the forward: the update's only all-reduce carries the loss, NLL and
    target tokens, after every backward pass (the gradients exist when it runs)."""
    update = _update()
    seen = []
    real = mt.train.update.distributed.all_reduce_sum

    def spy(t):
        seen.append((tuple(t.shape), all(p.grad is not None for p in update.params)))
        return real(t)

    monkeypatch.setattr(mt.train.update.distributed, "all_reduce_sum", spy)
    result = update(_batches(), TrainState())
    assert seen == [((3,), True)] and result.ntokens == 15


def test_the_check_on_the_device_reads_nothing(monkeypatch):
    """With the finite check kept on the device, an update makes no synchronising call at all
    (the recorder, with ``_all_finite`` counted as a read)."""
    update = _update(defer_check=True)
    calls, reads = syncs_in_update(update, _batches(), monkeypatch)
    assert calls == [] and reads == 0


def _nan_loss(model, batch, eps, precision):
    loss, nll = batch_loss(model, batch, eps, precision)
    return loss * float("nan"), nll


def test_a_non_finite_update_is_skipped_on_the_device(caplog):
    """A non-finite update leaves the weights and Adam's moments and step count as they were
    (the fused kernel's ``found_inf``), a finite one steps; ``check`` logs the skips when it
    reads them and stops after ``train.max_nonfinite`` in a row, as the host check does."""
    update = _update(defer_check=True)
    state = TrainState()
    update(_batches(), state)  # one good update: Adam has moments now
    before = [p.detach().clone() for p in update.params]
    moments = [update.optimizer.state[p]["exp_avg"].clone() for p in update.params]
    steps = [float(update.optimizer.state[p]["step"]) for p in update.params]
    update.loss_fn = _nan_loss
    update(_batches(), state)
    assert all(torch.equal(a, p) for a, p in zip(before, update.params))
    assert all(torch.equal(m, update.optimizer.state[p]["exp_avg"])
               for m, p in zip(moments, update.params))  # fmt: skip
    assert [float(update.optimizer.state[p]["step"]) for p in update.params] == steps
    assert update.scheduler.last_epoch == 2  # the schedule moves on
    with caplog.at_level("WARNING", logger="mt.train.update"):
        update.check(state)
    assert "1 update(s) skipped" in caplog.text and state.nonfinite == 1
    update.loss_fn = batch_loss
    update(_batches(), state)  # finite again: it steps, and the streak ends
    assert not all(torch.equal(a, p) for a, p in zip(before, update.params))
    update.check(state)
    assert state.nonfinite == 0
    update.loss_fn = _nan_loss
    for _ in range(update.tc.max_nonfinite):
        update(_batches(), state)
    with pytest.raises(mt.train.update.NonFiniteError, match="train.max_nonfinite=10"):
        update.check(state)


@pytest.mark.gpu
def test_update_on_a_gpu_makes_no_synchronising_call():
    """torch's own check: ``set_sync_debug_mode("error")`` raises on any synchronising CUDA
    call; on a GPU the step-or-skip decision stays on the device, so nothing is let through."""
    update = _update("bf16", device="cuda")
    update(_batches("cuda"), TrainState())  # warm-up: lazy initialisation may synchronise
    torch.cuda.synchronize()
    batches = [b.pin_memory().to("cuda") for b in _batches()]
    torch.cuda.set_sync_debug_mode("error")
    try:
        result = update(batches, TrainState())
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert result is not None and result.ntokens == 15


def _adam_by_hand(p, grads, lrs, tc, decoupled):
    """Adam's updates written out (float64), with weight decay in either form."""
    m, v = torch.zeros_like(p), torch.zeros_like(p)
    for t, (g, lr) in enumerate(zip(grads, lrs), start=1):
        if decoupled:
            p = p * (1 - lr * tc.weight_decay)
        else:
            g = g + tc.weight_decay * p
        m = tc.beta1 * m + (1 - tc.beta1) * g
        v = tc.beta2 * v + (1 - tc.beta2) * g * g
        m_hat, v_hat = m / (1 - tc.beta1**t), v / (1 - tc.beta2**t)
        p = p - lr * m_hat / (v_hat.sqrt() + tc.eps)
    return p


@pytest.mark.parametrize("decoupled", [True, False])
def test_weight_decay_matches_the_textbook_step(decoupled):
    """Three updates of the optimiser mt builds (fused Adam on a CPU) against Adam written out by
    hand: decoupled decay shrinks the weight by lr * wd beside the step (fairseq's Adam,
    Loshchilov & Hutter's AdamW); the L2 form adds wd * p to the gradient before the moments."""
    cfg = load_config(["train.weight_decay=0.5", f"train.decoupled_weight_decay={decoupled}"])
    gen = torch.Generator().manual_seed(0)
    p0 = torch.randn(7, 5, generator=gen, dtype=torch.float64)
    grads = [torch.randn(7, 5, generator=gen, dtype=torch.float64) for _ in range(3)]
    lrs = [3e-2, 2e-2, 1e-2]
    param = torch.nn.Parameter(p0.float().clone())
    opt = build_optimizer([param], cfg.train, torch.device("cpu"))
    assert opt.defaults["fused"]  # the path training takes
    for g, lr in zip(grads, lrs):
        for group in opt.param_groups:
            group["lr"] = lr  # as the schedule sets it (the base rate is 1.0)
        param.grad = g.float()
        opt.step()
    got = param.detach().double()
    mine = _adam_by_hand(p0, grads, lrs, cfg.train, decoupled)
    other = _adam_by_hand(p0, grads, lrs, cfg.train, not decoupled)
    torch.testing.assert_close(got, mine, rtol=1e-5, atol=1e-6)
    assert (got - other).abs().max() > 1e-4  # the two forms are told apart at this decay


def _overflow_at_every_scale(update: Updater) -> list:
    """Hooks writing inf into every gradient: the loss stays finite, the gradient overflows
    whatever the loss scale (the removable handles)."""
    return [p.register_hook(lambda g: torch.full_like(g, float("inf"))) for p in update.params]


def test_fp16_stops_at_the_minimum_loss_scale(caplog):
    """fp16 on the CPU's GradScaler: a gradient that overflows at every scale halves the scale
    at each skipped update, without counting towards train.max_nonfinite; the run stops with
    one FloatingPointError naming train.min_loss_scale once the scale is below it (30 halvings
    from 2^16 to under 1e-4), WARNING lines from the 10th overflow in a row on. A good update
    ends a streak."""
    update = _update("fp16", clip=0.0)
    assert update.scaler.is_enabled() and update.scaler.get_scale() == 2.0**16
    state = TrainState()
    hooks = _overflow_at_every_scale(update)
    for _ in range(3):
        assert update(_batches(), state) is None
    assert update.overflows == 3 and update.scaler.get_scale() == 2.0**13
    for h in hooks:
        h.remove()
    assert update(_batches(), state) is not None  # finite: a step, the streak is over
    assert update.overflows == 0
    update, state = _update("fp16", clip=0.0), TrainState()
    _overflow_at_every_scale(update)
    caplog.clear()  # the streak above may have been recorded too (another test set INFO)
    expected = math.floor(math.log2(2.0**16 / update.tc.min_loss_scale)) + 1  # halvings to < 1e-4
    with caplog.at_level("INFO", logger="mt.train.update"):
        with pytest.raises(FloatingPointError, match=r"train\.min_loss_scale=0\.0001") as err:
            for _ in range(200):  # without a floor this never ends
                update(_batches(), state)
    assert isinstance(err.value, mt.train.update.NonFiniteError)  # the CLI's one error line
    assert "train.precision=bf16" in str(err.value) and "train.clip_norm" in str(err.value)
    # overflows are not non-finite updates
    assert update.overflows == expected == 30 and state.nonfinite == 0
    levels = [r.levelname for r in caplog.records if "loss scale lowered" in r.message]
    assert levels == ["INFO"] * 9 + ["WARNING"] * (expected - 10)
    assert "29 consecutive overflow(s)" in caplog.records[-1].message


def test_fp16_min_loss_scale_must_be_positive():
    cfg = load_config(["train.precision=fp16", "train.min_loss_scale=0"])
    model = build_model(cfg.model, V)
    opt = build_optimizer(model.parameters(), cfg.train, torch.device("cpu"))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    with pytest.raises(ValueError, match="train.min_loss_scale must be > 0"):
        Updater(model, model.parameters(), opt, sched, torch.amp.GradScaler("cpu"), cfg, 1)
