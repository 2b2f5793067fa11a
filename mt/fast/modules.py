"""Copies of a model that share its parameters, and module replacement in them: how ``mt.fast``
applies its kernels from outside without touching the model the caller holds."""

from __future__ import annotations

import copy
from collections.abc import Callable

from torch import nn


def shared_copy(model: nn.Module) -> nn.Module:
    """A copy of ``model`` whose parameters and buffers ARE the model's (not copied): its
    state dict equals the model's, and an optimiser over ``model.parameters()`` updates both."""
    shared = {id(t): t for t in (*model.parameters(), *model.buffers())}
    return copy.deepcopy(model, memo=shared)


def replace_modules(model: nn.Module, rule: Callable[[nn.Module], nn.Module | None]) -> None:
    """In place: every submodule for which ``rule(child)`` returns a module becomes that module
    (None: kept)."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            new = rule(child)
            if new is not None:
                setattr(parent, name, new)
