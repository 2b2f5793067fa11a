"""Everything in mt that exists for speed, applied to a model from outside.

``mt.model`` is the paper and nothing else. Two calls make it fast for a device, each on a copy
that shares the model's parameters (the caller's model is never modified):

- :func:`for_training` (``fast.training``): what the update step runs. On a CPU, oneDNN
  products, 16-bit dropout masks, written-out attention and the loss in row blocks; elsewhere
  the model with the fused loss.
- :func:`for_decoding` (``fast.decoding``): what search runs. On a CPU, oneDNN (fp32 or bf16)
  or int8 products and short-query attention, the decoder steps' attention over the caches in
  mt's one C++ kernel (``native``, built on first use); on a GPU the model itself.

A layer reaches a kernel one way: the copy's modules are replaced (``nn.Linear``,
``nn.Dropout``, ``FeedForward``, and the attention ``core`` every attention layer holds).
The other modules hold device-wide settings: ``precision`` (``train.precision=auto``, autocast,
TF32), ``master`` (16-bit training on a copy with float32 master weights), ``compile``
(``torch.compile`` and DDP), ``memory`` (glibc's freed-memory settings), and
the fast loss (``loss``) that ``tests/test_loss.py`` holds equal to ``mt.model.loss``.
"""

from mt.fast.decoding import DecodingModel, for_decoding, release_decoding_copies
from mt.fast.training import TrainingModel, for_training

__all__ = [
    "DecodingModel", "TrainingModel", "for_decoding", "for_training", "release_decoding_copies",
]
