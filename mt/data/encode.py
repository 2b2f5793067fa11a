"""Encoding text files into the prepared store's flat id files, on all cores.

The text files are cut into byte ranges at line ends and a pool of worker processes encodes
them; results are appended to the flat files in order, so no stage ever holds the corpus as
Python objects.
"""

from __future__ import annotations

import contextlib
import itertools
import multiprocessing as mp
from pathlib import Path
from typing import NamedTuple

import numpy as np

from mt.data.cleaning import NormSpec, TextNormalizer, normalize_line
from mt.data.tokenizer import Tokenizer

CHUNK_BYTES = 4 << 20  # text per encoding task
_WORKER: dict = {}


class Sampling(NamedTuple):
    """Subword regularisation of one file (:meth:`mt.data.tokenizer.Tokenizer.sample`)."""

    alpha: float
    seed: int


def _init_worker(blobs: list[bytes], dtype: str, nfc: bool) -> None:
    _WORKER.update(tokenizer=Tokenizer.from_bytes(blobs), dtype=np.dtype(dtype), nfc=nfc)


def _normalizer(spec: NormSpec | None):
    if spec is None:
        return lambda s: normalize_line(s, _WORKER["nfc"])
    if spec not in _WORKER:
        _WORKER[spec] = TextNormalizer(spec)
    return _WORKER[spec]


def _encode_chunk(
    task: tuple[str, str, int, int, NormSpec | None, Sampling | None],
) -> tuple[np.ndarray, np.ndarray]:
    """Encode the lines in bytes [start, end) of a file -> (flat ids, lengths)."""
    path, side, start, end, spec, sampling = task
    with open(path, "rb") as f:
        f.seek(start)
        text = f.read(end - start).decode("utf-8")
    lines = list(map(_normalizer(spec), text.split("\n")[:-1]))
    if sampling is None:
        ids = _WORKER["tokenizer"].encode(lines, side=side)
    else:  # each chunk its own seed, from the file's and where the chunk starts
        alpha, seed = sampling
        ids = _WORKER["tokenizer"].sample(lines, side, alpha, _chunk_seed(seed, start))
    lengths = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
    flat = np.fromiter(
        itertools.chain.from_iterable(ids), dtype=_WORKER["dtype"], count=int(lengths.sum())
    )
    return flat, lengths


def _chunk_seed(seed: int, start: int) -> int:
    """SentencePiece's seed (32 bits) for the chunk that begins at byte ``start``."""
    return int(np.random.SeedSequence([seed, start]).generate_state(1)[0])


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

    ``jobs``: (text file, side, output prefix) triples, or with a fourth item, a
    :class:`mt.data.cleaning.NormSpec` that replaces the plain normalisation
    (:func:`mt.data.cleaning.normalize_line`, NFC when ``nfc``) for that file (or None), and a
    fifth, a :class:`Sampling` (subword regularisation: that file's pieces drawn at random).
    ``workers`` processes encode ``chunk_bytes`` of text a task; 1 (or a small input): this one.
    """
    tasks, owner = [], []
    for j, (path, side, _, *extra) in enumerate(jobs):
        spec, sampling = (list(extra) + [None, None])[:2]
        for start, end in _byte_ranges(path, chunk_bytes):
            tasks.append((str(path), side, start, end, spec, sampling))
            owner.append(j)
    init = (tokenizer.to_bytes(), dtype, nfc)
    total = sum(end - start for _, _, start, end, *_ in tasks)
    with contextlib.ExitStack() as stack:
        if workers > 1 and total > chunk_bytes:  # else a pool's start-up costs more than it saves
            pool = mp.get_context("spawn").Pool(min(workers, len(tasks)), _init_worker, init)
            stack.enter_context(pool)  # terminated on leaving
            results = pool.imap(_encode_chunk, tasks)  # in order, a few chunks in flight
        else:
            _init_worker(*init)
            results = map(_encode_chunk, tasks)
        files = [
            [stack.enter_context(open(f"{o}.{ext}", "wb")) for ext in ("ids", "off")]
            for _, _, o, *_ in jobs
        ]
        totals = [0] * len(jobs)
        for _, f_off in files:
            f_off.write(np.zeros(1, dtype=np.int64).tobytes())
        for j, (flat, lengths) in zip(owner, results):
            f_ids, f_off = files[j]
            f_ids.write(flat.tobytes())
            f_off.write((totals[j] + np.cumsum(lengths)).tobytes())
            totals[j] += int(lengths.sum())
