"""Cleaning training pairs: word-level filters for every corpus, and the Moses text normalisation
and piece filters of fairseq's ``prepare-wmt14en2de.sh``, with maintained code instead of hand
copies of Moses' Perl scripts.

- :class:`Cleaner`: NFC and outer whitespace stripped (:func:`normalize_line`), then a pair is
  dropped, counted under its rule, when a side is empty, too short or long in words, too unequal
  in length, or a duplicate (``data.clean.*``).
- :class:`TextNormalizer`: NFC, then ``normalize-punctuation.perl`` and
  ``remove-non-printing-char.perl`` as ``sacremoses`` implements them (``clean.moses_punct``,
  ``clean.remove_non_printing``; sacremoses deletes the non-printing characters where the Perl
  script puts a space). :func:`normalize_pairs` runs it on several processes, in order.
- :func:`piece_filter`: ``clean-corpus-n.perl -ratio 1.5 ... 1 250`` on SentencePiece pieces,
  after encoding (``clean.max_pieces``, ``clean.max_piece_ratio``).
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import multiprocessing as mp
import os
import re
import unicodedata
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

try:  # the regular-expression parser, to find each Moses rule's plain text (see _compile_rule)
    import re._constants as _sre_constants
    import re._parser as _sre_parse
except ImportError:  # Python < 3.11
    import sre_constants as _sre_constants
    import sre_parse as _sre_parse

from mt.schema import CleanConfig

log = logging.getLogger(__name__)


def normalize_line(text: str, nfc: bool = True) -> str:
    """The pipeline's normalisation: Unicode NFC (when ``nfc``), then strip outer whitespace."""
    return (unicodedata.normalize("NFC", text) if nfc else text).strip()


RULES = ("empty", "min_len", "max_len", "max_ratio", "duplicate")
DEDUP_BLOCK = 1 << 16  # pairs judged at once by the de-duplication


def digest(src: str, tgt: str) -> int:
    """The 8-byte BLAKE2b digest of a pair (source TAB target, UTF-8) as an unsigned integer:
    two pairs with the same digest are duplicates (a false match: ~n^2 / 2^65 for n pairs)."""
    raw = hashlib.blake2b(f"{src}\t{tgt}".encode(), digest_size=8).digest()
    return int.from_bytes(raw, "little")


class DigestSet:
    """A set of uint64 digests held as sorted numpy runs: 8 bytes an entry, not a Python object.

    A block of new digests becomes one sorted run; two runs merge whenever the newer is at least
    as long as the one before it (a binary counter), so there are at most log2(n / block) + 1
    runs, each looked up with one ``searchsorted``. The biggest merge holds both runs and their
    result: at most 16 bytes an entry for an instant.
    """

    def __init__(self) -> None:
        self._runs: list[np.ndarray] = []

    def __len__(self) -> int:
        return sum(len(r) for r in self._runs)

    def _contains(self, keys: np.ndarray) -> np.ndarray:
        found = np.zeros(len(keys), dtype=bool)
        for run in self._runs:
            at = np.searchsorted(run, keys)
            found |= run[np.minimum(at, len(run) - 1)] == keys
        return found

    def first_seen(self, keys: np.ndarray) -> np.ndarray:
        """(n,) bool: True where ``keys[i]`` is in neither the set nor ``keys[:i]``; those keys
        are added. What adding the keys one at a time in order would report."""
        keys = np.asarray(keys, dtype=np.uint64)
        first = np.zeros(len(keys), dtype=bool)
        new, index = np.unique(keys, return_index=True)  # sorted; index: first occurrence
        fresh = ~self._contains(new)
        first[index[fresh]] = True
        if fresh.any():
            run = new[fresh]
            while self._runs and len(self._runs[-1]) <= len(run):
                run = np.concatenate([self._runs.pop(), run])
                run.sort(kind="stable")  # timsort: two sorted runs merge in one pass
            self._runs.append(run)
        return first


class Cleaner:
    """Joint filter of training pairs; a pair is kept or dropped whole, so sides never drift.

    Each dropped pair is counted under the first rule it fails (``RULES`` order); lengths are in
    whitespace-separated words. De-duplication judges :data:`DEDUP_BLOCK` pairs at a time
    against the kept pairs' :class:`DigestSet`; the kept pairs and their order are those of a
    pair-by-pair pass.
    """

    def __init__(self, cfg: CleanConfig):
        self.cfg = cfg
        self.counts = {"read": 0, **{r: 0 for r in RULES}, "kept": 0}
        self._seen = DigestSet()

    def _word_rule(self, src: str, tgt: str) -> str | None:
        """The first rule before ``duplicate`` that the (normalised) pair fails, or None."""
        if not src or not tgt:
            return "empty"
        ns, nt = len(src.split()), len(tgt.split())
        if min(ns, nt) < self.cfg.min_len:
            return "min_len"
        if self.cfg.max_len and max(ns, nt) > self.cfg.max_len:
            return "max_len"
        if self.cfg.max_ratio and max(ns, nt) > self.cfg.max_ratio * max(min(ns, nt), 1):
            return "max_ratio"
        return None

    def __call__(self, pairs: Iterator[tuple]) -> Iterator[tuple]:
        """Normalise and filter ``pairs``; counts accumulate in :attr:`counts`. A pair may carry
        more fields after (source, target), e.g. its corpus number: they pass through."""
        nfc, counts = self.cfg.normalize, self.counts
        pairs = iter(pairs)
        while block := list(itertools.islice(pairs, DEDUP_BLOCK)):
            passed = []  # the block's pairs that pass the word rules, in order
            for src, tgt, *rest in block:
                src, tgt = normalize_line(src, nfc), normalize_line(tgt, nfc)
                rule = self._word_rule(src, tgt)
                if rule is None:
                    passed.append((src, tgt, *rest))
                else:
                    counts[rule] += 1
            counts["read"] += len(block)
            if self.cfg.dedup and passed:
                keys = np.fromiter((digest(p[0], p[1]) for p in passed), np.uint64, len(passed))
                first = self._seen.first_seen(keys)
                counts["duplicate"] += len(passed) - int(first.sum())
                passed = list(itertools.compress(passed, first.tolist()))
            counts["kept"] += len(passed)
            yield from passed

    def summary(self) -> str:
        c = self.counts
        dropped = ", ".join(f"{r}={c[r]}" for r in RULES)
        return f"read {c['read']} pairs, dropped {dropped}, kept {c['kept']}"


CHUNK_PAIRS = 20_000  # pairs per normalisation task


@dataclass(frozen=True)
class NormSpec:
    """What :class:`TextNormalizer` does to one language's lines (picklable for workers)."""

    lang: str
    nfc: bool = True
    moses_punct: bool = False
    remove_non_printing: bool = False

    @classmethod
    def from_config(cls, clean: CleanConfig, lang: str) -> NormSpec:
        return cls(lang, clean.normalize, clean.moses_punct, clean.remove_non_printing)

    @property
    def moses(self) -> bool:
        """True when a sacremoses step runs (the slow part)."""
        return self.moses_punct or self.remove_non_printing


class MosesPunct:
    """sacremoses' ``MosesPunctNormalizer(lang).normalize``, the same rules run faster.

    The rules (regular expression, replacement) are the library's own, applied in their order.
    Each rule runs only when the text holds its *trigger*, a substring that every match of its
    pattern contains (the longest run of plain characters in the pattern's top level); a rule
    whose pattern does not match changes nothing, so skipping it is exact. A rule that is one
    plain string with a plain replacement runs as ``str.replace``. ``" +" -> " "`` changes text
    only on runs of two or more spaces, so its trigger is two spaces. A news line holds a few
    triggers at most, so most rules are skipped on most lines. Tested equal to sacremoses on real
    news text and on a line for each rule.
    """

    def __init__(self, lang: str):
        from sacremoses import MosesPunctNormalizer

        self._reference = MosesPunctNormalizer(lang=lang)
        self._rules = [_compile_rule(p, r) for p, r in self._reference.substitutions]

    def normalize(self, text: str) -> str:
        for trigger, plain, pattern, repl in self._rules:
            if trigger is not None and trigger not in text:
                continue
            text = text.replace(plain, repl) if plain is not None else pattern.sub(repl, text)
        return text.strip()

    def remove_control_chars(self, text: str) -> str:
        """Delete Unicode category C characters (``remove-non-printing-char``).

        ``str.isprintable`` is False for every category C (and Z, but the space) character, so
        a printable line has none to delete: the library's per-character pass is skipped."""
        if text.isprintable():
            return text
        return self._reference.remove_control_chars(text)


def _compile_rule(pattern: str, repl: str) -> tuple[str | None, str | None, re.Pattern, str]:
    """``(trigger, plain, compiled, repl)`` of one substitution rule (see :class:`MosesPunct`).

    ``trigger`` is None when the pattern has no plain characters at its top level (the rule
    then always runs); ``plain`` is the pattern's text when it is nothing but plain characters
    and ``repl`` holds no group reference or escape (None otherwise).
    """
    compiled = re.compile(pattern)
    if pattern == " +" and repl == " ":
        return "  ", None, compiled, repl
    try:
        tree = _sre_parse.parse(pattern)
    except Exception:  # noqa: BLE001 - an unparsable private-API change: always run the rule
        return None, None, compiled, repl
    if tree.state.flags & (re.IGNORECASE | re.VERBOSE):
        return None, None, compiled, repl
    runs, run = [], ""
    for op, arg in tree:
        if op is _sre_constants.LITERAL:
            run += chr(arg)
        else:
            runs.append(run)
            run = ""
    runs.append(run)
    trigger = max(runs, key=len) or None
    whole = len(runs) == 1 and trigger is not None
    plain = trigger if whole and "\\" not in repl else None
    return trigger, plain, compiled, repl


class TextNormalizer:
    """NFC, Moses punctuation normalisation, non-printing removal, strip (each as configured).

    Example:
        >>> TextNormalizer(NormSpec("de", moses_punct=True))("„Ja“ ,  sagte er")
        '"Ja", sagte er'
    """

    def __init__(self, spec: NormSpec):
        self.spec = spec
        self._moses = MosesPunct(spec.lang) if spec.moses else None

    def steps(self, text: str) -> tuple[str, bool, bool]:
        """``(normalised text, punctuation changed it, non-printing removal changed it)``."""
        text = normalize_line(text, self.spec.nfc)
        punct = nonprint = False
        if self.spec.moses_punct:
            new = self._moses.normalize(text)
            punct, text = new != text, new
        if self.spec.remove_non_printing:
            new = self._moses.remove_control_chars(text).strip()
            nonprint, text = new != text, new
        return text, punct, nonprint

    def __call__(self, text: str) -> str:
        return self.steps(text)[0]


_WORKER: dict = {}


def _init(specs: tuple[NormSpec, NormSpec]) -> None:
    _WORKER["norm"] = tuple(TextNormalizer(s) for s in specs)


def _normalize_chunk(chunk: list[tuple]) -> tuple[list[tuple], list[int]]:
    src_norm, tgt_norm = _WORKER["norm"]
    out, counts = [], [0, 0]
    for src, tgt, *rest in chunk:  # fields after the text (a corpus number) pass through
        s, sp, sn = src_norm.steps(src)
        t, tp, tn = tgt_norm.steps(tgt)
        counts[0] += sp or tp
        counts[1] += sn or tn
        out.append((s, t, *rest))
    return out, counts


def normalize_pairs(
    pairs: Iterator[tuple[str, str]],
    specs: tuple[NormSpec, NormSpec],
    counts: dict[str, int],
    workers: int = 1,
) -> Iterator[tuple[str, str]]:
    """Normalise (source, target) pairs in order; ``workers`` > 1 spreads chunks over processes.

    ``counts["moses_punct"]`` / ``counts["non_printing"]`` grow by the pairs whose text that
    step changed (either side).
    """
    counts.setdefault("moses_punct", 0)
    counts.setdefault("non_printing", 0)
    chunks = iter(lambda: list(itertools.islice(pairs, CHUNK_PAIRS)), [])
    pool = None
    # Built here first: a normaliser that cannot start (sacremoses without joblib, say) raises
    # in this process; in a pool's initializer it would fail in worker after new worker.
    _init(specs)
    if workers > 1 and any(s.moses for s in specs):
        pool = mp.get_context("spawn").Pool(workers, _init, (specs,))
        results = pool.imap(_normalize_chunk, chunks)
    else:
        results = map(_normalize_chunk, chunks)
    try:
        for out, (n_punct, n_nonprint) in results:
            counts["moses_punct"] += n_punct
            counts["non_printing"] += n_nonprint
            yield from out
    finally:
        if pool is not None:
            pool.terminate()


def piece_filter(
    src_len: np.ndarray, tgt_len: np.ndarray, max_pieces: int, max_ratio: float
) -> tuple[np.ndarray, dict[str, int]]:
    """``(keep, counts)``: which pairs pass the piece-level filters, (n,) bool, and the pairs
    each rule dropped (``piece_empty``, ``piece_max_len``, ``piece_ratio``: a pair under the
    first it fails). Lengths are pieces without BOS/EOS; ``max_pieces`` (the longest side kept)
    and ``max_ratio`` (longer / shorter side) are off at 0."""
    src_len = np.asarray(src_len, dtype=np.int64)
    tgt_len = np.asarray(tgt_len, dtype=np.int64)
    empty = (src_len == 0) | (tgt_len == 0)
    longer = np.maximum(src_len, tgt_len)
    too_long = ~empty & (longer > max_pieces) if max_pieces else np.zeros_like(empty)
    shorter = np.maximum(np.minimum(src_len, tgt_len), 1)
    ratio = longer > max_ratio * shorter if max_ratio else np.zeros_like(empty)
    ratio &= ~empty & ~too_long
    keep = ~(empty | too_long | ratio)
    counts = {
        "piece_empty": int(empty.sum()),
        "piece_max_len": int(too_long.sum()),
        "piece_ratio": int(ratio.sum()),
    }
    return keep, counts


def filter_encoded_pairs(
    prefixes: list[str], clean: CleanConfig, dtype: str
) -> tuple[np.ndarray, dict[str, int]]:
    """:func:`piece_filter` applied, in place, to encoded train files (``[source, target]``
    prefixes): ``(the kept pairs' mask, dropped pairs per rule)``; ValueError if none is left."""
    offsets = [np.fromfile(f"{p}.off", dtype=np.int64) for p in prefixes]
    keep, dropped = piece_filter(
        np.diff(offsets[0]), np.diff(offsets[1]), clean.max_pieces, clean.max_piece_ratio
    )
    del offsets
    if not keep.any():
        raise ValueError(f"no training pairs left after the piece filters: {dropped}")
    if not keep.all():
        drop_encoded(prefixes, keep, dtype)
    log.info(
        "train piece filters (max %d pieces, ratio %.2f): dropped %s, kept %d pairs",
        clean.max_pieces, clean.max_piece_ratio, dropped, int(keep.sum()),
    )  # fmt: skip
    return keep, dropped


def drop_encoded(prefixes: list[str], keep: np.ndarray, dtype: str, block: int = 1 << 20) -> None:
    """Rewrite ``<prefix>.ids`` / ``<prefix>.off`` pairs (mt.data.build's layout) keeping only the
    sequences where ``keep`` is True, in order, ``block`` sequences at a time (bounded memory)."""
    for prefix in prefixes:
        offsets = np.fromfile(f"{prefix}.off", dtype=np.int64)
        ids = np.memmap(f"{prefix}.ids", dtype=np.dtype(dtype), mode="r") if offsets[-1] else None
        with open(f"{prefix}.ids.new", "wb") as f_ids, open(f"{prefix}.off.new", "wb") as f_off:
            f_off.write(np.zeros(1, dtype=np.int64).tobytes())
            total = 0
            for start in range(0, len(keep), block):
                stop = min(start + block, len(keep))
                lengths = np.diff(offsets[start : stop + 1])
                if ids is not None:
                    tokens = ids[offsets[start] : offsets[stop]]
                    f_ids.write(tokens[np.repeat(keep[start:stop], lengths)].tobytes())
                kept = lengths[keep[start:stop]]
                f_off.write((total + np.cumsum(kept)).tobytes())
                total += int(kept.sum())
        del ids
        for ext in ("ids", "off"):
            os.replace(f"{prefix}.{ext}.new", f"{prefix}.{ext}")
