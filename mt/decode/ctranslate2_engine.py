"""Decoding with CTranslate2: the checkpoint converted once, cached beside it, searched with
CTranslate2's own API (``Translator.translate_batch`` and ``score_batch``).

The converted model lives in ``<checkpoint>.ct2/<compute type>-<digest>`` where the digest
is of the checkpoint's bytes (and of the vocabulary map's lexicon and settings, with a
shortlist): a changed checkpoint is converted again, an unchanged one never. It is written
to a temporary directory and renamed into place, so a reader never sees half a model and two
processes converting at once leave one; older conversions of the same file and compute type
are removed. Where the checkpoint's directory is not writable, the cache is
``$XDG_CACHE_HOME/mt/ct2`` (``~/.cache/mt/ct2``).

The search settings map onto CTranslate2's one for one (``alpha`` is its ``length_penalty``:
the same ``log p / |Y| ** alpha``, mt.decode.search; a shortlist is its vocabulary map, where
a batch searches the union of its sentences' lists). CTranslate2 has one length limit per call
and mt one per sentence (``int(a * src_len + b)``), so sentences are submitted in groups of
one limit each, all at once (``asynchronous``: the replicas take them side by side).
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any

from mt.decode.search import Hypothesis, length_penalty, max_length
from mt.decode.shortlist import load_lexicon, vocabulary_map
from mt.schema import DecodeConfig
from mt.vocab import BOS, PAD

log = logging.getLogger(__name__)

_DIGESTS: dict[tuple[str, int, int], str] = {}


def file_digest(path: str | Path) -> str:
    """The SHA-256 of a file's bytes (remembered per path, size and mtime in this process)."""
    st = os.stat(path)
    key = (str(Path(path).resolve()), st.st_size, st.st_mtime_ns)
    if key not in _DIGESTS:
        h = hashlib.sha256()
        with open(path, "rb") as f:
            while chunk := f.read(1 << 22):
                h.update(chunk)
        _DIGESTS[key] = h.hexdigest()
    return _DIGESTS[key]


def cache_root(checkpoint: str | Path) -> Path:
    """Where ``checkpoint``'s conversions live: beside it, or the user's cache directory
    where its directory is not writable."""
    path = Path(checkpoint)
    if os.access(path.parent, os.W_OK):
        return path.parent / f"{path.name}.ct2"
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "mt" / "ct2" / hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:16]


def converted_model(
    checkpoint: str | Path,
    compute_type: str,
    exporter: Any,
    shortlist: tuple[str, int, int] | None = None,
) -> tuple[Path, float | None]:
    """The CTranslate2 model of ``checkpoint`` at ``compute_type``, converted now with
    ``exporter.export_ct2`` (``mt.export.ct2``) if it is not cached yet (see the module
    docstring), and the seconds the conversion took (None: it was cached). ``shortlist``:
    (lexicon file, k, frequent) to write as the vocabulary map, or None."""
    from mt.checkpoint import load_checkpoint, model_cfg_from, tokenizer_blobs

    key = file_digest(checkpoint)
    if shortlist is not None:
        lexicon, k, frequent = shortlist
        key = hashlib.sha256(f"{key} {file_digest(lexicon)} {k} {frequent}".encode()).hexdigest()
    root = cache_root(checkpoint)
    final = root / f"{compute_type}{'-sl' if shortlist else ''}-{key[:32]}"
    if (final / "model.bin").is_file():
        return final, None
    start = time.perf_counter()
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=root))
    try:
        ckpt = load_checkpoint(checkpoint, map_location="cpu")
        vmap = None
        if shortlist is not None:
            lex = load_lexicon(shortlist[0], int(ckpt["vocab_size"]))
            vmap = partial(vocabulary_map, lex, k=shortlist[1], frequent=shortlist[2])
        out = tmp / "model"
        exporter.export_ct2(ckpt, model_cfg_from(ckpt), tokenizer_blobs(ckpt), out, vmap,
                            quantization=compute_type)  # fmt: skip
        try:
            out.rename(final)
        except OSError:  # another process put its conversion there first: keep that one
            if not (final / "model.bin").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    for old in root.glob(f"{compute_type}-*"):  # conversions of an earlier version of the file
        if old != final and old.name.count("-") == final.name.count("-"):
            shutil.rmtree(old, ignore_errors=True)
    seconds = time.perf_counter() - start
    log.info("%s converted for CTranslate2 (%s) in %.1f s, cached in %s", checkpoint,
             compute_type, seconds, final)  # fmt: skip
    return final, seconds


class CTranslate2Engine:
    """A checkpoint decoded by CTranslate2 (see the module docstring), converted with
    ``exporter`` (:func:`converted_model`); ``tokenizer`` its one joint SentencePiece model,
    ``max_positions`` the cap of the length limits, the rest CTranslate2's settings."""

    def __init__(self, checkpoint: str | Path, exporter: Any, tokenizer: Any,
                 max_positions: int | None, device: str = "cpu", index: int = 0,
                 compute_type: str = "float32", inter_threads: int = 1, intra_threads: int = 1,
                 shortlist: tuple[str, int, int] | None = None) -> None:  # fmt: skip
        import ctranslate2

        self.model_dir, _ = converted_model(checkpoint, compute_type, exporter, shortlist)
        self.shortlist = shortlist
        self.translator = ctranslate2.Translator(
            str(self.model_dir), device=device, device_index=index, compute_type=compute_type,
            inter_threads=inter_threads, intra_threads=intra_threads,
        )  # fmt: skip
        self.max_positions = max_positions
        sp = tokenizer.model("tgt")
        self.pieces = [sp.id_to_piece(i) for i in range(sp.vocab_size())]
        self.ids = {p: i for i, p in enumerate(self.pieces)}
        self.suppress = [[self.pieces[PAD]], [self.pieces[BOS]]]

    def _batching(self, cfg: DecodeConfig) -> dict[str, Any]:
        if cfg.max_tokens > 0:
            return {"max_batch_size": cfg.max_tokens, "batch_type": "tokens"}
        return {"max_batch_size": max(1, cfg.batch_size), "batch_type": "examples"}

    def translate_nbest(
        self,
        src_ids: list[list[int]],
        cfg: DecodeConfig,
        prefix: list[list[int]] | None = None,
    ) -> list[list[Hypothesis]]:
        """``cfg.nbest`` hypotheses per source (ids without EOS), best first, as
        mt.decode.driver.translate_nbest gives them."""
        import ctranslate2

        sample = cfg.sample and cfg.temperature > 0
        nbest = 1 if cfg.sample else max(1, min(cfg.nbest, cfg.beam_size))
        options: dict[str, Any] = dict(
            beam_size=1 if cfg.sample else max(1, cfg.beam_size), num_hypotheses=nbest,
            length_penalty=cfg.alpha, min_decoding_length=0, max_input_length=0,
            return_scores=True, suppress_sequences=self.suppress,
            use_vmap=self.shortlist is not None, **self._batching(cfg),
        )  # fmt: skip
        if sample:
            options.update(sampling_topk=max(0, cfg.top_k), sampling_topp=cfg.top_p,
                           sampling_temperature=cfg.temperature)  # fmt: skip
            ctranslate2.set_random_seed(cfg.seed)  # seeds the threads not yet drawing
        limits = [max_length(len(ids), cfg.max_len_a, cfg.max_len_b, self.max_positions)
                  for ids in src_ids]  # fmt: skip
        groups: dict[int, list[int]] = {}
        for i, limit in enumerate(limits):
            groups.setdefault(limit, []).append(i)
        pending = []
        for limit, members in groups.items():
            source = self._pieces([src_ids[i] for i in members])
            target = None if prefix is None else self._pieces([prefix[i] for i in members])
            results = self.translator.translate_batch(
                source, target_prefix=target, max_decoding_length=limit, asynchronous=True,
                **options,
            )  # fmt: skip
            pending.append((members, results))
        out: list[list[Hypothesis]] = [[] for _ in src_ids]
        for members, results in pending:
            for i, result in zip(members, results):
                r = result.result()
                out[i] = [self._hypothesis([self.ids[p] for p in h], limits[i], cfg.alpha, s)
                          for h, s in zip(r.hypotheses, r.scores)]  # fmt: skip
        if prefix is not None and any(prefix):
            self._rescore(src_ids, out, prefix, limits, cfg)
        return out

    @staticmethod
    def _hypothesis(tokens: list[int], limit: int, alpha: float, score: float | None = None,
                    token_lprobs: list[float] | None = None) -> Hypothesis:  # fmt: skip
        """A hypothesis of ``tokens`` from CTranslate2's ``score``, or from the log-probabilities
        of its tokens and EOS; its length counts EOS where it ended with one (below ``limit``)."""
        length = len(tokens) + (len(tokens) < limit)
        if token_lprobs is None:
            return Hypothesis(tokens, score, score * length_penalty(length, alpha))
        logprob = sum(token_lprobs[:length])
        return Hypothesis(tokens, logprob / length_penalty(length, alpha), logprob)

    def _rescore(self, src_ids, out, prefix, limits: list[int], cfg: DecodeConfig) -> None:
        """mt's scores of hypotheses with a forced prefix: CTranslate2 leaves the prefix's
        log-probabilities out of its score, mt's search counts every output token."""
        rows = [(i, k) for i, hyps in enumerate(out) if prefix[i] for k in range(len(hyps))]
        per_token = self.score([src_ids[i] for i, _ in rows],
                               [out[i][k].tokens for i, k in rows], cfg)  # fmt: skip
        for (i, k), lp in zip(rows, per_token):
            out[i][k] = self._hypothesis(out[i][k].tokens, limits[i], cfg.alpha, token_lprobs=lp)

    def score(
        self, src_ids: list[list[int]], tgt_ids: list[list[int]], cfg: DecodeConfig
    ) -> list[list[float]]:
        """Teacher-forced ``log p(y_t | y_<t, x)`` of each target token and the final EOS, as
        mt.decode.driver.score_ids gives them (ids without BOS/EOS, fitted to the model)."""
        if not src_ids:
            return []
        results = self.translator.score_batch(
            self._pieces(src_ids), self._pieces(tgt_ids), max_input_length=0, **self._batching(cfg)
        )
        return [list(r.log_probs) for r in results]

    def _pieces(self, rows: list[list[int]]) -> list[list[str]]:
        return [[self.pieces[t] for t in ids] for ids in rows]
