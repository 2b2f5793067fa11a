"""A 4.5M-pair rehearsal of the WMT14 data path (a benchmark, not a test).

WMT14 en-de has ~4.5M training pairs. This script builds a corpus of that size from the news
text in shared/data, with no repeated line, so SentencePiece and de-duplication work as on real
data: every line joins two different news sentences (pair i, then pair j; each (i, j) used once).
Then it times ``mt prepare`` with the ``wmt14_en_de_base`` settings (WMT cleaning, joint BPE 37k
on a 2M-sentence sample) pointed at it, sampling the resident memory of the whole process tree
(main process and every worker) to report the peak of their sum; and it times the batch
planning of one epoch and runs 50 training updates of ``base`` on CPU from that cache.

Usage (outputs go outside the repository):
    MT_DATA_DIR=../shared/data .venv/bin/python scripts/rehearse_wmt.py build --out /tmp/wmt45
    .venv/bin/python scripts/rehearse_wmt.py prepare --out /tmp/wmt45
    .venv/bin/python scripts/rehearse_wmt.py train --out /tmp/wmt45 --steps 50
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

log = logging.getLogger("rehearse")

# Training text: news test sets that are neither the valid (2013) nor the test (2014) set.
NEWS = [f"wmt_newstest_de-en/newstest{y}" for y in
        ("2008", "2009", "2010", "2011", "2012", "2015", "2016", "2018", "2019-deen",
         "2019-ende")] + ["wmt17_ende_systems/newstest2017"]  # fmt: skip


def _lines(path: Path) -> list[str]:
    return path.read_text(encoding="utf-8").split("\n")[:-1]


def build(data: Path, out: Path, pairs: int, seed: int) -> dict:
    """Write ``out/train.{en,de}`` (``pairs`` joined lines) and the valid/test sets."""
    en, de = [], []
    for prefix in NEWS:
        en += _lines(data / f"{prefix}.en")
        de += _lines(data / f"{prefix}.de")
    seen_en, seen_de, pool = set(), set(), []
    for e, d in zip(en, de):  # every sentence once on each side
        e, d = e.strip(), d.strip()
        if e and d and e not in seen_en and d not in seen_de:
            seen_en.add(e)
            seen_de.add(d)
            pool.append((e, d))
    p = len(pool)
    rng = np.random.default_rng(seed)
    codes = np.zeros(0, dtype=np.int64)
    while len(codes) < pairs:  # distinct (i, j) with i != j, in random order
        draw = rng.integers(0, p * p, size=int(pairs * 1.05), dtype=np.int64)
        draw = draw[draw // p != draw % p]
        codes = np.concatenate([codes, draw])
        _, first = np.unique(codes, return_index=True)
        codes = codes[np.sort(first)]
    codes = codes[:pairs]
    out.mkdir(parents=True, exist_ok=True)
    for side in (0, 1):
        lang = ("en", "de")[side]
        text = [s[side] for s in pool]
        with open(out / f"train.{lang}", "w", encoding="utf-8", newline="\n") as f:
            for block in range(0, pairs, 100_000):
                c = codes[block : block + 100_000]
                f.write("".join(f"{text[i]} {text[j]}\n" for i, j in zip(c // p, c % p)))
    for split, name in (("valid", "newstest2013"), ("test", "newstest2014")):
        for lang in ("en", "de"):
            (out / f"{split}.{lang}").write_bytes((data / "wmt14" / f"{name}.{lang}").read_bytes())
    sizes = {f"train.{lang}": (out / f"train.{lang}").stat().st_size for lang in ("en", "de")}
    return {"pool_pairs": p, "pairs": pairs, "bytes": sizes}


# On one CPU: batches of one GPU of eight (the experiment's 25k-token global batch would take a
# minute an update here); the path is what the rehearsal proves, not the recipe.
# Eager: the experiment compiles for a GPU (minutes of Inductor before a CPU's first update).
CPU_BATCH = ["train.batch_tokens=0", "train.max_tokens=3125", "train.compile=false"]


def overrides(out: Path) -> list[str]:
    """``wmt14_en_de_base`` with its data read from the rehearsal corpus."""
    return [
        "experiment=wmt14_en_de_base",
        "data.source=local",
        f"data.dir={out}",
        "data.format=text",
        "data.splits.train=train",
        "data.splits.valid=valid",
        "data.splits.test=test",
        f"cache_dir={out / 'cache'}",
    ]


def _tree_rss(root: int) -> int:
    """Sum of VmRSS (bytes) of ``root`` and all its descendants (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    total, todo = 0, [root]
    while todo:
        pid = todo.pop()
        todo += children.get(pid, [])
        try:
            with open(f"/proc/{pid}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1]) * 1024
        except OSError:
            pass
    return total


def run_measured(cmd: list[str], log_path: Path) -> dict:
    """Run ``cmd``; wall seconds and the peak summed RSS of its process tree (0.2 s samples)."""
    start = time.time()
    with open(log_path, "w") as logf:
        proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT)
        peak = [0]

        def sample() -> None:
            while proc.poll() is None:
                peak[0] = max(peak[0], _tree_rss(proc.pid))
                time.sleep(0.2)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        rc = proc.wait()
        sampler.join()
    return {"rc": rc, "wall_s": round(time.time() - start, 1),
            "peak_tree_rss_gb": round(peak[0] / 2**30, 2)}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("stage", choices=["build", "prepare", "train"])
    parser.add_argument("--out", type=Path, required=True, help="corpus and cache (not the repo)")
    parser.add_argument("--data", type=Path, default=Path(os.environ.get("MT_DATA_DIR", "")))
    parser.add_argument("--pairs", type=int, default=4_500_000)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--steps", type=int, default=50)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    py = [sys.executable, "-m", "mt"]
    if args.stage == "build":
        t0 = time.time()
        result = build(args.data, args.out, args.pairs, args.seed)
        result["wall_s"] = round(time.time() - t0, 1)
    elif args.stage == "prepare":
        result = run_measured([*py, "prepare", *overrides(args.out)], args.out / "prepare.log")
        metas = sorted((args.out / "cache").glob("*/meta.json"), key=os.path.getmtime)
        meta = json.loads(metas[-1].read_text())
        result.update(stages_s={k: round(v, 1) for k, v in meta["seconds"].items()},
                      counts=meta["counts"])  # fmt: skip
    else:
        result = {"plan": plan_epoch(args.out)}
        run = args.out / "run"
        cmd = [*py, "train", *overrides(args.out), *CPU_BATCH, f"run_dir={run}", "train.device=cpu",
               f"train.max_steps={args.steps}", "train.log_every=10", "train.eval_every=0",
               "train.eval_bleu=false", "train.save_every=0", "train.average_last=0"]  # fmt: skip
        result["train"] = run_measured(cmd, args.out / "train.log")
        result["train"]["metrics"] = (run / "metrics.jsonl").read_text().splitlines()[-3:]
    print(json.dumps(result, indent=1))


def plan_epoch(out: Path) -> dict:
    """Time the batch plan of one epoch of the prepared train split, as training builds it."""
    from mt.config import load_config
    from mt.data.build import prepare
    from mt.train.state import train_sampler

    cfg = load_config([*overrides(out), *CPU_BATCH])
    split = prepare(cfg).split("train")
    t0 = time.perf_counter()
    sampler = train_sampler(split, cfg, 0, 1)
    batches = sampler.batches(0)
    seconds = time.perf_counter() - t0
    return {"pairs": len(split), "batches": len(batches), "seconds": round(seconds, 2)}


if __name__ == "__main__":
    main()
