"""The prepared data on disk, as training and decoding read it: memory-mapped encoded splits,
the tokenizer, and the raw valid/test lines for sacreBLEU.

Layout of a prepared directory (written by ``mt.data.build``)::

    meta.json                      key, settings, counts, vocab size, id dtype, the size,
                                   CRC-32 and modification time of every other file, and a
                                   digest of itself (checked on load, :class:`Prepared`: a
                                   damaged cache is rebuilt)
    spm.model | spm.{src,tgt}.model
    <role>.<side>.ids              flat ids of all sentences (uint16 if V <= 65536 else int32)
    <role>.<side>.off              int64 offsets (n + 1): sentence i is ids[off[i]:off[i+1]]
    train.sampled<k>.<side>.{ids,off}  with tokenizer.sampling_alpha: the training pairs'
                                   sampled encodings (subword regularisation), k = 0, 1, ...
    {valid,test}.raw.{src,tgt}     the raw lines exactly as read (for sacreBLEU)
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from mt.data.corpus import ROLES, DataError
from mt.data.tokenizer import SIDES, Tokenizer
from mt.files import damaged_file

FORMAT_VERSION = 3  # bump when the layout or the processing changes (3: pairs per corpus)


class TokenArray:
    """Variable-length id sequences stored flat: ``ids`` (memory-mapped), one sequence after
    another, and (n + 1,) int64 ``offsets``: sequence ``i`` is ``ids[offsets[i]:offsets[i + 1]]``.
    """

    def __init__(self, ids: np.ndarray, offsets: np.ndarray):
        self.ids = ids
        self.offsets = offsets
        self._lengths: np.ndarray | None = None

    @classmethod
    def from_sequences(cls, seqs, dtype=np.int32) -> TokenArray:
        """In memory, from a list of id sequences."""
        offsets = np.concatenate([[0], np.cumsum([len(s) for s in seqs])]).astype(np.int64)
        flat = [np.asarray(s, dtype=dtype) for s in seqs]
        return cls(np.concatenate(flat) if flat else np.zeros(0, dtype=dtype), offsets)

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

    def gather(self, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Sequences ``idx`` at once: their ids one after another, (sum of lengths,) int64,
        and their (k,) lengths. One fancy index into the flat ids instead of a slice per
        sequence (a memory-mapped slice per sequence would be most of a loader's time, in
        Python overhead)."""
        idx = np.asarray(idx, dtype=np.int64)
        starts = np.asarray(self.offsets)[idx]  # a plain view: no memmap bookkeeping
        lengths = self.lengths[idx]
        return np.asarray(self.ids)[runs(starts, lengths)].astype(np.int64), lengths

    @property
    def lengths(self) -> np.ndarray:
        """(n,) int64 length of each sequence."""
        if self._lengths is None:
            self._lengths = np.diff(np.asarray(self.offsets))
        return self._lengths


def runs(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Positions ``starts[r] + j`` for ``j < counts[r]``, run after run, (sum of counts,) int64:
    each run's start, repeated, plus a ramp (no Python loop over the runs)."""
    ends = np.cumsum(counts)
    ramp = np.arange(int(ends[-1]) if len(ends) else 0, dtype=np.int64)
    return ramp + np.repeat(starts - (ends - counts), counts)


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


VERIFY = ("quick", "full")  # data.verify


def meta_digest(meta: dict) -> str:
    """sha256 of ``meta.json``'s content without its own ``digest`` field (as JSON reads it)."""
    body = {k: v for k, v in meta.items() if k != "digest"}
    text = json.dumps(body, sort_keys=True, ensure_ascii=False, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


class Prepared:
    """A prepared-data directory: the tokenizer, encoded splits and raw references.

    ``verify`` checks the files against ``meta.json`` (a cache read back later): ``"quick"``
    (or True) checks the meta's own digest and every file's size, and reads (CRC-32) only the
    files whose modification time differs from the one recorded at prepare time (a copied or
    rewritten cache; every file of data prepared before times were recorded); ``"full"`` reads
    every file (``data.verify=full``: damage that keeps size and time). False: none (a
    directory this process has just written).
    """

    def __init__(self, path: Path, verify: bool | str = "quick"):
        self.dir = Path(path)
        if verify not in (True, False, *VERIFY):
            raise ValueError(f"data.verify={verify!r}: expected one of {', '.join(VERIFY)}")
        meta_path = self.dir / "meta.json"
        try:
            self.meta = json.loads(meta_path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as err:
            raise CacheError(f"{meta_path} is unreadable ({err})") from None
        if verify and "digest" in self.meta and meta_digest(self.meta) != self.meta["digest"]:
            raise CacheError(f"{meta_path} is damaged (its content differs from its digest)")
        files = self.meta.get("files")
        damaged = damaged_file(self.dir, files, full=verify == "full") if verify else None
        if damaged is not None:
            raise CacheError(f"prepared data file {damaged} is damaged (size or checksum differs)")
        self.tokenizer = Tokenizer.load([self.dir / n for n in self.meta["tokenizer_files"]])
        self.vocab_size: int = self.tokenizer.vocab_size
        self._splits: dict[str, EncodedSplit] = {}

    def split(self, role: str) -> EncodedSplit:
        """The encoded ``role`` ("train", "valid" or "test"), memory-mapped."""
        _check_role(role)
        return self._open(role)

    def _open(self, name: str) -> EncodedSplit:
        """``<name>.{src,tgt}.{ids,off}``, memory-mapped once."""
        if name not in self._splits:
            arrays = [
                TokenArray.open(
                    self.dir / f"{name}.{side}.ids",
                    self.dir / f"{name}.{side}.off",
                    self.meta["dtype"],
                )
                for side in SIDES
            ]
            self._splits[name] = EncodedSplit(*arrays)
        return self._splits[name]

    @property
    def sampled_copies(self) -> int:
        """Sampled encodings of the training split (``tokenizer.sampling_alpha``; 0: none)."""
        return int(self.meta.get("counts", {}).get("train", {}).get("sampled_copies", 0))

    def train_split(self, epoch: int) -> EncodedSplit:
        """The training pairs as ``epoch`` reads them: sampled encoding ``epoch`` mod
        :attr:`sampled_copies` (subword regularisation), else the one plain encoding."""
        copies = self.sampled_copies
        if copies == 0:
            return self.split("train")
        return self._open(f"train.sampled{epoch % copies}")

    def corpus_sizes(self) -> list[int] | None:
        """Pairs of each training corpus (``data.splits.train``'s entries, in order), as
        prepared; None for data prepared before this was recorded."""
        corpora = self.meta.get("counts", {}).get("train", {}).get("corpora")
        return None if corpora is None else [int(c["pairs"]) for c in corpora]

    def directions(self, role: str) -> list[tuple[str, range]]:
        """Each direction of ``role`` ("valid" or "test") with its range of the split's pairs,
        for data prepared with ``data.directions`` (else empty)."""
        out, start = [], 0
        for d in self.meta.get("counts", {}).get(role, {}).get("directions") or []:
            out.append((d["name"], range(start, start + int(d["pairs"]))))
            start += int(d["pairs"])
        return out

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
    hand edit); ``mt.data.build.prepare`` rebuilds it."""


def _check_role(role: str) -> None:
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, got {role!r}")
