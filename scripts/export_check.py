"""Does an exported model decode like mt? Token ids from the exported Hugging Face and
CTranslate2 models, and the count of sentences on which they equal mt's.

mt's maximum output length is per sentence (``int(a * src_len + b)``, see :mod:`mt.decode.search`),
so
sentences are decoded in groups of equal limit and each library is given that limit as its own
(``max_new_tokens`` / ``max_decoding_length``). PAD and BOS are forbidden in every library, as in
mt's search. Used by the tests and by ``scripts/check_export.py`` (the 1,000-line counts).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import torch

from mt.decode.driver import translate_ids, translate_nbest
from mt.decode.search import Hypothesis, max_lengths
from mt.schema import DecodeConfig
from mt.vocab import BOS, EOS, PAD


@dataclass
class Agreement:
    """How many of ``total`` sentences got exactly mt's output ids."""

    same: int
    total: int
    first_difference: int | None = None  # index of the first sentence that differs

    def __str__(self) -> str:
        return f"{self.same}/{self.total}"


def agreement(expected: list[list[int]], actual: list[list[int]]) -> Agreement:
    """Count equal id sequences (the two lists align sentence by sentence)."""
    if len(expected) != len(actual):
        raise ValueError(f"{len(expected)} expected outputs but {len(actual)} actual ones")
    diff = [i for i, (a, b) in enumerate(zip(expected, actual)) if a != b]
    return Agreement(len(expected) - len(diff), len(expected), diff[0] if diff else None)


def limits(model: torch.nn.Module, src_ids: list[list[int]], cfg: DecodeConfig) -> list[int]:
    """mt's maximum output length of each source (ids without EOS)."""
    from mt.data.batches import make_src

    return max_lengths(make_src([list(s) for s in src_ids]), cfg.max_len_a, cfg.max_len_b, model)


def _groups(lengths: list[int], batch_size: int) -> list[list[int]]:
    """Indices grouped by equal maximum length, in batches of at most ``batch_size``."""
    by_limit: dict[int, list[int]] = defaultdict(list)
    for i, n in enumerate(lengths):
        by_limit[n].append(i)
    return [idx[j : j + batch_size] for idx in by_limit.values()
            for j in range(0, len(idx), batch_size)]  # fmt: skip


def _strip(seq: list[int]) -> list[int]:
    """Output ids without the start token, cut at the first EOS (PAD after it dropped)."""
    seq = [int(t) for t in seq]
    if seq and seq[0] == BOS:
        seq = seq[1:]
    return seq[: seq.index(EOS)] if EOS in seq else [t for t in seq if t != PAD]


def mt_ids(model, src_ids: list[list[int]], cfg: DecodeConfig) -> list[list[int]]:
    """mt's own best output ids (no BOS/EOS) through its public search entry point."""
    return translate_ids(model, src_ids, cfg)


def mt_nbest(model, src_ids: list[list[int]], cfg: DecodeConfig) -> list[list[Hypothesis]]:
    """mt's hypotheses with their scores (``cfg.nbest`` per sentence)."""
    return translate_nbest(model, src_ids, cfg)


@torch.inference_mode()
def hf_ids(
    hf_model, src_ids: list[list[int]], lims: list[int], beam: int, length_penalty: float,
    batch_size: int = 64,
) -> list[list[int]]:  # fmt: skip
    """``generate`` of an exported ``MarianMTModel``: greedy (``beam`` 1) or beam search that
    stops when ``beam`` hypotheses are finished (mt's rule), with the library's length penalty.
    """
    out: list[list[int]] = [[] for _ in src_ids]
    for group in _groups(lims, batch_size):
        S = max(len(src_ids[i]) for i in group) + 1
        src = torch.full((len(group), S), PAD, dtype=torch.long)
        for row, i in enumerate(group):
            seq = [*src_ids[i], EOS]
            src[row, : len(seq)] = torch.tensor(seq)
        search = {"early_stopping": True, "length_penalty": length_penalty} if beam > 1 else {}
        gen = hf_model.generate(
            input_ids=src,
            attention_mask=src.ne(PAD),
            num_beams=beam,
            do_sample=False,
            max_length=None,
            max_new_tokens=lims[group[0]],
            suppress_tokens=[PAD, BOS],
            **search,
        )
        for row, i in enumerate(group):
            out[i] = _strip(gen[row].tolist())
    return out


def ct2_ids(
    translator, pieces: list[list[str]], lims: list[int], beam: int, length_penalty: float,
    vocab: dict[str, int], batch_size: int = 64,
) -> list[list[int]]:  # fmt: skip
    """``translate_batch`` of an exported CTranslate2 model, as target ids.

    Args:
        translator: a ``ctranslate2.Translator``.
        pieces: SentencePiece pieces of each source (``</s>`` is added by the model's config).
        vocab: piece -> id (the SentencePiece model's).
    """
    out: list[list[int]] = [[] for _ in pieces]
    for group in _groups(lims, batch_size):
        results = translator.translate_batch(
            [pieces[i] for i in group],
            beam_size=beam,
            length_penalty=length_penalty,
            max_decoding_length=lims[group[0]],
            min_decoding_length=0,
            suppress_sequences=[["<pad>"], ["<s>"]],
            return_scores=True,
        )
        for i, res in zip(group, results):
            out[i] = [vocab[p] for p in res.hypotheses[0]]
    return out


def load_ct2(path: str | Path, threads: int = 1):
    """A ``ctranslate2.Translator`` on the CPU for an exported directory."""
    import ctranslate2

    return ctranslate2.Translator(str(path), device="cpu", intra_threads=threads)
