"""16-bit training with float32 master weights (``train.master_weights``): fairseq's ``--bf16``
/ ``--fp16``, Marian's ``--precision float16 float32``, apex's O2.

Autocast keeps the model in float32 and casts every weight on its way into a product, the input
and output of every LayerNorm and products' outputs meeting the float32 residual stream: hundreds
of casts an update, a sizeable share of a GPU's kernel time (docs/performance.md). Here the
passes run on a 16-bit working copy without autocast; before each update it takes the float32
masters' values, after the backward passes they take its gradients as float32 (one multi-tensor
copy each), so clipping, the finite check, fp16's loss scale, Adam and checkpoints see float32.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


class MasterWeights:
    """``model``, a 16-bit working copy (``precision`` bf16 or fp16; tied weights still tied),
    and ``params``, the float32 model's parameters it follows (the masters, not modified)."""

    def __init__(self, model: nn.Module, precision: str) -> None:
        if precision not in DTYPES:
            raise ValueError(
                f"train.master_weights needs train.precision bf16 or fp16, got {precision!r}"
            )
        self.params = list(model.parameters())
        self.model = _copy_in(model, DTYPES[precision])
        self._working = list(self.model.parameters())
        if [p.shape for p in self._working] != [p.shape for p in self.params]:
            raise RuntimeError("the working copy's parameters do not match the model's")
        self._grads: list[torch.Tensor | None] = [None] * len(self.params)

    @torch.no_grad()
    def pull(self) -> None:
        """The working copy takes the masters' values (rounded to 16 bits). Before an update's
        passes (its gradients are None then: :meth:`push_grads` took them)."""
        torch._foreach_copy_(self._working, self.params)

    @torch.no_grad()
    def push_grads(self) -> None:
        """The masters take the working copy's gradients, as float32 (kept buffers, one per
        parameter, so nothing is allocated after the first update). After the backward
        passes; a parameter without a gradient keeps none. The working copy's gradients are
        let go (None), so its next passes start afresh."""
        to, frm = [], []
        for i, (master, work) in enumerate(zip(self.params, self._working)):
            if work.grad is None:
                master.grad = None
                continue
            if self._grads[i] is None:
                self._grads[i] = torch.empty_like(master)
            master.grad = self._grads[i]
            to.append(master.grad)
            frm.append(work.grad)
        if to:
            torch._foreach_copy_(to, frm)
        for p in self._working:
            p.grad = None


def _copy_in(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """A copy of ``model`` whose parameters and floating-point buffers are new ``dtype`` tensors
    (tied ones stay tied), each converted once, not copied first: no float32 double of the
    model, and fake tensors stay in their fake mode."""
    memo: dict[int, object] = {}
    for p in model.parameters():
        memo[id(p)] = nn.Parameter(p.detach().to(dtype), requires_grad=p.requires_grad)
    for b in model.buffers():
        memo[id(b)] = b.detach().to(dtype) if b.is_floating_point() else b
    return copy.deepcopy(model, memo)
