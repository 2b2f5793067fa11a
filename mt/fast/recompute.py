"""Activation checkpointing per layer (``train.activation_checkpointing``): each encoder and
decoder layer of the training copy keeps only its inputs for the backward pass and runs its
forward pass again there (``torch.utils.checkpoint``, non-reentrant), so a step holds one
layer's activations at a time instead of all of them, for about one more forward pass of the
layers (fairseq's ``--checkpoint-activations``).

The gradients are the plain step's: the second forward pass draws the same dropout masks
(``preserve_rng_state``: torch's generator is put back where it stood, and mt's dropout kernel
draws its seed from that generator, ``mt.fast.dropout``), and a packed copy's layers see the
rows of their own batch again (:class:`Checkpointed` holds them, ``mt.fast.packing``).

Non-reentrant checkpointing composes with what the step wraps around the layers: autocast
(the state of the forward pass is replayed), ``torch.compile`` (Dynamo traces it) and DDP
(gradients arrive through the usual autograd hooks, once each).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from mt.fast.packing import InFlight


class Checkpointed(nn.Module):
    """A layer whose activations are recomputed in the backward pass (module docstring): in
    training mode with gradients on, its forward pass runs under
    :func:`torch.utils.checkpoint.checkpoint`; elsewhere (validation, decoding) as it is.

    Args:
        layer: the encoder or decoder layer (its parameters stay its own: the state dict of a
            model holding it names them ``...layer.<name>``, so wrap copies only).
        in_flight: the packed products' rows (``mt.fast.packing.pack``) or None; the rows of
            the forward pass are put back while the layer runs again, so a forward pass of
            another batch in between (accumulation, a validation) cannot change what is
            recomputed.
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
    """In place (pass a copy: ``mt.fast.modules.shared_copy``): every encoder and decoder layer
    of ``model`` becomes :class:`Checkpointed`. Returns how many layers were wrapped."""
    wrapped = 0
    for stack in (model.encoder, model.decoder):
        for i, layer in enumerate(stack):
            if not isinstance(layer, Checkpointed):
                stack[i] = Checkpointed(layer, in_flight)
                wrapped += 1
    return wrapped
