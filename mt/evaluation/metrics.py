"""Corpus metrics on detokenized text: sacreBLEU's BLEU, chrF, chrF++ and TER, each with its
signature, and the tokenized, compound-split BLEU that WMT14 en-de papers report.

- :func:`score` is what validation, ``mt-evaluate`` and the tests call: hypotheses against one or
  several reference streams, the scores with their signatures (settings from ``cfg.eval``:
  :func:`eval_kwargs`).
- :func:`corpus_scores` runs any subset of ``METRICS`` (``eval.metrics``) with sacreBLEU; BLEU
  takes ``eval.bleu_tokenize`` (13a, intl, zh, char, ...).
- :func:`compound_split_bleu` is the score of "Attention Is All You Need" and of fairseq's
  ``compound_split_bleu.sh`` / tensor2tensor's ``get_ende_bleu.sh``: hypotheses and references
  Moses-tokenized (here ``sacremoses``, as ``tokenizer.perl -l LANG``, escaping on), every ``-``
  between two non-spaces split as ``##AT##-##AT##``, then multi-bleu-style BLEU on whitespace
  tokens (no smoothing). It depends on the tokenization, so it is NOT comparable with sacreBLEU;
  it is reported beside it, labelled so, only to compare with papers.
- :func:`testset_references` finds a sacreBLEU test set's references (``wmt14/full``) in
  sacreBLEU's local cache, never downloading.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from mt.schema import Config

METRICS = {"bleu": "BLEU", "chrf": "chrF", "chrf++": "chrF++", "ter": "TER"}  # and their labels
COMPOUND_SPLIT_NOTE = (
    "tokenized BLEU (Moses tokenizer, compound splitting ##AT##-##AT##, multi-bleu style) as in "
    "papers; NOT comparable with sacreBLEU"
)
_COMPOUND = re.compile(r"(\S)-(\S)")  # perl -ple 's{(\S)-(\S)}{$1 ##AT##-##AT## $2}g'


def _metric(name: str, bleu_tokenize: str):
    """sacreBLEU's metric for ``name``, one of :data:`METRICS` (checked by the caller)."""
    from sacrebleu.metrics import BLEU, CHRF, TER

    if name == "bleu":
        return BLEU(tokenize=bleu_tokenize)
    if name == "chrf":
        return CHRF()
    if name == "chrf++":
        return CHRF(word_order=2)
    return TER()


def corpus_scores(
    hyps: list[str], streams: list[list[str]], metrics=("bleu", "chrf"), bleu_tokenize="13a"
) -> dict[str, dict[str, Any]]:
    """``{metric: {"score", "signature", "details"}}`` for each name in ``metrics`` (of
    :data:`METRICS`): one detokenized translation per segment against reference streams, each
    with one reference per segment; ``bleu_tokenize`` is sacreBLEU's (``13a``: WMT's standard).
    """
    unknown = [m for m in metrics if m not in METRICS]
    if unknown:
        raise ValueError(f"eval.metrics: unknown {unknown}; expected a subset of {list(METRICS)}")
    out = {}
    for name in metrics:
        metric = _metric(name, bleu_tokenize)
        result = metric.corpus_score(list(hyps), streams)
        out[name] = {
            "score": float(result.score),
            "signature": str(metric.get_signature()),
            "details": str(result),
        }
    return out


def split_compounds(line: str) -> str:
    """``rich-text`` -> ``rich ##AT##-##AT## text`` (non-overlapping, left to right, as perl)."""
    return _COMPOUND.sub(r"\1 ##AT##-##AT## \2", line)


def compound_split_bleu(hyps: list[str], refs: list[str], lang: str) -> dict[str, Any]:
    """Tokenized BLEU with compound splitting (see the module docstring) of detokenized
    translations against raw references (one stream), with the Moses rules of ``lang``:
    ``{"score", "details", "note"}``, ``note`` saying it is not comparable with sacreBLEU."""
    from sacrebleu.metrics import BLEU
    from sacremoses import MosesTokenizer

    if len(hyps) != len(refs):
        raise ValueError(f"{len(hyps)} hypotheses but {len(refs)} references")
    moses = MosesTokenizer(lang=lang)

    def prep(lines: list[str]) -> list[str]:
        return [split_compounds(moses.tokenize(s.strip(), return_str=True)) for s in lines]

    bleu = BLEU(tokenize="none", smooth_method="none", force=True)
    result = bleu.corpus_score(prep(hyps), [prep(refs)])
    return {"score": float(result.score), "details": str(result), "note": COMPOUND_SPLIT_NOTE}


def direction_scores(
    hyps: list[str], refs: list[str], ranges: list[tuple[str, range]], **kwargs: Any
) -> dict[str, dict[str, Any]]:
    """:func:`score` (``kwargs``) of each direction's lines of ``hyps`` and ``refs``:
    ``ranges`` names each direction and its positions (``Prepared.directions``)."""
    return {name: score([hyps[i] for i in r], [refs[i] for i in r], **kwargs)
            for name, r in ranges}  # fmt: skip


def score(
    hyps: list[str],
    refs: list[str] | list[list[str]],
    metrics: list[str] | None = None,
    bleu_tokenize: str = "13a",
    compound_split_lang: str | None = None,
) -> dict[str, Any]:
    """Corpus BLEU and chrF (or ``metrics``, names from :data:`METRICS`) of detokenized
    hypotheses against raw references: one per segment, or several reference *streams* (each
    with one reference per segment, sacreBLEU's convention). ``compound_split_lang``: also the
    papers' tokenized compound-split BLEU with that language's Moses tokenizer (first stream).

    Returns ``{"bleu", "chrf", "signature" (BLEU's), "chrf_signature", "bleu_details",
    "n_sentences", "scores": {metric: {"score", "signature", "details"}}}`` (a metric not asked
    for is None), plus ``"compound_split_bleu": {"score", "details", "note"}`` when asked for.
    A reference stream of another length than the hypotheses is a ValueError.
    """
    streams = [list(refs)] if not refs or isinstance(refs[0], str) else [list(r) for r in refs]
    if not hyps:
        raise ValueError("nothing to score: 0 hypotheses")
    for i, stream in enumerate(streams):
        if len(stream) != len(hyps):
            raise ValueError(
                f"{len(hyps)} hypotheses but reference stream {i + 1} has {len(stream)} lines"
            )
    metrics = ["bleu", "chrf"] if metrics is None else list(metrics)
    scores = corpus_scores(list(hyps), streams, metrics, bleu_tokenize)
    bleu, chrf_score = scores.get("bleu", {}), scores.get("chrf", {})
    result = {
        "bleu": bleu.get("score"),
        "chrf": chrf_score.get("score"),
        "signature": bleu.get("signature"),
        "chrf_signature": chrf_score.get("signature"),
        "bleu_details": bleu.get("details"),
        "n_sentences": len(hyps),
        "scores": scores,
    }
    if compound_split_lang:
        result["compound_split_bleu"] = compound_split_bleu(hyps, streams[0], compound_split_lang)
    return result


def eval_kwargs(cfg: Config) -> dict[str, Any]:
    """:func:`score`'s keyword arguments from ``cfg.eval`` (and the target language)."""
    return {
        "metrics": list(cfg.eval.metrics),
        "bleu_tokenize": cfg.eval.bleu_tokenize,
        "compound_split_lang": cfg.data.tgt_lang if cfg.eval.compound_split_bleu else None,
    }


def is_testset(name: str) -> bool:
    """True when ``name`` is one of sacreBLEU's test sets (``wmt14/full``, ``wmt17``, ...)."""
    from sacrebleu.dataset import DATASETS

    return name in DATASETS


def testset_references(name: str, langpair: str) -> list[Path]:
    """The reference files of sacreBLEU test set ``name`` for ``langpair`` from its cache;
    ValueError for an unknown pair, or references not in the cache (naming the command that
    fetches them: nothing is downloaded here)."""
    from sacrebleu.dataset import DATASETS

    dataset = DATASETS[name]
    if langpair not in dataset.langpairs:
        raise ValueError(
            f"sacreBLEU test set {name} has no pair {langpair}; it has "
            f"{sorted(dataset.langpairs)} (set data.src_lang/data.tgt_lang)"
        )
    fields = [f for f in dataset.fieldnames(langpair) if f.startswith("ref")]
    paths = [Path(dataset._get_txt_file_path(langpair, f)) for f in fields]
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        raise ValueError(
            f"sacreBLEU test set {name} ({langpair}) is not in sacreBLEU's cache ({missing[0]} "
            f"missing); fetch it once with network access: sacrebleu -t {name} -l {langpair} "
            f"--echo ref > /dev/null"
        )
    return paths
