"""Stage 5: translations from a trained model.

``search`` holds the generation loop (greedy, beam and sampling share it) and the contract it
needs of a model (``IncrementalDecoder``); ``strategies`` decide which candidates survive a
step; ``rows`` keeps the live hypotheses and their model-state rows; ``ensemble`` averages
several models. ``driver`` is how every caller decodes many sentences (length checks, batches,
precision); ``translate`` is the ``Translator`` API and
``mt-translate``; ``alignment`` draws attention and word alignments; ``rescore`` is
``mt-score`` (the model's log-probability of given translations).
"""
