"""Stages 1-2 as one cached step: corpus -> cleaned pairs -> SentencePiece -> encoded splits.

:func:`prepare` builds the prepared store (``mt.data.store``) in named stages, or loads it:

1. :func:`clean_train` reads the training pairs, normalises them (Moses punctuation when enabled,
   :mod:`mt.data.cleaning`) and filters them (:class:`mt.data.cleaning.Cleaner`);
2. :func:`keep_raw` keeps the valid and test lines exactly as read (sacreBLEU scores them);
3. :func:`train_tokenizer` trains the joint SentencePiece model on the cleaned text (or reuses
   one, ``tokenizer.reuse``);
4. :func:`encode_splits` encodes every split on all cores (:mod:`mt.data.encode`);
5. :func:`filter_pieces` drops training pairs by their piece lengths (``clean.max_pieces``);
6. :func:`write_meta` records settings, counts, timings and every file's checksum.

The result lives in ``cfg.cache_dir/<name>-<hash>/`` where the hash covers everything that
produced it: the data and tokenizer settings and the identity (path, size, mtime) of every
input file. A hit only loads (cheap and read-only, so DDP ranks after rank 0 just open it); any
change rebuilds. A build happens in a temporary directory renamed into place at the end, so an
interrupted prepare never leaves a directory a later run would trust.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from mt.data.cleaning import Cleaner, NormSpec, drop_encoded, filter_encoded_pairs, normalize_pairs
from mt.data.corpus import (
    ROLES,
    Corpus,
    DataError,
    builder_revision,
    corpus_identity,
    open_corpus,
    resolve_hf,
    split_names,
)
from mt.data.encode import Sampling, encode_files
from mt.data.mixing import directions, train_specs
from mt.data.store import FORMAT_VERSION, CacheError, Prepared, meta_digest
from mt.data.tokenizer import SIDES, Tokenizer, TokenizerError, lang_tag, num_threads
from mt.files import file_crc, read_json, write_json
from mt.schema import Config

log = logging.getLogger(__name__)


def cache_key(cfg: Config, revision: str | None = None) -> str:
    """sha256 over the format version, data and tokenizer settings and the input files' identity
    (``revision``: the commit a hub dataset resolved to, ``corpus.builder_revision``)."""
    data = dataclasses.asdict(cfg.data)
    # The prepared data is the same whatever the corpora's weights: only names count.
    data["splits"]["train"] = split_names(cfg.data.splits.train)
    data.pop("corpus_temperature")
    data["directions"] = [d.name for d in directions(cfg.data)]
    if not data["directions"]:  # absent for one direction: the keys of data before it
        data.pop("directions")
    data.pop("verify")  # how a cache is checked, not what it holds
    for name in ("hf_data_dir", "revision"):  # absent when unset: the keys of data before them
        if data[name] is None:
            data.pop(name)
    tok = dataclasses.asdict(cfg.tokenizer)
    tok.pop("threads")  # changes speed, not the result
    sampling = {name: tok.pop(name) for name in ("sampling_alpha", "sampled_copies")}
    if tok.pop("reuse"):  # the model's bytes, not its path, decide the output
        tok = {"reuse_sha256": Tokenizer.from_reference(cfg.tokenizer.reuse).sha256()}
    if sampling["sampling_alpha"]:  # absent when off: the keys of data prepared before it
        tok.update(sampling)
    blob = {
        "format": FORMAT_VERSION,
        "data": data,
        "tokenizer": tok,
        "input": corpus_identity(cfg.data, revision),
    }
    return hashlib.sha256(json.dumps(blob, sort_keys=True, default=str).encode()).hexdigest()


def prepare(cfg: Config, build: bool = True) -> Prepared:
    """Read, clean, train SentencePiece and encode all splits, or load the cached result.

    With ``build`` False it only loads: a cache miss is a :class:`CacheError` that says to run
    ``mt-prepare`` first (each rank of a torchrun job, which must not build it inside a
    collective's timeout). Missing or malformed input raises ``DataError`` (nothing is cached).
    """
    sampling_copies(cfg)  # a setting out of range fails now, not after the build's first stages
    direction_tags(cfg)
    root = Path(cfg.cache_dir)
    builder = resolve_hf(cfg.data, hf_cache_dir=str(root / "hf"))  # a hub dataset's revision
    revision = None if builder is None else builder_revision(cfg.data, builder)
    key = cache_key(cfg, revision)
    final = root / f"{cfg.data.name}-{key[:16]}"
    if _valid(final, key):
        try:
            prepared = Prepared(final, verify=cfg.data.verify)
        except (CacheError, TokenizerError) as err:
            if not build:
                raise CacheError(f"{err}: run `mt-prepare` with the same settings first") from err
            log.warning("%s: rebuilding it", err)
        else:
            log.info("prepared data: cache hit %s", final)
            return prepared
    if not build:
        raise CacheError(
            f"no prepared data for this configuration in {final} (cache_dir={cfg.cache_dir}): "
            "run `mt-prepare` with the same settings first (under torchrun each rank only "
            "loads prepared data)"
        )
    if final.exists():  # no meta.json or a different key: never trust it
        log.warning("discarding incomplete prepared data at %s", final)
        shutil.rmtree(final)
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}-", dir=root))
    os.chmod(tmp, 0o755)  # mkdtemp's 0700 would hide the cache from other users
    try:
        _build(cfg, tmp, key, root, builder, revision)
        try:
            os.rename(tmp, final)
        except OSError:
            if not _valid(final, key):  # another process did not finish it either
                raise
            log.info("prepared data: another process finished %s first", final)
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return Prepared(final, verify=False)


def _valid(path: Path, key: str) -> bool:
    return read_json(path / "meta.json").get("key") == key


def _build(
    cfg: Config, out: Path, key: str, root: Path, builder=None, revision: str | None = None
) -> None:
    """Build everything into ``out``, stage by stage; meta.json is written last."""
    seconds, t = {}, time.time()

    def stage(name: str) -> None:
        nonlocal t
        now = time.time()
        seconds[name], t = now - t, now

    corpus = open_corpus(cfg.data, hf_cache_dir=str(root / "hf"), builder=builder)
    work = out / "work"
    work.mkdir()
    specs = _norm_specs(cfg)
    workers = num_threads(cfg.tokenizer.threads)
    counts = {"train": clean_train(cfg, corpus, work, specs, workers)}
    counts.update(keep_raw(cfg, corpus, out))
    stage("read_clean")
    tokenizer = train_tokenizer(cfg, work, out)
    stage("spm")
    dtype = "uint16" if tokenizer.vocab_size <= 1 << 16 else "int32"
    encode_splits(tokenizer, work, out, specs, dtype, cfg.data.clean.normalize, workers)
    stage("encode")
    copies = encode_sampled(cfg, tokenizer, work, out, dtype, workers)
    if copies:
        counts["train"]["sampled_copies"] = copies
    shutil.rmtree(work)
    stage("sample")
    filter_pieces(cfg, out, dtype, counts["train"])
    stage("piece_filter")
    write_meta(cfg, out, key, tokenizer, dtype, counts, seconds, revision)
    log.info(
        "prepared %s in %.1fs (read+clean %.1fs, SentencePiece %.1fs, encode %.1fs, sampled "
        "encodings %.1fs, piece filter %.1fs): %s", cfg.data.name, sum(seconds.values()),
        *seconds.values(),
        ", ".join(f"{r} {c['pairs']} pairs" for r, c in counts.items()),
    )  # fmt: skip


def clean_train(
    cfg: Config, corpus: Corpus, work: Path, specs: tuple[NormSpec, NormSpec], workers: int
) -> dict:
    """Stage 1: the training pairs read, normalised and filtered into ``work/train.{src,tgt}``,
    corpus after corpus; returns their counts (``pairs``, per rule under ``clean``, and each
    corpus's pairs under ``corpora``, what corpus weights are applied to)."""
    pairs = _part_pairs(corpus, cfg.data.max_train_pairs or 0)
    norm_counts = {"moses_punct": 0, "non_printing": 0}
    if any(spec.moses for spec in specs):  # else the Cleaner's NFC + strip is all there is
        pairs = normalize_pairs(pairs, specs, norm_counts, workers)
    cleaner = Cleaner(cfg.data.clean)
    per_corpus = [0] * corpus.num_parts("train")
    n = _write_pairs(cleaner(pairs), work / "train.src", work / "train.tgt", per_corpus)
    log.info(
        "train: %s; text changed by Moses punctuation %d, non-printing %d",
        cleaner.summary(), norm_counts["moses_punct"], norm_counts["non_printing"],
    )  # fmt: skip
    if n == 0:
        raise ValueError("no training pairs left after cleaning: " + cleaner.summary())
    names = [spec.name for spec in train_specs(cfg.data)]
    if len(names) != len(per_corpus):  # an HF source may name its splits otherwise
        names = [f"corpus{i}" for i in range(len(per_corpus))]
    corpora = [{"name": a, "pairs": b} for a, b in zip(names, per_corpus)]
    if len(corpora) > 1:
        log.info("train corpora: %s", ", ".join(f"{c['name']} {c['pairs']}" for c in corpora))
    return {"pairs": n, "clean": {**norm_counts, **cleaner.counts}, "corpora": corpora}


def _part_pairs(
    corpus: Corpus, limit: int, role: str = "train"
) -> Iterator[tuple[str, str, int]]:
    """``(source, target, corpus number)`` of every corpus of ``role`` in turn, at most ``limit``
    pairs of each (``data.max_train_pairs``; 0: all)."""
    for part in range(corpus.num_parts(role)):
        pairs = corpus.part_pairs(role, part)
        if limit:
            pairs = itertools.islice(pairs, limit)
        for src, tgt in pairs:
            yield src, tgt, part


def keep_raw(cfg: Config, corpus: Corpus, out: Path) -> dict[str, dict]:
    """Stage 2: the valid and test lines as read, into ``out/<role>.raw.{src,tgt}`` (never
    filtered: sacreBLEU scores against them); returns their counts."""
    counts = {}
    for role in ("valid", "test"):
        empty, per_part = [0], [0] * corpus.num_parts(role)
        pairs = _count_empty(_part_pairs(corpus, 0, role), empty)
        n = _write_pairs(pairs, out / f"{role}.raw.src", out / f"{role}.raw.tgt", per_part)
        if n == 0 or empty[0] == n:
            raise DataError(
                f"the {role} split (data.splits.{role}={getattr(cfg.data.splits, role)}) "
                + ("has no lines" if n == 0 else f"has only empty lines ({n})")
                + ": give it real sentence pairs"
            )
        counts[role] = {"pairs": n}
        if cfg.data.directions:  # each direction's range of the split, for its own scores
            named: dict[str, int] = {}
            for part, pairs_in_part in enumerate(per_part):
                name = corpus.part_direction(role, part)
                named[name] = named.get(name, 0) + pairs_in_part
            counts[role]["directions"] = [{"name": a, "pairs": b} for a, b in named.items()]
        log.info("%s: %d pairs (not filtered)", role, n)
    return counts


def direction_tags(cfg: Config) -> list[str]:
    """The target-language tokens of ``data.directions`` (``[<2de>, <2en>]``; empty for one
    direction). A ValueError names a setting that cannot go with them: one SentencePiece model
    per language (each side holds every language), or Moses punctuation (one language's)."""
    specs = directions(cfg.data)
    if specs and not cfg.tokenizer.joint:
        raise ValueError("data.directions needs tokenizer.joint=true: each side holds every "
                         "language, so one SentencePiece model serves them all")  # fmt: skip
    if specs and cfg.data.clean.moses_punct:
        raise ValueError("data.clean.moses_punct follows one language's rules and cannot go "
                         "with data.directions: set data.clean.moses_punct=false")  # fmt: skip
    return sorted({lang_tag(spec.name.split("-")[1]) for spec in specs})


def train_tokenizer(cfg: Config, work: Path, out: Path) -> Tokenizer:
    """Stage 3: SentencePiece trained on the cleaned training text (or ``tokenizer.reuse``),
    with the target-language tokens of ``data.directions`` among its user symbols."""
    tags = direction_tags(cfg)
    if cfg.tokenizer.reuse:
        tokenizer = Tokenizer.from_reference(cfg.tokenizer.reuse)
        log.info("SentencePiece reused from %s: vocab size %d", cfg.tokenizer.reuse,
                 tokenizer.vocab_size)  # fmt: skip
        missing = sorted(set(tags) - {lang_tag(lang) for lang in tokenizer.target_langs()})
        if missing:
            raise DataError(f"tokenizer.reuse={cfg.tokenizer.reuse}: its SentencePiece model "
                            f"has no piece {missing}, which data.directions needs")  # fmt: skip
        return tokenizer
    symbols = list(cfg.tokenizer.user_symbols)
    symbols += [tag for tag in tags if tag not in symbols]
    tok_cfg = dataclasses.replace(cfg.tokenizer, user_symbols=symbols)
    tokenizer = Tokenizer.train(work / "train.src", work / "train.tgt", out, tok_cfg)
    log.info("SentencePiece %s: vocab size %d", cfg.tokenizer.type, tokenizer.vocab_size)
    return tokenizer


def encode_splits(
    tokenizer: Tokenizer, work: Path, out: Path, specs: tuple[NormSpec, NormSpec], dtype: str,
    nfc: bool, workers: int,
) -> None:  # fmt: skip
    """Stage 4: every split encoded into ``out/<role>.<side>.{ids,off}``. The training text is
    already normalised; valid and test are normalised as training was (``specs``)."""
    jobs = []
    for role in ROLES:
        for side in SIDES:
            if role == "train":
                jobs.append((work / f"train.{side}", side, out / f"train.{side}"))
            else:
                spec = specs[SIDES.index(side)]
                jobs.append((out / f"{role}.raw.{side}", side, out / f"{role}.{side}", spec))
    encode_files(tokenizer, jobs, dtype, nfc, workers)


def sampling_copies(cfg: Config) -> int:
    """How many sampled encodings of the training split ``cfg.tokenizer`` asks for (0: none,
    ``tokenizer.sampling_alpha=0``); a ValueError names the setting that is out of range."""
    tok = cfg.tokenizer
    top = 1.0 if tok.type == "unigram" else 0.999  # bpe: alpha 1 would drop every merge
    if not 0.0 <= tok.sampling_alpha <= top:
        raise ValueError(
            f"tokenizer.sampling_alpha={tok.sampling_alpha}: expected 0 (off) or a value in "
            f"(0, {'1]' if tok.type == 'unigram' else '1)'} for tokenizer.type={tok.type} "
            "(0.1 is BPE-dropout's usual setting)"
        )
    if tok.sampling_alpha == 0.0:
        return 0
    if tok.sampled_copies < 1:
        raise ValueError(
            f"tokenizer.sampled_copies={tok.sampled_copies}: expected at least 1 (the number "
            "of sampled encodings of the training split that the epochs take in turn)"
        )
    return tok.sampled_copies


def sampled_prefix(out: Path, copy: int, side: str) -> Path:
    """Where sampled encoding ``copy`` of the training split's ``side`` lives in ``out``."""
    return out / f"train.sampled{copy}.{side}"


def encode_sampled(
    cfg: Config, tokenizer: Tokenizer, work: Path, out: Path, dtype: str, workers: int
) -> int:
    """Stage 4b, with ``tokenizer.sampling_alpha``: the cleaned training text encoded
    ``tokenizer.sampled_copies`` more times with subword regularisation (BPE-dropout or
    unigram sampling, :meth:`Tokenizer.sample`) into ``out/train.sampled<k>.<side>.{ids,off}``;
    epoch e trains on copy e mod their number (``mt.train.state.TrainBatches``). The copies are
    drawn once, here (seeded by ``tokenizer.seed``, the copy and the side, but SentencePiece's
    draws differ between processes): every rank and every resume reads these same files.
    Returns the number of copies."""
    copies = sampling_copies(cfg)
    alpha = cfg.tokenizer.sampling_alpha
    jobs = []
    for k in range(copies):
        for j, side in enumerate(SIDES):
            seed = int(np.random.SeedSequence([cfg.tokenizer.seed, k, j]).generate_state(1)[0])
            jobs.append((work / f"train.{side}", side, sampled_prefix(out, k, side), None,
                         Sampling(alpha, seed)))  # fmt: skip
    if jobs:
        encode_files(tokenizer, jobs, dtype, cfg.data.clean.normalize, workers)  # as train's
        log.info("train: %d sampled encodings (tokenizer.sampling_alpha=%g)", copies, alpha)
    return copies


def filter_pieces(cfg: Config, out: Path, dtype: str, counts: dict) -> None:
    """Stage 5: ``clean-corpus-n`` on SentencePiece pieces (``data.clean.max_pieces``,
    ``max_piece_ratio``), in place; ``counts`` (the training split's) is updated. The pairs
    are judged by the plain encoding; the sampled ones keep the same pairs."""
    clean = cfg.data.clean
    if not (clean.max_pieces or clean.max_piece_ratio):
        return
    prefixes = [str(out / f"train.{side}") for side in SIDES]
    keep, dropped = filter_encoded_pairs(prefixes, clean, dtype)
    if not keep.all():
        for k in range(counts.get("sampled_copies", 0)):
            drop_encoded([str(sampled_prefix(out, k, side)) for side in SIDES], keep, dtype)
    counts["clean"].update(dropped)
    counts["pairs"] = int(keep.sum())
    bounds = np.cumsum([0] + [c["pairs"] for c in counts["corpora"]])  # each corpus's range
    kept_before = np.concatenate([[0], np.cumsum(keep)])
    for corpus, start, end in zip(counts["corpora"], bounds[:-1], bounds[1:]):
        corpus["pairs"] = int(kept_before[end] - kept_before[start])


def write_meta(
    cfg: Config, out: Path, key: str, tokenizer: Tokenizer, dtype: str, counts: dict,
    seconds: dict[str, float], revision: str | None = None,
) -> None:  # fmt: skip
    """Stage 6: the tokenizer files and ``meta.json`` (every file's size, CRC-32 and time, the
    hub dataset's revision), all fsynced before the directory is renamed into place."""
    tokenizer_files = [p.name for p in tokenizer.save(out)]  # before the checksums (reuse)
    meta = {
        "key": key,
        "files": {
            p.name: [p.stat().st_size, file_crc(p), p.stat().st_mtime_ns]
            for p in sorted(out.iterdir())
        },  # fmt: skip
        "format": FORMAT_VERSION,
        "name": cfg.data.name,
        "revision": revision,  # the hub dataset's commit (None: local files)
        "data": dataclasses.asdict(cfg.data),
        "tokenizer": dataclasses.asdict(cfg.tokenizer),
        "tokenizer_files": tokenizer_files,
        "tokenizer_sha256": tokenizer.sha256(),
        "vocab_size": tokenizer.vocab_size,
        "dtype": dtype,
        "counts": counts,
        "seconds": seconds,
    }
    for p in out.iterdir():  # durable before the directory is renamed into place
        with open(p, "rb") as f:
            os.fsync(f.fileno())
    meta["digest"] = meta_digest(json.loads(json.dumps(meta, default=str)))  # as read back
    write_json(out / "meta.json", meta)


def _count_empty(pairs: Iterator[tuple[str, str]], empty: list[int]):
    """Pass pairs through, counting in ``empty[0]`` those whose source is blank."""
    for pair in pairs:
        if not pair[0].strip():
            empty[0] += 1
        yield pair


def _norm_specs(cfg: Config) -> tuple[NormSpec, NormSpec]:
    """The text normalisation of (source, target) lines, from ``data.clean``."""
    return tuple(NormSpec.from_config(cfg.data.clean, lang)
                 for lang in (cfg.data.src_lang, cfg.data.tgt_lang))  # fmt: skip


def _write_pairs(
    pairs: Iterator[tuple], src_path: Path, tgt_path: Path, per_corpus: list[int] | None = None
) -> int:
    """Stream pairs into two line files ("\\n" terminated, UTF-8); returns the pair count.
    ``per_corpus``: counts pairs by their third field (the corpus number) too."""
    n = 0
    with (
        open(src_path, "w", encoding="utf-8", newline="") as fs,
        open(tgt_path, "w", encoding="utf-8", newline="") as ft,
    ):
        for src, tgt, *rest in pairs:
            fs.write(src + "\n")
            ft.write(tgt + "\n")
            n += 1
            if per_corpus is not None:
                per_corpus[rest[0]] += 1
    return n
