"""Stages 1-2 as one cached step: corpus -> cleaned pairs -> SentencePiece -> encoded splits.

Cleaning: Moses normalisation when enabled (:mod:`mt.data.cleaning`), then the word-level filters
and
de-duplication (:class:`mt.data.corpus.Cleaner`), then, after encoding, the piece-level filters. The
SentencePiece model is trained on the cleaned text, or reused (``tokenizer.reuse``).

The result lives in ``cfg.cache_dir/<name>-<hash>/`` where the hash covers everything that
produced it: the data and tokenizer settings and the identity (path, size, mtime) of every
input file. A hit only loads (cheap and read-only, so DDP ranks after rank 0 just open it); any
change rebuilds. A build happens in a temporary directory renamed into place at the end, so an
interrupted prepare never leaves a directory a later run would trust.

Layout of a prepared directory::

    meta.json                      key, settings, counts, vocab size, id dtype, and the size
                                   and CRC-32 of every other file (checked on load: a damaged
                                   cache is rebuilt)
    spm.model | spm.{src,tgt}.model
    <role>.<side>.ids              flat ids of all sentences (uint16 if V <= 65536 else int32)
    <role>.<side>.off              int64 offsets (n + 1): sentence i is ids[off[i]:off[i+1]]
    {valid,test}.raw.{src,tgt}     the raw lines exactly as read (for sacreBLEU)

Encoding runs on all cores: the text files are cut into byte ranges at line ends and a pool of
worker processes encodes them; results are appended to the flat files in order, so no stage ever
holds the corpus as Python objects.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import logging
import multiprocessing as mp
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from mt.data.cleaning import NormSpec, TextNormalizer, filter_encoded_pairs, normalize_pairs
from mt.data.corpus import ROLES, Cleaner, DataError, corpus_identity, normalize_line, open_corpus
from mt.data.tokenizer import SIDES, Tokenizer, TokenizerError, num_threads
from mt.files import damaged_file, file_crc, write_json
from mt.schema import Config

log = logging.getLogger(__name__)

FORMAT_VERSION = 2  # bump when the layout or the processing changes
CHUNK_BYTES = 4 << 20  # text per encoding task


class TokenArray:
    """Variable-length id sequences stored flat: ``ids`` (memory-mapped) plus ``offsets``.

    Args:
        ids: (total,) all ids, one sequence after another.
        offsets: (n + 1,) int64; sequence ``i`` is ``ids[offsets[i]:offsets[i + 1]]``.
    """

    def __init__(self, ids: np.ndarray, offsets: np.ndarray):
        self.ids = ids
        self.offsets = offsets
        self._lengths: np.ndarray | None = None

    @classmethod
    def open(cls, ids_path: Path, offsets_path: Path, dtype: str) -> TokenArray:
        """Memory-map a pair of files written by :func:`encode_files` (read-only)."""
        return cls(_memmap(ids_path, np.dtype(dtype)), _memmap(offsets_path, np.dtype(np.int64)))

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i: int) -> np.ndarray:
        """(L,) int64 ids of sequence ``i`` (no BOS/EOS)."""
        n = len(self)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"index {i} out of range for {n} sequences")
        return np.asarray(self.ids[self.offsets[i] : self.offsets[i + 1]], dtype=np.int64)

    def __iter__(self) -> Iterator[np.ndarray]:
        return (self[i] for i in range(len(self)))

    @property
    def lengths(self) -> np.ndarray:
        """(n,) int64 length of each sequence."""
        if self._lengths is None:
            self._lengths = np.diff(np.asarray(self.offsets))
        return self._lengths


def _memmap(path: Path, dtype: np.dtype) -> np.ndarray:
    if path.stat().st_size == 0:  # np.memmap refuses empty files
        return np.zeros(0, dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r")


@dataclasses.dataclass
class EncodedSplit:
    """One split's encoded (source, target) pairs; ``len`` is the number of pairs."""

    src: TokenArray
    tgt: TokenArray

    def __len__(self) -> int:
        return len(self.src)


class Prepared:
    """A prepared-data directory: the tokenizer, encoded splits and raw references.

    ``verify`` checks every file's size and checksum against ``meta.json`` (a cache read back
    later); a directory this process has just written needs no second read.
    """

    def __init__(self, path: Path, verify: bool = True):
        self.dir = Path(path)
        try:
            self.meta = json.loads((self.dir / "meta.json").read_text(encoding="utf-8"))
        except (OSError, ValueError) as err:
            raise CacheError(f"{self.dir / 'meta.json'} is unreadable ({err})") from None
        damaged = damaged_file(self.dir, self.meta.get("files")) if verify else None
        if damaged is not None:
            raise CacheError(f"prepared data file {damaged} is damaged (size or checksum differs)")
        self.tokenizer = Tokenizer.load([self.dir / n for n in self.meta["tokenizer_files"]])
        self.vocab_size: int = self.tokenizer.vocab_size
        self._splits: dict[str, EncodedSplit] = {}

    def split(self, role: str) -> EncodedSplit:
        """The encoded ``role`` ("train", "valid" or "test"), memory-mapped."""
        _check_role(role)
        if role not in self._splits:
            arrays = [
                TokenArray.open(
                    self.dir / f"{role}.{side}.ids",
                    self.dir / f"{role}.{side}.off",
                    self.meta["dtype"],
                )
                for side in SIDES
            ]
            self._splits[role] = EncodedSplit(*arrays)
        return self._splits[role]

    def references(self, role: str) -> list[str]:
        """Raw target lines of ``role`` ("valid" or "test") exactly as read, for sacreBLEU."""
        return self._raw(role, "tgt")

    def sources(self, role: str) -> list[str]:
        """Raw source lines of ``role`` ("valid" or "test") exactly as read."""
        return self._raw(role, "src")

    def _raw(self, role: str, side: str) -> list[str]:
        _check_role(role)
        if role == "train":
            raise ValueError("raw lines are kept for valid and test only (train is cleaned)")
        text = (self.dir / f"{role}.raw.{side}").read_bytes().decode("utf-8")
        return text.split("\n")[:-1]  # "\n" only: U+2028 etc. stay inside their line


class CacheError(DataError):
    """A prepared-data directory whose files do not match what was written (a damaged disk, a
    hand edit); :func:`prepare` rebuilds it."""


def _check_role(role: str) -> None:
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, got {role!r}")


def cache_key(cfg: Config) -> str:
    """sha256 over the format version, data and tokenizer settings and the input files' identity."""
    tok = dataclasses.asdict(cfg.tokenizer)
    tok.pop("threads")  # changes speed, not the result
    if tok.pop("reuse"):  # the model's bytes, not its path, decide the output
        tok = {"reuse_sha256": Tokenizer.from_reference(cfg.tokenizer.reuse).sha256()}
    blob = {
        "format": FORMAT_VERSION,
        "data": dataclasses.asdict(cfg.data),
        "tokenizer": tok,
        "input": corpus_identity(cfg.data),
    }
    return hashlib.sha256(json.dumps(blob, sort_keys=True, default=str).encode()).hexdigest()


def prepare(cfg: Config, build: bool = True) -> Prepared:
    """Read, clean, train SentencePiece and encode all splits, or load the cached result.

    Args:
        cfg: the configuration (data, tokenizer, cache_dir).
        build: False: only load; a cache miss is a :class:`CacheError` that says to run
            ``mt-prepare`` first (each rank of a torchrun job, which must not build it
            inside a collective's timeout).

    Returns:
        The :class:`Prepared` data.

    Raises:
        mt.data.corpus.DataError: missing or malformed input (nothing is cached then).
    """
    key = cache_key(cfg)
    root = Path(cfg.cache_dir)
    final = root / f"{cfg.data.name}-{key[:16]}"
    if _valid(final, key):
        try:
            prepared = Prepared(final)
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
        _build(cfg, tmp, key, root)
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
    try:
        return json.loads((path / "meta.json").read_text(encoding="utf-8"))["key"] == key
    except (OSError, ValueError, KeyError):
        return False


def _build(cfg: Config, out: Path, key: str, root: Path) -> None:
    """Build everything into ``out``; meta.json is written last."""
    t0 = time.time()
    corpus = open_corpus(cfg.data, hf_cache_dir=str(root / "hf"))
    work = out / "work"
    work.mkdir()
    counts: dict[str, dict] = {}

    cleaner = Cleaner(cfg.data.clean)
    workers = num_threads(cfg.tokenizer.threads)
    pairs = corpus.pairs("train")
    if cfg.data.max_train_pairs:
        pairs = itertools.islice(pairs, cfg.data.max_train_pairs)
    specs = _norm_specs(cfg)
    norm_counts = {"moses_punct": 0, "non_printing": 0}
    if any(spec.moses for spec in specs):  # else the Cleaner's NFC + strip is all there is
        pairs = normalize_pairs(pairs, specs, norm_counts, workers)
    counts["train"] = {
        "pairs": _write_pairs(cleaner(pairs), work / "train.src", work / "train.tgt")
    }
    counts["train"]["clean"] = {**norm_counts, **cleaner.counts}
    log.info("train: %s; text changed by Moses punctuation %d, non-printing %d",
             cleaner.summary(), norm_counts["moses_punct"], norm_counts["non_printing"])
    if counts["train"]["pairs"] == 0:
        raise ValueError("no training pairs left after cleaning: " + cleaner.summary())
    for role in ("valid", "test"):
        empty = [0]
        pairs = _count_empty(corpus.pairs(role), empty)
        n = _write_pairs(pairs, out / f"{role}.raw.src", out / f"{role}.raw.tgt")
        if n == 0 or empty[0] == n:
            raise DataError(
                f"the {role} split (data.splits.{role}={getattr(cfg.data.splits, role)}) "
                + ("has no lines" if n == 0 else f"has only empty lines ({n})")
                + ": give it real sentence pairs"
            )
        counts[role] = {"pairs": n}
        log.info("%s: %d pairs (not filtered)", role, n)
    t_read = time.time()

    if cfg.tokenizer.reuse:
        tokenizer = Tokenizer.from_reference(cfg.tokenizer.reuse)
        log.info("SentencePiece reused from %s: vocab size %d", cfg.tokenizer.reuse,
                 tokenizer.vocab_size)  # fmt: skip
    else:
        tokenizer = Tokenizer.train(work / "train.src", work / "train.tgt", out, cfg.tokenizer)
        log.info("SentencePiece %s: vocab size %d", cfg.tokenizer.type, tokenizer.vocab_size)
    t_spm = time.time()

    dtype = "uint16" if tokenizer.vocab_size <= 1 << 16 else "int32"
    jobs = []
    for role in ROLES:
        for side in SIDES:
            if role == "train":  # already normalised by the cleaning pass
                jobs.append((work / f"train.{side}", side, out / f"train.{side}"))
            else:
                spec = specs[SIDES.index(side)]
                jobs.append((out / f"{role}.raw.{side}", side, out / f"{role}.{side}", spec))
    encode_files(tokenizer, jobs, dtype, cfg.data.clean.normalize, workers)
    shutil.rmtree(work)
    t_enc = time.time()

    clean = cfg.data.clean
    if clean.max_pieces or clean.max_piece_ratio:  # clean-corpus-n on pieces
        kept, dropped = filter_encoded_pairs(
            [str(out / f"train.{side}") for side in SIDES], clean, dtype
        )
        counts["train"]["clean"].update(dropped)
        counts["train"]["pairs"] = kept
    t_filter = time.time()

    tokenizer_files = [p.name for p in tokenizer.save(out)]  # before the checksums (reuse)
    meta = {
        "key": key,
        "files": {p.name: [p.stat().st_size, file_crc(p)] for p in sorted(out.iterdir())},
        "format": FORMAT_VERSION,
        "name": cfg.data.name,
        "data": dataclasses.asdict(cfg.data),
        "tokenizer": dataclasses.asdict(cfg.tokenizer),
        "tokenizer_files": tokenizer_files,
        "tokenizer_sha256": tokenizer.sha256(),
        "vocab_size": tokenizer.vocab_size,
        "dtype": dtype,
        "counts": counts,
        "seconds": {
            "read_clean": t_read - t0,
            "spm": t_spm - t_read,
            "encode": t_enc - t_spm,
            "piece_filter": t_filter - t_enc,
        },
    }
    for p in out.iterdir():  # durable before the directory is renamed into place
        with open(p, "rb") as f:
            os.fsync(f.fileno())
    write_json(out / "meta.json", meta)
    log.info(
        "prepared %s in %.1fs (read+clean %.1fs, SentencePiece %.1fs, encode %.1fs, piece "
        "filter %.1fs): %s",
        cfg.data.name,
        t_filter - t0,
        t_read - t0,
        t_spm - t_read,
        t_enc - t_spm,
        t_filter - t_enc,
        ", ".join(f"{r} {c['pairs']} pairs" for r, c in counts.items()),
    )


def _count_empty(pairs: Iterator[tuple[str, str]], empty: list[int]):
    """Pass pairs through, counting in ``empty[0]`` those whose source is blank."""
    for src, tgt in pairs:
        if not src.strip():
            empty[0] += 1
        yield src, tgt


def _norm_specs(cfg: Config) -> tuple[NormSpec, NormSpec]:
    """The text normalisation of (source, target) lines, from ``data.clean``."""
    return tuple(NormSpec.from_config(cfg.data.clean, lang)
                 for lang in (cfg.data.src_lang, cfg.data.tgt_lang))  # fmt: skip


def _write_pairs(pairs: Iterator[tuple[str, str]], src_path: Path, tgt_path: Path) -> int:
    """Stream pairs into two line files ("\\n" terminated, UTF-8); returns the pair count."""
    n = 0
    with (
        open(src_path, "w", encoding="utf-8", newline="") as fs,
        open(tgt_path, "w", encoding="utf-8", newline="") as ft,
    ):
        for src, tgt in pairs:
            fs.write(src + "\n")
            ft.write(tgt + "\n")
            n += 1
    return n


# ---- parallel encoding ------------------------------------------------------------------------
_WORKER: dict = {}


def _init_worker(blobs: list[bytes], dtype: str, nfc: bool) -> None:
    _WORKER.update(tokenizer=Tokenizer.from_bytes(blobs), dtype=np.dtype(dtype), nfc=nfc)


def _normalizer(spec: NormSpec | None):
    if spec is None:
        return lambda s: normalize_line(s, _WORKER["nfc"])
    if spec not in _WORKER:
        _WORKER[spec] = TextNormalizer(spec)
    return _WORKER[spec]


def _encode_chunk(
    task: tuple[str, str, int, int, NormSpec | None],
) -> tuple[np.ndarray, np.ndarray]:
    """Encode the lines in bytes [start, end) of a file -> (flat ids, lengths)."""
    path, side, start, end, spec = task
    with open(path, "rb") as f:
        f.seek(start)
        text = f.read(end - start).decode("utf-8")
    lines = list(map(_normalizer(spec), text.split("\n")[:-1]))
    ids = _WORKER["tokenizer"].encode(lines, side=side)
    lengths = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
    flat = np.fromiter(
        itertools.chain.from_iterable(ids), dtype=_WORKER["dtype"], count=int(lengths.sum())
    )
    return flat, lengths


def _byte_ranges(path: Path, chunk_bytes: int) -> list[tuple[int, int]]:
    """Cut a "\\n"-terminated file into ranges of about ``chunk_bytes`` ending at line ends."""
    size = path.stat().st_size
    ranges, start = [], 0
    with open(path, "rb") as f:
        while start < size:
            f.seek(min(start + chunk_bytes, size) - 1)
            f.readline()  # to the end of the line holding the cut
            end = min(f.tell(), size)
            ranges.append((start, end))
            start = end
    return ranges


def encode_files(
    tokenizer: Tokenizer,
    jobs: list[tuple[Path, str, Path]],
    dtype: str,
    nfc: bool,
    workers: int,
    chunk_bytes: int = CHUNK_BYTES,
) -> None:
    """Encode text files (one sentence per line) into ``<out>.ids`` / ``<out>.off`` pairs.

    Args:
        tokenizer: encodes each line (after :func:`mt.data.corpus.normalize_line`).
        jobs: (text file, side, output prefix) triples, or quadruples with a
            :class:`mt.data.cleaning.NormSpec` that replaces the plain normalisation for that file.
        dtype: numpy dtype of the flat ids.
        nfc: NFC-normalise lines before encoding (jobs without a NormSpec).
        workers: processes; 1 (or a small input) encodes in this process.
        chunk_bytes: text per task.
    """
    tasks, owner = [], []
    for j, (path, side, _, *spec) in enumerate(jobs):
        for start, end in _byte_ranges(path, chunk_bytes):
            tasks.append((str(path), side, start, end, spec[0] if spec else None))
            owner.append(j)
    init = (tokenizer.to_bytes(), dtype, nfc)
    total = sum(end - start for _, _, start, end, _ in tasks)
    if workers > 1 and total > chunk_bytes:  # else a pool's start-up costs more than it saves
        pool = mp.get_context("spawn").Pool(min(workers, len(tasks)), _init_worker, init)
        results = pool.imap(_encode_chunk, tasks)  # in order, a few chunks in flight
    else:
        pool = None
        _init_worker(*init)
        results = map(_encode_chunk, tasks)
    files = [(open(f"{o}.ids", "wb"), open(f"{o}.off", "wb")) for _, _, o, *_ in jobs]
    try:
        totals = [0] * len(jobs)
        for _, f_off in files:
            f_off.write(np.zeros(1, dtype=np.int64).tobytes())
        for j, (flat, lengths) in zip(owner, results):
            f_ids, f_off = files[j]
            f_ids.write(flat.tobytes())
            f_off.write((totals[j] + np.cumsum(lengths)).tobytes())
            totals[j] += int(lengths.sum())
    finally:
        for f_ids, f_off in files:
            f_ids.close()
            f_off.close()
        if pool is not None:
            pool.terminate()
