"""mt's own speed code for training, applied to a model from outside.

``mt.model`` is the paper and nothing else. :func:`for_training` (``fast.training``) makes
what the update step runs, on a copy that shares the model's parameters (the caller's model is
never modified): on a CPU, oneDNN products, 16-bit dropout masks (mt's C++ kernel, ``native``),
written-out attention and the loss in row blocks (mt's C++ kernel too); on a GPU the model with
the projection and the loss in blocks; elsewhere the model with the fused loss.

A layer reaches a kernel one way: the copy's modules are replaced (``nn.Linear``,
``nn.Dropout``, ``FeedForward``, and the attention ``core`` every attention layer holds).
The other modules hold device-wide settings: ``precision`` (``train.precision=auto``, TF32),
``probe`` (which kernel is fastest here, measured once and cached; under DDP rank 0 measures
and the other ranks adopt its choices), ``master`` (16-bit training on a copy with float32
master weights), ``compile`` (``torch.compile`` and DDP), ``memory`` (glibc's freed-memory
settings), and the fast loss (``loss``) that ``tests/test_loss.py`` holds equal to
``mt.model.loss``.

This package is the whole of what ``mt.train`` takes from ``mt.fast`` (one import there, in
``mt.train.recipe``); decoding, serving, evaluation and export use none of it: they decode with
the model as written (``mt.decode``).
"""

from mt.fast.compile import (
    compile_model,
    compile_step,
    compiled_graphs,
    fitted_max_tokens,
    pad_multiple,
    step_loss,
)
from mt.fast.precision import machine, resolve_precision, set_fp32_precision
from mt.fast.probe import adopt as adopt_probes
from mt.fast.probe import decided as probe_decisions
from mt.fast.training import TrainingModel, for_training

__all__ = [
    "TrainingModel", "adopt_probes", "compile_model", "compile_step", "compiled_graphs",
    "fitted_max_tokens", "for_training", "machine", "pad_multiple", "probe_decisions",
    "resolve_precision", "set_fp32_precision", "step_loss",
]
