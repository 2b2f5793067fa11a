"""Stages 1-3: parallel text to training batches.

``corpus`` reads local files or Hugging Face datasets pair by pair; ``cleaning`` normalises and
filters them; ``tokenizer`` is the joint SentencePiece model; ``build`` runs those stages once
and caches the result, which ``store`` reads back (memory-mapped encoded splits, raw
references); ``encode`` is the parallel encoder ``build`` uses; ``batches`` makes token-bounded
training batches with their masks' real positions; ``prefetch`` collates them ahead.
"""
