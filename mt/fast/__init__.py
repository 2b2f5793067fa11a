"""mt's own speed code for training, applied to a model from outside.

``mt.model`` is the paper and nothing else. :func:`for_training` (``fast.training``) makes
what the update step runs, on a copy that shares the model's parameters (the caller's model is
never modified): on a CPU, oneDNN products, 16-bit dropout masks (mt's C++ kernel, ``native``),
written-out attention and the loss in row blocks (mt's C++ kernel too); on a GPU the model with
the projection and the loss in blocks; elsewhere the model with the fused loss. Decoding runs
the model as written (``mt.decode``).
"""

from mt.fast.training import TrainingModel, for_training

__all__ = ["TrainingModel", "for_training"]
