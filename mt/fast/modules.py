"""Copies of a model that share its parameters, and module replacement in them: how ``mt.fast``
applies its kernels from outside without touching the model the caller holds."""

from __future__ import annotations

import copy
from collections.abc import Callable

from torch import nn

from mt.model.transformer import FeedForward


def shared_copy(model: nn.Module) -> nn.Module:
    """A copy of ``model`` whose parameters and buffers ARE the model's (not copied): its
    state dict equals the model's, and an optimiser over ``model.parameters()`` updates both."""
    shared = {id(t): t for t in (*model.parameters(), *model.buffers())}
    return copy.deepcopy(model, memo=shared)


def replace_modules(model: nn.Module, rule: Callable[[nn.Module], nn.Module | None]) -> int:
    """In place: every submodule for which ``rule(child)`` returns a module becomes that module
    (None: kept). Returns how many were replaced."""
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            new = rule(child)
            if new is not None:
                setattr(parent, name, new)
                replaced += 1
    return replaced


def products_copy(
    model: nn.Module,
    feed_forward: Callable[[nn.Module], nn.Module],
    linear: Callable[[nn.Linear], nn.Module],
) -> nn.Module:
    """A decoding copy of ``model`` (``shared_copy``, eval mode) whose products are replaced:
    each feed-forward block (``mt.model.transformer.FeedForward``) by ``feed_forward(block)``,
    each other ``nn.Linear`` by ``linear(layer)``. The int8, oneDNN and mt float32 copies of
    ``mt.fast`` are made so."""

    def rule(child: nn.Module) -> nn.Module | None:
        if isinstance(child, FeedForward):
            return feed_forward(child)
        return linear(child) if type(child) is nn.Linear else None

    clone = shared_copy(model).eval()
    replace_modules(clone, rule)
    return clone
