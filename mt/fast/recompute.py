"""Activation checkpointing per layer (``train.activation_checkpointing``, fairseq's
``--checkpoint-activations``): each encoder and decoder layer of the training copy keeps only its
inputs and runs its forward pass again in the backward pass (``torch.utils.checkpoint``,
non-reentrant, which composes with autocast, ``torch.compile`` and DDP). The gradients are the
plain step's: the second pass draws the same dropout masks (``preserve_rng_state``; mt's dropout
kernel seeds from torch's generator) and a packed copy's layers see their batch's rows again.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from mt.fast.packing import InFlight


class Checkpointed(nn.Module):
    """``layer`` recomputing its activations in the backward pass, in training mode with
    gradients on (elsewhere it runs as it is). A model holding it names its parameters
    ``...layer.<name>``, so wrap copies only. The packed rows of ``in_flight`` (or None) are
    put back while the layer runs again, so a forward pass of another batch in between
    (accumulation, a validation) cannot change what is recomputed.
    """

    def __init__(self, layer: nn.Module, in_flight: InFlight | None = None) -> None:
        super().__init__()
        self.layer, self.in_flight = layer, in_flight

    def forward(self, *args):
        if not (self.training and torch.is_grad_enabled()):
            return self.layer(*args)
        rows = None if self.in_flight is None else _rows(self.in_flight)

        def run(*inputs):
            if rows is None:
                return self.layer(*inputs)
            now = _rows(self.in_flight)
            _set_rows(self.in_flight, rows)
            try:
                return self.layer(*inputs)
            finally:
                _set_rows(self.in_flight, now)

        return checkpoint(run, *args, use_reentrant=False, preserve_rng_state=True)


_ROWS = ("src", "tgt", "src_pad", "tgt_pad")


def _rows(in_flight: InFlight) -> tuple:
    return tuple(getattr(in_flight, name) for name in _ROWS)


def _set_rows(in_flight: InFlight, rows: tuple) -> None:
    for name, value in zip(_ROWS, rows):
        setattr(in_flight, name, value)


def checkpoint_layers(model: nn.Module, in_flight: InFlight | None = None) -> int:
    """In place (pass a copy): every encoder and decoder layer of ``model`` becomes
    :class:`Checkpointed`. Returns how many were wrapped."""
    wrapped = 0
    for stack in (model.encoder, model.decoder):
        for i, layer in enumerate(stack):
            if not isinstance(layer, Checkpointed):
                stack[i] = Checkpointed(layer, in_flight)
                wrapped += 1
    return wrapped
