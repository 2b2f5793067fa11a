"""mt's own speed code for training, applied to a model from outside (``mt.model`` is the paper
and nothing else); ``mt.train.recipe`` imports it once, decoding and serving use none of it.

:func:`for_training` (``training``) makes what the update step runs, on a copy sharing the
model's parameters: on a CPU oneDNN products (``onednn``), 16-bit dropout masks (``dropout``),
written-out attention (``attention``), the loss in row blocks (``loss``), the C++ kernels of the
last two (``native``); on a GPU the model with the projection and the loss in blocks. Settings
of the device: ``precision`` (``train.precision=auto``, TF32), ``probe`` (the fastest kernel
here, measured once and cached), ``master`` (16-bit training on float32 masters), ``compile``
(``torch.compile`` and DDP), ``memory`` (glibc's freed-memory settings).
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
