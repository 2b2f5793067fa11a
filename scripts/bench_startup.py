"""Start-up of ``mt-train`` on the 4.5M-pair rehearsal's prepared data (a benchmark, not a test).

Seconds from the launch of the process to the first update's batch handed to the update step:
the interpreter, the imports, the configuration, the prepared data's check, the model, the
training kernels and the epoch's batch plan. The child runs ``mt-train`` as ``python -m mt
train`` does, with the rehearsal's overrides (``scripts/rehearse_wmt.py``: its CPU batch,
eager), and exits at its first batch; nothing is trained or saved.

Several source trees (``--tree``, each a directory holding ``mt/`` and ``conf/``) are measured
in turns, run by run, so that a shared machine's load falls on each alike; the load average is
recorded beside each run.

Usage (the rehearsal's data prepared first, ``rehearse_wmt.py prepare``):
    .venv/bin/python scripts/bench_startup.py --out /tmp/wmt45 --runs 3 --tree /tmp/main --tree .
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from rehearse_wmt import CPU_BATCH, overrides  # noqa: E402  (numpy only)

# The child: mt-train, whose first batch (mt.train.recipe's _groups, patched as the module is
# imported, so that nothing is imported earlier than in a real start) prints the time and ends.
CHILD = r"""
import importlib.abc, importlib.util, os, sys, time
class Hook(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "mt.train.recipe":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module
        def exec_module(module):
            run(module)
            groups = module._groups
            def first(batches, n):
                for _ in groups(batches, n):
                    print("FIRST_BATCH", repr(time.time()), flush=True)
                    os._exit(0)
            module._groups = first
        spec.loader.exec_module = exec_module
        return spec
sys.meta_path.insert(0, Hook())
sys.argv = ["mt-train", *sys.argv[1:]]
from mt.cli import train_main
train_main()
"""


def run_once(tree: Path, args: list[str], log_path: Path) -> dict:
    """One start of ``tree``'s mt-train: seconds to its first batch (None: it did not get
    there), and the load average just before."""
    run_dir = Path(tempfile.mkdtemp(prefix="startup-run-"))
    env = dict(os.environ, PYTHONPATH=str(tree))
    load = os.getloadavg()
    start = time.time()
    proc = subprocess.run([sys.executable, "-c", CHILD, *args, f"run_dir={run_dir}"], env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
    log_path.write_text(proc.stdout)
    shutil.rmtree(run_dir, ignore_errors=True)
    first = [line.split()[1] for line in proc.stdout.splitlines() if line.startswith("FIRST_BATCH")]
    seconds = round(float(first[0]) - start, 2) if first else None
    return {"tree": str(tree), "seconds": seconds, "rc": proc.returncode,
            "load": [round(x, 2) for x in load]}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="the rehearsal's corpus and cache")
    parser.add_argument("--tree", type=Path, action="append", help="source tree(s), in turns")
    parser.add_argument("--runs", type=int, default=3, help="starts of each tree")
    parser.add_argument("--logs", type=Path, default=Path(tempfile.gettempdir()) / "startup-logs")
    parser.add_argument("overrides", nargs="*", help="more mt-train overrides")
    args = parser.parse_args()
    trees = [t.resolve() for t in (args.tree or [Path(__file__).resolve().parent.parent])]
    train = [*overrides(args.out), *CPU_BATCH, "train.device=cpu", "train.max_steps=1",
             "train.eval_every=0", "train.eval_bleu=false", "train.save_every=0",
             "train.average_last=0", *args.overrides]  # fmt: skip
    args.logs.mkdir(parents=True, exist_ok=True)
    results: dict[str, list[dict]] = {str(t): [] for t in trees}
    for i in range(args.runs):
        for j, tree in enumerate(trees):
            result = run_once(tree, train, args.logs / f"run{i}-tree{j}.log")
            print(json.dumps(result), flush=True)
            results[str(tree)].append(result)
    for tree, runs in results.items():
        times = [r["seconds"] for r in runs if r["seconds"] is not None]
        print(json.dumps({"tree": tree, "median_s": statistics.median(times) if times else None,
                          "runs_s": [r["seconds"] for r in runs]}))  # fmt: skip


if __name__ == "__main__":
    main()
