"""Activation checkpointing (train.activation_checkpointing, mt.fast.recompute): the same
gradients as the plain step, bit for bit, with dropout on, and less kept for the backward."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mt.data.batches import collate
from mt.fast import for_training
from mt.fast.recompute import Checkpointed
from mt.model.transformer import build_model
from mt.schema import ModelConfig
from mt.train.update import batch_loss

CPU = torch.device("cpu")
CFG = ModelConfig(N=2, d_model=32, d_ff=64, h=4, dropout=0.3)  # dropout on: masks must replay


def _batch(seed: int, shapes):
    rng = np.random.default_rng(seed)
    # lengths far apart: more than a tenth of each side is padding, so the copy packs
    return collate([(rng.integers(4, 50, n), rng.integers(4, 50, m)) for n, m in shapes])


BATCH = _batch(0, [(3, 9), (12, 4), (7, 7), (2, 11)])
OTHER = _batch(1, [(9, 2), (2, 3), (5, 12)])


@pytest.fixture(autouse=True)
def _onednn_products(monkeypatch):
    """oneDNN's products where this torch has them, without timing them first (the probe
    chooses for speed; what is tested here holds for either choice)."""
    import mt.fast.training as training

    for probed in ("onednn_products", "onednn_projection"):
        monkeypatch.setattr(training, probed, lambda *a, **k: training.onednn_available())


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return build_model(CFG, 50)


def _step(model, checkpointing: bool, cpu_kernels: bool, precision: str = "fp32"):
    return for_training(model, CPU, cpu_kernels=cpu_kernels, precision=precision, tokens=64,
                        activation_checkpointing=checkpointing)  # fmt: skip


def _grads(model, step, precision="fp32", between=None):
    """The gradients of BATCH's loss (dropout drawn from seed 5) and the bytes autograd kept
    for the backward pass; ``between``: a batch whose forward pass runs before that backward."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(5)
    saved = [0]

    def pack(t):
        saved[0] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss, _ = batch_loss(step, BATCH, 0.1, precision)
    if between is not None:
        batch_loss(step, between, 0.1, precision)  # its graph is dropped unused
    loss.backward()
    return [p.grad.clone() for p in model.parameters()], saved[0]


@pytest.mark.parametrize(
    "cpu_kernels, precision", [(True, "fp32"), (True, "bf16"), (False, "fp32")]
)
def test_gradients_equal_the_plain_step_bit_for_bit(model, cpu_kernels, precision):
    """The recomputed forward pass is the same computation on the same inputs, with the same
    dropout masks (torch's generator restored; mt's kernel seeds from it), so every gradient
    is bitwise the plain step's: no tolerance is needed, and none is given."""
    plain, plain_saved = _grads(model, _step(model, False, cpu_kernels, precision), precision)
    ckpt, ckpt_saved = _grads(model, _step(model, True, cpu_kernels, precision), precision)
    assert all(torch.equal(a, b) for a, b in zip(plain, ckpt))
    assert any(a.abs().sum() > 0 for a in plain)
    # what makes it checkpointing: the layers' activations are not kept
    assert ckpt_saved < plain_saved / 4, (ckpt_saved, plain_saved)


def test_the_packed_rows_of_the_forward_pass_are_recomputed(model):
    """A forward pass of another batch between a batch's forward and backward (which packs
    other rows) leaves the recomputation on the rows of its own batch."""
    plain, _ = _grads(model, _step(model, False, True))
    ckpt, _ = _grads(model, _step(model, True, True), between=OTHER)
    assert all(torch.equal(a, b) for a, b in zip(plain, ckpt))


def test_only_the_training_copy_is_wrapped(model):
    """The caller's model keeps its layers and state dict; validation (eval, no gradients)
    runs the layers as they are, with the plain step's outputs."""
    keys = list(model.state_dict())
    step = _step(model, True, False)
    assert all(isinstance(layer, Checkpointed) for layer in step.model.encoder)
    assert all(isinstance(layer, Checkpointed) for layer in step.model.decoder)
    assert not any(isinstance(m, Checkpointed) for m in model.modules())
    assert list(model.state_dict()) == keys
    assert {id(p) for p in step.parameters()} == {id(p) for p in model.parameters()}
    step.eval()
    with torch.no_grad():
        got = step(BATCH.src, BATCH.tgt_in, BATCH.real)
        want = _step(model, False, False).eval()(BATCH.src, BATCH.tgt_in, BATCH.real)
    assert torch.equal(got, want)
    model.train()


def test_checkpointed_training_under_ddp(model, tmp_path):
    """Under DDP (one gloo rank) the gradients arrive once each, equal to the plain step's."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    plain, _ = _grads(model, _step(model, False, True))
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        wrapped = DDP(_step(model, True, True))
        got, _ = _grads(model, wrapped)
    finally:
        dist.destroy_process_group()
    assert all(torch.equal(a, b) for a, b in zip(plain, got))
