"""The Transformer of "Attention Is All You Need", the paper's math and nothing else: the
encoder-decoder (``transformer``), multi-head attention (``attention``), the decoder's key/value
cache (``kv_cache``), masks (``masks``) and the label-smoothed loss as written (``loss``).

No I/O, no configuration system, no speed code: ``mt.fast`` applies training kernels to a
copy from outside. Reading this folder alone, a newcomer sees the paper.
"""

from mt.model.transformer import EncoderOut, Transformer, build_model

__all__ = ["EncoderOut", "Transformer", "build_model"]
