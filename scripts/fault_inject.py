"""Fault injection: SIGKILL a short training run at random moments, then check it recovers.

A tiny model trains on a small synthetic corpus, saving every update. The run is started, killed
with SIGKILL at a random moment (or the moment a checkpoint write has begun: a temporary file
appears), restarted, killed again, ... ``--kills`` times; a last start runs to the end. Then:

- every start resumed without an error (any unexpected exit fails the experiment at once);
- the final weights equal those of an uninterrupted run with the same settings (``--atol``);
- ``metrics.jsonl`` logs every step exactly once, with the uninterrupted run's losses;
- no temporary file of a killed write is left.

Runs are forked from this process after ``mt.train.recipe`` (torch, Hydra, TensorBoard) is imported,
so a start costs a fraction of a second instead of an interpreter start-up; this process itself
runs no torch operation before the last fork (forking after OpenMP has started is unsafe).

    python scripts/fault_inject.py --kills 200          # the long version (~10 minutes)
    python scripts/fault_inject.py --kills 20 --json    # what tests/test_faults.py runs

Prints one JSON object (``--json``) or a summary: kills made, kills inside a checkpoint write,
final step, largest weight difference.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import signal
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

WORDS_DE = "ein mann hund fährt rennt im schnee auf dem fahrrad eine frau kind spielt".split()
WORDS_EN = "a man dog rides runs in the snow on bike woman child plays the".split()


def make_corpus(directory: Path, seed: int = 0) -> Path:
    """A small random parallel corpus as ``<split>.de`` / ``<split>.en`` files."""
    rng = random.Random(seed)
    directory.mkdir(parents=True, exist_ok=True)
    for split, n in (("train", 300), ("valid", 20), ("test", 20)):
        for lang, words in (("de", WORDS_DE), ("en", WORDS_EN)):
            lines = [" ".join(rng.choices(words, k=rng.randint(3, 12))) for _ in range(n)]
            (directory / f"{split}.{lang}").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return directory


def overrides(data: Path, cache: Path, run_dir: Path, max_steps: int) -> list[str]:
    """The tiny configuration: one layer of width 32, a checkpoint every update, dropout on
    (so the RNG states must be restored too)."""
    return [
        "data=local",
        f"data.dir={data}",
        f"cache_dir={cache}",
        f"run_dir={run_dir}",
        "tokenizer.vocab_size=120",
        "tokenizer.byte_fallback=false",
        "tokenizer.threads=1",
        "model.N=1",
        "model.d_model=32",
        "model.d_ff=64",
        "model.h=2",
        "model.dropout=0.1",
        "train.device=cpu",
        "train.threads=1",
        "train.max_tokens=300",
        "train.warmup=10",
        "train.lr=3e-3",
        "train.cooldown=0",
        "train.max_minutes=0",
        f"train.max_steps={max_steps}",
        "train.log_every=1",
        "train.eval_every=0",
        "train.save_every=1",
        "train.keep_last=3",
        "train.average_last=0",
        "train.eval_bleu=false",
    ]


def fork_train(cfg, log_path: Path) -> int:
    """Fork a child that runs ``train(cfg)`` with stdout/stderr in ``log_path``; returns its
    pid. The child exits with mt-train's status (0, 75 after a signal, 1 on an error)."""
    pid = os.fork()
    if pid:
        return pid
    status = 1
    try:
        fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        from mt.cli import setup_logging, user_errors
        from mt.train.preempt import exit_status
        from mt.train.recipe import train

        setup_logging()
        try:
            with user_errors("mt-train"):
                status = exit_status(train(cfg).get("signal"))
        except SystemExit as e:
            status = e.code if isinstance(e.code, int) else 1
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)


def wait(pid: int) -> int:
    """The exit status of a child (negative: killed by that signal)."""
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def temps(ckpt_dir: Path) -> list[str]:
    try:
        return [n for n in os.listdir(ckpt_dir) if ".tmp" in n]
    except FileNotFoundError:
        return []


def run_to_end(cfg, log_path: Path) -> None:
    status = wait(fork_train(cfg, log_path))
    if status != 0:
        raise SystemExit(f"a run exited with {status}:\n{log_path.read_text()[-3000:]}")


def experiment(kills: int, seed: int, workdir: Path, atol: float) -> dict:
    import torch._dynamo  # noqa: F401  (the optimiser imports it: seconds per start otherwise)

    import mt.train.recipe  # noqa: F401  (imported before forking: starts cost no imports)
    from mt.config import load_config

    try:
        import torch.utils.tensorboard  # noqa: F401
    except ImportError:
        pass
    rng = random.Random(seed)
    data = make_corpus(workdir / "data", seed)
    cache = workdir / "cache"
    killed = workdir / "killed"
    ckpt_dir = killed / "checkpoints"
    log_path = workdir / "killed.log"
    endless = load_config(overrides(data, cache, killed, 100_000))

    # The prepared data and mt's C++ kernels first (a cache every start then only loads), in a
    # child of its own. Built by the first start instead, the kernels made its calibration a
    # compile's minute (more beside a test run building them too), and a kill during the
    # build left a lock the next start waited on: 139 s for this experiment in CI against 21.
    pid = os.fork()
    if pid == 0:
        from mt.data.build import prepare
        from mt.fast import native

        try:
            prepare(endless)
            native.dropout()  # builds or loads the kernels (None where they cannot be built)
        finally:
            os._exit(0)
    wait(pid)
    # Calibration: how long a start takes to its first few checkpoints.
    t0 = time.monotonic()
    pid = fork_train(endless, log_path)
    while not (ckpt_dir / "checkpoint_3.pt").exists():
        if os.waitpid(pid, os.WNOHANG) != (0, 0):
            raise SystemExit(f"the first start exited early:\n{log_path.read_text()[-3000:]}")
        time.sleep(0.002)
    horizon = time.monotonic() - t0
    os.kill(pid, signal.SIGKILL)
    wait(pid)
    made, in_write = 1, 0
    start = time.monotonic()
    while made < kills:
        pid = fork_train(endless, log_path)
        if made % 3 == 0:  # kill the moment a checkpoint write has begun
            end = time.monotonic() + 2 * horizon
            while not temps(ckpt_dir) and time.monotonic() < end:
                pass
        else:
            time.sleep(rng.uniform(0.0, 1.5 * horizon))
        done = os.waitpid(pid, os.WNOHANG)
        if done != (0, 0):
            raise SystemExit(
                f"start {made + 1} exited by itself ({os.waitstatus_to_exitcode(done[1])}):\n"
                f"{log_path.read_text()[-3000:]}"
            )
        os.kill(pid, signal.SIGKILL)
        wait(pid)
        made += 1
        in_write += bool(temps(ckpt_dir))
    kill_seconds = time.monotonic() - start

    # The last start runs to a step a little beyond where the kills left it; the reference
    # run trains uninterrupted to the same step.
    reached = max((int(p.stem.split("_")[1]) for p in ckpt_dir.glob("checkpoint_*.pt")), default=0)
    final_step = reached + 5
    run_to_end(load_config(overrides(data, cache, killed, final_step)), log_path)
    reference = workdir / "reference"
    run_to_end(load_config(overrides(data, cache, reference, final_step)), workdir / "ref.log")

    # No more forks from here: comparing with torch is safe.
    from mt.checkpoint import load_checkpoint

    a = load_checkpoint(reference / "checkpoints" / "last.pt")
    b = load_checkpoint(ckpt_dir / "last.pt")
    diff = max(float((a["model"][k] - b["model"][k]).abs().max()) for k in a["model"])
    records = [json.loads(x) for x in (killed / "metrics.jsonl").read_text().splitlines()]
    ref_records = [json.loads(x) for x in (reference / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in records if "loss" in r]
    ref_loss = {r["step"]: r["loss"] for r in ref_records if "loss" in r}
    loss_diff = max(abs(r["loss"] - ref_loss[r["step"]]) for r in records if "loss" in r)
    result = {
        "kills": made,
        "kills_inside_checkpoint_writes": in_write,
        "kill_seconds": round(kill_seconds, 1),
        "steps_reached_by_kills": reached,
        "final_step": int(b["step"]),
        "reference_step": int(a["step"]),
        "max_weight_diff": diff,
        "max_loss_diff": loss_diff,
        "steps_logged_once": steps == list(range(1, final_step + 1)),
        "temporary_files_left": temps(ckpt_dir) + [n for n in os.listdir(killed) if ".tmp" in n],
    }
    result["ok"] = (
        result["final_step"] == result["reference_step"] == final_step
        and diff <= atol
        and loss_diff <= atol
        and result["steps_logged_once"]
        and not result["temporary_files_left"]
    )
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kills", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--atol", type=float, default=1e-6)
    parser.add_argument("--workdir", type=Path, help="keep the runs here (default: a temp dir)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    with tempfile.TemporaryDirectory(prefix="mt-faults-") as tmp:
        workdir = args.workdir or Path(tmp)
        result = experiment(args.kills, args.seed, workdir, args.atol)
    if args.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key}: {value}")
    sys.exit(0 if result["ok"] else 1)


if __name__ == "__main__":
    main()
