"""Benchmark stages 1-2 (``mt.data.build.prepare``) at scale: wall time and peak memory.

Builds a corpus of ``--pairs`` training pairs by repeating Multi30k train (``--pairs 0``: Multi30k
as it is) in a temporary directory, prepares it from scratch (SentencePiece BPE on a random
sample of ``--sample`` sentences, vocabulary ``--vocab``) and prints one JSON line with the wall
seconds and the peak resident set size of this process and of its worker processes.

Usage:
    MT_DATA_DIR=../shared/data .venv/bin/python scripts/bench_prepare.py --pairs 1000000
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import resource
import sys
import tempfile
import time
from pathlib import Path


def build_corpus(src_dir: Path, out: Path, pairs: int, langs: tuple[str, str]) -> int:
    """Write train.<lang> of ``pairs`` lines (Multi30k train repeated); copy val and test."""
    out.mkdir(parents=True, exist_ok=True)
    for lang in langs:
        lines = (src_dir / f"train.{lang}").read_bytes().split(b"\n")[:-1]
        n = pairs or len(lines)
        with open(out / f"train.{lang}", "wb") as f:
            for start in range(0, n, len(lines)):
                f.write(b"".join(s + b"\n" for s in lines[: min(len(lines), n - start)]))
        for split in ("val", "test_2016_flickr"):
            (out / f"{split}.{lang}").write_bytes((src_dir / f"{split}.{lang}").read_bytes())
    return n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pairs", type=int, default=1_000_000, help="0 = Multi30k as it is")
    parser.add_argument("--sample", type=int, default=200_000, help="SentencePiece sample")
    parser.add_argument("--vocab", type=int, default=8000)
    parser.add_argument("--data", default=os.environ.get("MT_DATA_DIR", "../shared/data"))
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")

    from mt.config import load_config
    from mt.data.build import prepare

    with tempfile.TemporaryDirectory(prefix="mt-bench-") as tmp:
        corpus = Path(tmp) / "corpus"
        n = build_corpus(Path(args.data) / "multi30k", corpus, args.pairs, ("de", "en"))
        cfg = load_config(
            [
                "data=local",
                f"data.dir={corpus}",
                "data.splits.train=train",
                "data.splits.valid=val",
                "data.splits.test=test_2016_flickr",
                f"tokenizer.vocab_size={args.vocab}",
                f"tokenizer.input_sentence_size={args.sample}",
                f"cache_dir={Path(tmp) / 'cache'}",
            ]
        )
        rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        t0 = time.perf_counter()
        prepared = prepare(cfg)
        wall = time.perf_counter() - t0
        self_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        child_kb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
        size = sum(f.stat().st_size for f in prepared.dir.iterdir())
        result = {
            "pairs": n,
            "train_pairs_kept": len(prepared.split("train")),
            "vocab_size": prepared.vocab_size,
            "cores": os.cpu_count(),
            "wall_s": round(wall, 1),
            "stages_s": {k: round(v, 1) for k, v in prepared.meta["seconds"].items()},
            "peak_rss_mb_main": round(self_kb / 1024),
            "peak_rss_mb_main_before_prepare": round(rss_before / 1024),
            "peak_rss_mb_largest_child": round(child_kb / 1024),
            "peak_rss_mb_upper_bound": round((self_kb + child_kb * os.cpu_count()) / 1024),
            "cache_mb": round(size / 2**20, 1),
        }
    sys.stdout.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
