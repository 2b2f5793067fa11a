"""Data-loader benchmark: ``mt.data.batches.iterate_batches`` over a prepared split, alone.

``--data DIR/SPLIT`` names a prepared cache directory (``.cache/mt/<hash>``, what ``mt-prepare``
writes) and a role (train, valid, test); without it a synthetic split of random token arrays is
built in memory. The figure to compare with training is ``tok_per_s`` (non-pad target tokens
incl. EOS per second, the unit of the training benchmark's ``tgt_tok_per_s``).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import numpy as np
from bench_common import Recorder, environment, peak_memory_mb

from mt.data.batches import BatchSampler, iterate_batches
from mt.data.store import EncodedSplit, Prepared, TokenArray
from mt.vocab import PAD

log = logging.getLogger("bench")


def load_prepared(spec: str) -> tuple[Prepared, EncodedSplit]:
    """``DIR/ROLE`` -> the prepared directory ``DIR`` and its memory-mapped split ``ROLE``."""
    path = Path(spec)
    if not (path.parent / "meta.json").is_file():
        raise SystemExit(f"--data {spec}: expected <prepared cache dir>/<train|valid|test>")
    prepared = Prepared(path.parent)
    return prepared, prepared.split(path.name)


def load_split(spec: str) -> EncodedSplit:
    """``DIR/ROLE`` -> the memory-mapped split ``ROLE`` of the prepared directory ``DIR``."""
    return load_prepared(spec)[1]


def synthetic_split(n: int, min_len: int, max_len: int, vocab: int, seed: int) -> EncodedSplit:
    """``n`` random pairs, lengths uniform in [min_len, max_len], as in-memory TokenArrays."""
    rng = np.random.default_rng(seed)

    def array() -> TokenArray:
        lengths = rng.integers(min_len, max_len + 1, size=n)
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        ids = rng.integers(4, vocab, size=int(offsets[-1])).astype(np.int32)
        return TokenArray(ids, offsets)

    return EncodedSplit(array(), array())


def real_batches(
    split: EncodedSplit, spec: str, max_tokens: int, count: int, seed: int, rank: int = 0,
    world_size: int = 1, pad_multiple: int = 1, one_graph: bool = False, buckets: int = 0,
) -> list:  # fmt: skip
    """The first ``count`` batches of a prepared split (epochs repeat if needed): this rank's
    shard, the ranks of one step given batches of similar lengths, as in training; lengths
    padded up to a multiple of ``pad_multiple`` (``train.pad_multiple``); ``one_graph`` as
    training compiled (``mt.data.batches.collate``); ``buckets``: ``train.shape_buckets``."""
    sampler = BatchSampler(
        split.src.lengths, split.tgt.lengths, max_tokens, seed, rank, world_size,
        group=world_size, buckets=buckets, multiple=pad_multiple,
    )  # fmt: skip
    out, epoch = [], 1
    while len(out) < count:
        before = len(out)
        for batch in iterate_batches(
            split, sampler, epoch, pad_multiple=pad_multiple, one_graph=one_graph
        ):
            out.append(batch)
            if len(out) == count:
                break
        if len(out) == before:
            raise SystemExit(f"--data {spec}: no batches (max_tokens {max_tokens} too small?)")
        epoch += 1
    return out


def run_data(args, rec: Recorder) -> dict[str, Any]:
    """Time batch index building plus collation of whole epochs; emits one record."""
    if args.data:
        split, source = load_split(args.data), args.data
    else:
        split = synthetic_split(args.sentences, args.min_len, args.max_len, args.vocab, args.seed)
        source = f"synthetic n={args.sentences} len=[{args.min_len},{args.max_len}]"
    start = time.perf_counter()
    buckets = getattr(args, "shape_buckets", 0)
    sampler = BatchSampler(split.src.lengths, split.tgt.lengths, args.max_tokens, args.seed,
                           buckets=buckets)  # fmt: skip
    setup = time.perf_counter() - start
    batches = tgt_tokens = src_tokens = padded = 0
    total = 0.0
    for epoch in range(1, args.epochs + 1):
        start = time.perf_counter()
        for batch in iterate_batches(split, sampler, epoch):
            batches += 1
            tgt_tokens += batch.ntokens
            src_tokens += int((batch.src != PAD).sum())
            if buckets:  # a bucket's empty rows hold one EOS each and no target
                src_tokens -= int((batch.tgt_out[:, 0] == PAD).sum())
            padded += batch.src.numel() + batch.tgt_out.numel()
            if args.max_batches and batches >= args.max_batches * epoch:
                break
        total += time.perf_counter() - start
    record = {
        "bench": "data",
        "source": source,
        "pairs": len(split),
        "max_tokens": args.max_tokens,
        "epochs": args.epochs,
        "batches": batches,
        "sampler_setup_s": setup,
        "batches_per_s": batches / total,
        "tok_per_s": tgt_tokens / total,
        "src_tok_per_s": src_tokens / total,
        "padding_fraction": 1 - (tgt_tokens + src_tokens) / max(padded, 1),
        # each side's padded share of a whole epoch (shape buckets: their widths, empty rows)
        "padding_share": dict(zip(("src", "tgt"), sampler.padding_fraction(1))),
        "shape_buckets": buckets,
        "shapes": sampler.buckets.shapes() if sampler.buckets is not None else None,
        "skipped": sampler.num_skipped,
        "peak_mem_mb": peak_memory_mb(args.device_obj)[0],
        "peak_mem_kind": peak_memory_mb(args.device_obj)[1],
        **environment(args.device_obj),
    }
    rec.emit(record)
    return record
