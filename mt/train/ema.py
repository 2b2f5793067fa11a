"""An exponential moving average of the weights (``train.ema``), kept beside training.

After update n the average moves towards the weights by ``1 - d_n``::

    avg <- d_n * avg + (1 - d_n) * w,    d_n = min(decay, (1 + n) / (10 + n))

The ramp ``(1 + n) / (10 + n)`` (TensorFlow's ``ExponentialMovingAverage`` with
``num_updates``, OpenNMT's ``average_decay``) keeps the first updates from dragging the random
initial weights along: with decay 0.999 the average forgets them within its first few thousand
updates instead of carrying ``0.999 ** n`` of them (fairseq's ``--ema-decay`` and Marian's
``--exponential-smoothing`` offer one too). The average is float32, on the weights' device, and
saved in every full checkpoint (``ema``), so a resumed run's average is the uninterrupted one's;
:func:`mt.train.snapshots.ema_into_best` ends a run with it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import torch

log = logging.getLogger(__name__)


def decay_at(decay: float, n: int) -> float:
    """The decay applied at update ``n`` (1-based): ``min(decay, (1 + n) / (10 + n))``."""
    return min(decay, (1.0 + n) / (10.0 + n))


class WeightEMA:
    """The moving average of ``params`` (a model's ``parameters()``: shared ones once), with
    ``decay`` in (0, 1) once the ramp is past."""

    def __init__(self, params: Iterable[torch.nn.Parameter], decay: float) -> None:
        if not 0.0 < decay < 1.0:
            raise ValueError(f"train.ema must be a decay in (0, 1) or 0 (off), got {decay}")
        self.params = list(params)
        self.decay = float(decay)
        self.updates = 0
        with torch.no_grad():
            self.weights = [p.detach().float().clone() for p in self.params]
        # what update() lerps towards: the parameters themselves where they are float32 (the
        # trained weights are, with autocast and with master weights), else float32 copies
        self._float32 = all(p.dtype == torch.float32 for p in self.params)

    @torch.no_grad()
    def update(self) -> None:
        """Move the average towards the parameters after an optimiser update."""
        self.updates += 1
        weight = 1.0 - decay_at(self.decay, self.updates)
        now = self.params if self._float32 else [p.detach().float() for p in self.params]
        torch._foreach_lerp_(self.weights, now, weight)

    @torch.no_grad()
    def copy_to(self, params: Iterable[torch.nn.Parameter]) -> None:
        """Write the average into ``params`` (the same model's parameters, same order)."""
        params = list(params)
        if len(params) != len(self.weights):
            raise ValueError(f"{len(params)} parameters for an average of {len(self.weights)}")
        for p, w in zip(params, self.weights):
            p.copy_(w)

    def state_dict(self) -> dict[str, Any]:
        return {"decay": self.decay, "updates": self.updates, "weights": list(self.weights)}

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any], source: str = "the checkpoint") -> None:
        """Take a saved average back; the configured decay applies from here on."""
        weights = list(state["weights"])
        shapes = [tuple(w.shape) for w in weights]
        if shapes != [tuple(w.shape) for w in self.weights]:
            raise ValueError(f"{source}: its weight average does not fit the model's parameters")
        for mine, saved in zip(self.weights, weights):
            mine.copy_(saved)
        self.updates = int(state["updates"])
        if float(state["decay"]) != self.decay:
            log.warning("resuming with train.ema %s -> %s: applied from the next update",
                        state["decay"], self.decay)  # fmt: skip
