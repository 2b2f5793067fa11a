"""``make gpu-check``: everything this project wants measured on a GPU, in one command.

On a machine with a GPU, run this once; it fits in a time budget (``--budget``) and writes one
folder (``--out``, default ``$OUT`` or ``gpu-check/``) with a summary table (summary.md) and
the raw records beside it. The steps run in the order below, the tests beside the (CPU-only)
data preparation; each step is given what is left of the budget, and a step that cannot
start in time is listed as skipped:

1. ``environment``: nvidia-smi, torch, CUDA, the GPU.
2. ``tests``: ``pytest -m gpu`` (every GPU test carries the marker).
3. ``bench``: training steps of ``base`` and ``big`` in bf16 on real sentence lengths (the news
   corpus, prepared), eager and compiled: target tokens/s, MFU against the datasheet peak and
   against a measured matmul, peak memory.
   The loader alone on the same split (``bench data``: batches/s against the step's).
4. ``multi30k``: ``make train``'s pipeline (prepare, train, evaluate) on Multi30k de->en on the
   GPU: test BLEU with its signature, wall time per stage (``--multi30k-minutes`` caps the
   training as ``train.max_minutes`` does).
5. ``profile``: three updates of ``base`` under torch.profiler, each at lengths not met
   before (as batches by tokens bring them), then three of one batch seen before: the top
   kernels, kernel launches per update, the GPU's busy share and the host's microseconds per
   matrix product of each, so a per-shape cost on the host shows; the copies of one update by
   input shape; a product alone at new and at seen row counts with cuBLAS and with cuBLASLt
   (which of the two keeps the per-shape cost low).
6. ``base-pad8``: ``base`` eager again with the batches' lengths padded to multiples of 8
   (``train.pad_multiple=8``): whether fewer distinct shapes buy back more than the padding.
7. ``base-master``, ``big-master``: the same eager benches with a bf16 model and float32 master
   weights (``train.master_weights=true``, the WMT experiments' setting) instead of autocast;
   ``base-master-compiled``, ``big-master-compiled`` the same, compiled (the figures that chose
   master weights for the WMT experiments: docs/performance.md).
8. ``multi30k-master``: step 4 again in bf16 with master weights, in a run directory of its own
   (the corpus prepared once): the test score of a bf16 model beside autocast's.
9. ``base-master-lt``, ``big-master-lt``: the eager master-weights benches with torch's products
   on cuBLASLt (``bench train --blas cublaslt``), beside their cuBLAS twins.
10. ``base-master-compiled-buckets``, ``big-master-compiled-buckets``: the batches in
   ``SHAPE_BUCKETS`` shapes (``train.shape_buckets``), the whole step compiled and replayed as
   CUDA graphs (``mt.fast.graphs``): MFU, graphs, the seconds of the steps at a shape met first
   (compiling and capturing), the padding share, the GPU memory reserved (the graphs' pools);
   ``base-master-buckets`` the same batches eager; ``profile-buckets`` step 5 at bucket shapes
   with the whole step compiled: kernel launches per update and the GPU's busy share.
11. ``memory``: one training step's peak GPU memory, with and without activation checkpointing
   (``train.activation_checkpointing``), measured beside the memory model's figure
   (``bench memory``: ``base`` and ``big``, bf16 with master weights, 25k tokens, V 37,000);
   skipped without CUDA (``--quick`` on a CPU measures a miniature through torch.profiler).

The default order (``--steps`` picks and orders them): tests (beside the preparation of the
corpora), then the shape-bucketed steps, the memory step, then base with master weights
compiled, eager, and eager on cuBLASLt; the same three for big; the profile; the two Multi30k
runs; base compiled with autocast, then base, big, the loader, base padded to 8 and big
compiled. The order puts
first what is least often measured, so that a short budget still answers it. The default budget,
540 s, keeps the whole check within ten minutes; steps that do not fit are listed as skipped,
and a second run with ``--steps`` picks them up.

An offline machine: carry the wheels that scripts/gpu_wheels.sh downloads (``.whl``, the few
packages a GPU image may lack) and the corpora as a folder (``--data-dir``); this script installs
the wheels into a folder on ``PYTHONPATH`` first. ``--device cpu --quick`` runs the same steps
in miniature on a CPU (what the tests do, so that the command stays ready).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


class Clock:
    """What is left of the budget (``None``: no budget)."""

    def __init__(self, budget: float | None, reserve: float = 10.0) -> None:
        self.end = None if budget is None else time.time() + budget - reserve

    def left(self) -> float:
        return float("inf") if self.end is None else self.end - time.time()


CLOCK = Clock(None)


def start(cmd: list[str], out: Path, name: str, env: dict) -> tuple:
    """Start ``cmd`` in the background, its output in ``out/<name>.log``; a thread notes when
    it ends (a step waited for long after, as the preparation beside the benches, reports its
    own seconds, not the wait's)."""
    log = open(out / f"{name}.log", "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env)
    ended: list[float] = []
    threading.Thread(target=lambda: (proc.wait(), ended.append(time.time())), daemon=True).start()
    return name, proc, log, time.time(), ended


def finish(handle: tuple, timeout: float) -> dict:
    """Wait for a started step, at most ``timeout`` seconds (and what is left of the budget)."""
    name, proc, log, began, ended = handle
    try:
        status = proc.wait(timeout=max(1.0, min(timeout, CLOCK.left())))
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        status = "timeout"
    log.close()
    end = ended[0] if ended and status != "timeout" else time.time()
    return {"step": name, "status": status, "seconds": round(end - began, 1)}


def run(cmd: list[str], out: Path, name: str, env: dict, timeout: float,
        needs: float = 0.0) -> dict:  # fmt: skip
    """Run ``cmd``, its output in ``out/<name>.log``; returns status and seconds. Skipped when
    less than ``needs`` seconds of the budget are left."""
    if CLOCK.left() < max(needs, 1.0):
        return {"step": name, "status": "skipped (out of time)", "seconds": 0.0}
    return finish(start(cmd, out, name, env), timeout)


def install_wheels(wheels: Path, target: Path) -> str | None:
    """The carried wheels unpacked into ``target`` (returned, for PYTHONPATH); None: none."""
    found = sorted(wheels.glob("*.whl")) if wheels.is_dir() else []
    if not found:
        return None
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                    "--no-compile", "--upgrade", "--target", str(target), *map(str, found)],
                   check=True)  # fmt: skip
    return str(target)


def environment(out: Path, env: dict) -> dict:
    info = {"python": sys.version.split()[0]}
    code = ("import json, torch; d = torch.cuda.is_available(); print(json.dumps({'torch': "
            "torch.__version__, 'cuda': torch.version.cuda, 'gpu': torch.cuda.get_device_name(0) "
            "if d else None}))")  # fmt: skip
    probe = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    if probe.returncode == 0:
        info.update(json.loads(probe.stdout.strip().splitlines()[-1]))
    if shutil.which("nvidia-smi"):
        smi = subprocess.run(["nvidia-smi"], capture_output=True, text=True)
        (out / "nvidia-smi.txt").write_text(smi.stdout)
    (out / "environment.json").write_text(json.dumps(info, indent=2))
    return info


# --quick's miniature of a preset, for the bench's flags and the profile's overrides alike
QUICK_MODEL = {"N": 1, "d_model": 64, "d_ff": 128, "h": 4}
QUICK_FLAGS = {"N": "--layers", "d_model": "--d-model", "d_ff": "--d-ff", "h": "--heads"}


def bench_train(args, out: Path, env: dict, data: Path | None, preset: str,
                compiled: bool, pad8: bool = False, master: bool = False,
                lt: bool = False, buckets: bool = False) -> dict:  # fmt: skip
    """Training steps of one preset, bf16 (fp32 on a CPU), eager or compiled; ``pad8``: the
    batches' lengths padded to multiples of 8 (fewer distinct shapes, a little more work);
    ``master``: a bf16 model and float32 master weights instead of autocast (bf16 on a CPU
    too, where it may be emulated: the miniature checks the command, not the figure); ``lt``:
    torch's products on cuBLASLt (``--blas cublaslt``: the profile step times a product's host
    setup under both libraries; whether a whole step gains is this bench's question);
    ``buckets``: the batches in ``SHAPE_BUCKETS`` shapes (``train.shape_buckets``; needs the
    corpus), and compiled, the whole step compiled per shape and replayed as CUDA graphs."""
    precision = "bf16" if args.device == "cuda" or master else "fp32"
    cmd = [sys.executable, "scripts/bench.py", "train", "--preset", preset,
           "--device", args.device, "--precision", precision, "--output",
           str(out / "bench.jsonl"), "--steps", "3" if args.quick else "30", "--warmup-steps",
           "1" if args.quick else "5"]  # fmt: skip
    if data is not None:
        cmd += ["--data", str(data), "--max-tokens", "2048" if args.quick else "25000"]
    elif args.quick:  # a miniature of the preset: the command, not the figure, is checked
        cmd += ["--batch-size", "8", "--vocab", "1000"]
        cmd += [x for k, v in QUICK_MODEL.items() for x in (QUICK_FLAGS[k], str(v))]
    if compiled:
        cmd.append("--compile")
    if pad8:
        cmd += ["--pad-multiple", "8"]
    if master:
        cmd.append("--master-weights")
    if lt and args.device != "cpu":  # a CPU has no BLAS to choose: the miniature runs the rest
        cmd += ["--blas", "cublaslt"]
    if buckets:
        cmd += ["--shape-buckets", str(SHAPE_BUCKETS)]
    name = (f"bench_{preset}_{'compiled' if compiled else 'eager'}{'_pad8' if pad8 else ''}"
            f"{'_master' if master else ''}{'_lt' if lt else ''}"
            f"{'_buckets' if buckets else ''}")  # fmt: skip
    return run(cmd, out, name, env, args.step_timeout, needs=150 if compiled else 45)


def bench_data(args, out: Path, env: dict, data: Path) -> dict:
    """The loader alone on the benchmark's split, at the benchmark's batch size."""
    cmd = [sys.executable, "scripts/bench.py", "data", "--data", str(data), "--max-tokens",
           "25000", "--epochs", "2", "--output", str(out / "bench.jsonl")]  # fmt: skip
    return run(cmd, out, "bench_data", env, min(args.step_timeout, 120), needs=20)


def news_available(args) -> bool:
    return bool(args.data_dir) and (Path(args.data_dir) / "wmt_newstest_de-en").is_dir()


def prepare_news(out: Path, env: dict) -> tuple:
    """Start preparing the news corpus (real WMT sentence lengths for the benchmark)."""
    return start([sys.executable, "-m", "mt", "prepare", "experiment=news_de_en",
                  f"cache_dir={out / 'cache'}", f"run_dir={out / 'news'}"], out,
                 "prepare_news", env)  # fmt: skip


def prepared_news(out: Path, step: dict | None) -> Path | None:
    """The prepared news corpus's train split, or None."""
    found = sorted((out / "cache").glob("news_de_en-*/train.src.ids"))
    return found[0].parent / "train" if step and step["status"] == 0 and found else None


def multi30k_args(args, out: Path, run: str = "multi30k") -> list[str]:
    """The Multi30k commands' settings; ``run``: the run directory's name under ``out`` (the
    prepared corpus is shared through ``out/cache``)."""
    common = [f"run_dir={out / run}", f"cache_dir={out / 'cache'}",
              f"train.device={args.device}"]  # fmt: skip
    if args.multi30k_minutes:
        common.append(f"train.max_minutes={args.multi30k_minutes}")
    if args.quick:
        common += ["experiment=smoke", "data.max_train_pairs=2000", "model.N=1", "model.d_model=64",
                   "model.d_ff=128", "train.max_steps=20", "train.eval_every=20",
                   "decode.max_len_b=5", "eval.report=false"]  # fmt: skip
    return common


def multi30k(args, out: Path, env: dict, prepared: dict, master: bool = False) -> list[dict]:
    """train -> evaluate on Multi30k de->en, as `make train` runs them, after ``prepared``
    (the prepare step's record: it ran beside the tests). ``master``: in bf16 with float32
    master weights (``train.master_weights``, the WMT experiments' choice) in a run directory of
    its own, the recipe otherwise the same: what the bf16 model does to the test score."""
    name = "multi30k_master" if master else "multi30k"
    common = multi30k_args(args, out, name)
    if master and not args.quick:  # (the miniature keeps fp32: a CPU may only emulate bf16)
        common += ["train.precision=bf16", "train.master_weights=true"]
    steps, previous = [], prepared
    for stage, needs in (("train", 60), ("evaluate", 20)):
        if previous["status"] != 0:
            break
        cmd = [sys.executable, "-m", "mt", stage, *common]
        previous = run(cmd, out, f"{name}_{stage}", env, args.step_timeout, needs)
        steps.append(previous)
    return steps


PROFILE = r"""
import json, sys, torch
import numpy as np
from torch.profiler import ProfilerActivity, profile
from mt.config import load_config
from mt.data.batches import collate, collate_flat
from mt.data.buckets import derive_buckets
from mt.fast import for_training
from mt.fast.compile import compile_step, compiled_graphs, step_loss
from mt.fast.graphs import graph_memory_gb
from mt.model import build_model
from mt.train.state import TrainState
from mt.train.update import Updater, build_optimizer

device, preset, tokens, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
name = sys.argv[5]  # profile, or profile-buckets (train.shape_buckets among the overrides)
dev = torch.device(device)
precision = "bf16" if dev.type == "cuda" else "fp32"
cfg = load_config([f"model={preset}", f"train.precision={precision}", "train.clip_norm=1.0",
                   *sys.argv[6:]])
torch.manual_seed(0)
raw = build_model(cfg.model, 37000 if preset != "small" else 8000).to(dev)
# on a GPU the WMT experiments' step: bf16 with float32 master weights (train.master_weights)
step_model = for_training(raw, dev, precision=precision, master_weights=dev.type == "cuda")
opt = build_optimizer(raw.parameters(), cfg.train, dev)
sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1e-4)
rng = np.random.default_rng(0)
buckets = None
if cfg.train.shape_buckets:  # the shapes of batches of these lengths, the whole step compiled
    lengths = rng.integers(8, 52, (2, 20000))
    buckets = derive_buckets(lengths[0], lengths[1], tokens, cfg.train.shape_buckets)
    step_model = compile_step(step_model, cfg.train, dev, buckets.shapes())
update = Updater(step_model, raw.parameters(), opt, sched,
                 torch.amp.GradScaler(dev.type, enabled=False), cfg, 1,
                 loss_fn=step_loss(step_model))
shape_turn = [0]


def make_batch():  # lengths new to every update, as batches by tokens bring them
    lo = int(rng.integers(8, 40))
    if buckets is not None:  # each bucket's shape in turn, its pairs at lengths within it
        k = shape_turn[0] % len(buckets)
        shape_turn[0] += 1
        rows, S, T = buckets.shape(k)
        low = buckets.bounds[k - 1] if k else 1
        n = int(rng.integers(max(1, rows // 2), rows + 1))
        s = rng.integers(max(0, min(S, low) - 1), S, n)
        t = rng.integers(max(0, min(T, low) - 1), T, n)
        return collate_flat(rng.integers(4, 8000, s.sum()), s, rng.integers(4, 8000, t.sum()),
                            t, shape=(rows, S, T)).to(dev)
    n = max(1, tokens // (lo + 6))
    pairs = [(rng.integers(4, 8000, rng.integers(lo, lo + 12)),
              rng.integers(4, 8000, rng.integers(lo, lo + 12))) for _ in range(n)]
    return collate(pairs).to(dev)


def profiled(batches, shapes=False):  # one update per batch under the profiler:
    if dev.type == "cuda":  # (key averages, summary; by input shape too with ``shapes``)
        torch.cuda.synchronize()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    with profile(activities=acts, record_shapes=shapes) as prof:
        for batch in batches:
            update([batch], TrainState())
        if dev.type == "cuda":
            torch.cuda.synchronize()
    averages = prof.key_averages(group_by_input_shape=shapes)
    events = prof.events()
    kernels = [e for e in events if str(getattr(e, "device_type", "")).endswith("CUDA")]
    busy = sum(getattr(e, "device_time", 0.0) or getattr(e, "cuda_time", 0.0) for e in kernels)
    span = max(e.time_range.end for e in events) - min(e.time_range.start for e in events)
    mm = [a for a in averages if a.key in ("aten::mm", "aten::addmm")]
    calls = sum(a.count for a in mm)
    host_mm = sum(a.self_cpu_time_total for a in mm)
    return averages, {
        "updates": len(batches), "kernel_launches_per_update": len(kernels) / len(batches),
        "gpu_busy_us": busy, "span_us": span, "ms_per_update": span / 1000 / len(batches),
        "gpu_busy_share": busy / span if kernels and span else None,
        "host_us_per_product": host_mm / calls if calls else None,
        "tokens_per_update": [int(b.ntokens) for b in batches]}


# Three updates at lengths new to each (as batches by tokens bring them), then three updates of
# one batch seen before: the difference is what a new shape costs the host. With buckets every
# shape is met (compiled, captured: timed as capture_s) before the three.
import time
t0 = time.perf_counter()
for batch in [make_batch() for _ in range(2 if buckets is None else len(buckets))]:
    update([batch], TrainState())
if dev.type == "cuda":
    torch.cuda.synchronize()
capture_s = time.perf_counter() - t0
averages, summary = profiled([make_batch() for _ in range(3)])
summary["warmup_s"] = capture_s
if buckets is not None:
    summary["shapes"] = len(buckets)
    summary["padding_share"] = dict(zip(("src", "tgt"), buckets.padding))
    summary["compiled_graphs"] = compiled_graphs()
    summary["graph_memory"] = graph_memory_gb(dev)
again = make_batch()
update([again], TrainState())
_, summary["same_shape"] = profiled([again] * 3)


def device_table(averages, rows=15):  # sorted by the GPU's time where there is one
    for key in (("self_device_time_total", "self_cuda_time_total") if dev.type == "cuda"
                else ()) + ("self_cpu_time_total",):  # fmt: skip
        try:
            return averages.table(sort_by=key, row_limit=rows)
        except (AttributeError, KeyError, ValueError):
            continue


# The copies by shape (casts between float32 and bf16 can be a large share of a GPU's kernel
# time): one more update of the batch seen before, its shapes recorded.
by_shape, _ = profiled([again], shapes=True)
copies = [a for a in by_shape if a.key in ("aten::_to_copy", "aten::copy_")]


def device_us(a):  # an operator's time on the GPU, kernels included (0 on a CPU)
    return getattr(a, "device_time_total", 0) or 0


def product_host_us(rows_seen, rows_new, d=cfg.model.d_model, f=cfg.model.d_ff):
    # The host's microseconds to issue one (rows x d) @ (d x f) product in the step's dtype:
    # the median over row counts never seen before, and over one row count seen before.
    import time
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    w = torch.randn(f, d, device=dev, dtype=dtype)
    xs = {r: torch.randn(r, d, device=dev, dtype=dtype) for r in (*rows_new, rows_seen)}

    def issue(r):
        t = time.perf_counter()
        xs[r] @ w.t()
        return (time.perf_counter() - t) * 1e6

    issue(rows_seen)
    new = sorted(issue(r) for r in rows_new)
    same = sorted(issue(rows_seen) for _ in rows_new)
    if dev.type == "cuda":
        torch.cuda.synchronize()
    return {"new_shapes_us": new[len(new) // 2], "seen_shape_us": same[len(same) // 2]}


# The per-shape cost of a product on the host, with each BLAS library torch can call on CUDA
# (a library that keeps its choice per shape, or one that chooses again at every call).
summary["products"] = {}
libraries = [None]
if dev.type == "cuda":
    default = torch.backends.cuda.preferred_blas_library()
    summary["products"]["default_library"] = str(default)
    libraries = ["cublas", "cublaslt"]
for i, library in enumerate(libraries):
    if library is not None:
        torch.backends.cuda.preferred_blas_library(library)
    base_rows = tokens * 3 // 4 + 250 * i  # row counts no other library here has seen
    summary["products"][library or "default"] = product_host_us(
        base_rows, [base_rows + 8 * (k + 1) for k in range(24)])
if dev.type == "cuda":
    torch.backends.cuda.preferred_blas_library(default)
with open(out + f"/{name}.txt", "w") as f:
    f.write(device_table(averages))
    if dev.type == "cuda":  # the host's side too (on a CPU the table above is already that)
        f.write("\n" + averages.table(sort_by="self_cpu_time_total", row_limit=15))
    f.write("\n\nThe copies of one update by input shape (calls, device us, host us):\n")
    for a in sorted(copies, key=lambda a: (device_us(a), a.cpu_time_total), reverse=True)[:25]:
        f.write(f"{a.key} {a.input_shapes} {a.count} {device_us(a):.0f} {a.cpu_time_total:.0f}\n")
with open(out + f"/{name}.json", "w") as f:
    json.dump(summary, f, indent=2)
"""


def profile(args, out: Path, env: dict, buckets: bool = False) -> dict:
    """The profile's step (``PROFILE``); ``buckets``: its updates at bucket shapes, the whole
    step compiled (CUDA graphs on CUDA), written as ``profile-buckets.*``."""
    preset, tokens = ("small", 256) if args.quick else ("base", 25000)
    script = out / "profile_step.py"
    script.write_text(PROFILE)
    name = "profile-buckets" if buckets else "profile"
    cmd = [sys.executable, str(script), args.device, preset, str(tokens), str(out), name]
    if args.quick:  # the preset in miniature, as the bench's
        cmd += [f"model.{k}={v}" for k, v in QUICK_MODEL.items()]
    if buckets:
        cmd += ["train.compile=true", f"train.shape_buckets={SHAPE_BUCKETS}"]
    return run(cmd, out, name, env, args.step_timeout, needs=150 if buckets else 30)


def memory(args, out: Path, env: dict, info: dict) -> list[dict]:
    """Step ``memory`` (the module docstring, 11): ``bench memory`` per preset."""
    if args.device == "cuda" and not info.get("gpu"):
        return [{"step": "memory", "status": "skipped (no CUDA)", "seconds": 0.0}]
    steps = []
    for preset in ("small",) if args.quick else ("base", "big"):
        cmd = [sys.executable, "scripts/bench.py", "memory", "--preset", preset, "--device",
               args.device, "--output", str(out / "bench.jsonl")]  # fmt: skip
        if args.quick:  # the miniature: measured on a CPU through the profiler, in seconds
            cmd += ["--vocab", "1000", "--tokens", "500"]
            cmd += [x for k, v in QUICK_MODEL.items() for x in (QUICK_FLAGS[k], str(v))]
        else:
            cmd += ["--vocab", "37000", "--tokens", "25000", "--precision", "bf16",
                    "--master-weights"]  # fmt: skip
        steps.append(run(cmd, out, f"memory_{preset}", env, args.step_timeout, needs=60))
    return steps


def _memory_rows(records: list[dict]) -> list[str]:
    """The memory step's table: measured and estimated peaks, checkpointing off and on."""
    rows = [r for r in records if r.get("bench") == "memory"]
    if not rows:
        return []
    lines = ["", "| memory: one step | tokens | activation checkpointing | measured peak GiB | "
             "memory model GiB |", "|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        measured = r.get("measured_gb")
        lines.append(f"| {r.get('preset')} {r.get('d_model')}x{r.get('layers')} "
                     f"{r.get('precision')}{', master weights' if r.get('master_weights') else ''}"
                     f" | {r.get('tokens'):,} | {'on' if r['activation_checkpointing'] else 'off'}"
                     f" | {'-' if measured is None else f'{measured:.3f}'} | "
                     f"{r['estimated_gb']:.3f} |")  # fmt: skip
    return lines


def _compiled(record: dict) -> str:
    """``True (1)``: compiled, with the graphs Dynamo made (a slow timed step beside more than
    one graph is a compile); ``False``: eager."""
    graphs = record.get("compiled_graphs")
    return f"{record.get('compile')}" + ("" if graphs is None else f" ({graphs})")


def _steps(record: dict) -> str:
    """The median and the slowest timed step, in ms (a step compiling again shows here)."""
    times = record.get("step_ms") or []
    median = record.get("step_ms_median")
    return "-" if not times or median is None else f"{median:,.1f} / {max(times):,.1f}"


def _buckets(record: dict) -> str:
    """A bench's shapes met (``train.shape_buckets``), the seconds of its steps at a shape met
    first (compiling; on CUDA with buckets, capturing the graphs), each side's padding share
    and the GPU memory reserved after it (the graphs' pools are part of it)."""
    pad = record.get("padding_share") or {}
    memory = (record.get("graph_memory") or {}).get("reserved_peak_gb")
    return " | ".join([
        f"{record.get('shapes_met', '-')} ({record.get('shape_buckets') or 'off'})",
        "-" if record.get("first_shape_s") is None else f"{record['first_shape_s']:,.1f}",
        f"{pad['src']:.1%} / {pad['tgt']:.1%}" if pad else "-",
        "-" if memory is None else f"{memory:.1f}",
    ])


def summary(out: Path, steps: list[dict], info: dict) -> str:
    lines = ["# gpu-check", "", f"machine: {json.dumps(info)}", "", "| step | status | seconds |",
             "|---|---|---|"]  # fmt: skip
    lines += [f"| {s['step']} | {s['status']} | {s['seconds']} |" for s in steps]
    bench_file = out / "bench.jsonl"
    records = ([json.loads(line) for line in bench_file.read_text().splitlines()]
               if bench_file.is_file() else [])  # fmt: skip
    if any(r.get("bench") == "train" for r in records):
        lines += ["", "| bench | compiled (graphs) | tgt tok/s | median / slowest step ms | "
                  "MFU (datasheet) | MFU (measured peak) | peak memory MB | shapes (buckets) | "
                  "first-shape steps s | padding src / tgt | GPU reserved GB |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
        for r in records:
            if r.get("bench") != "train":
                continue
            mfu = r.get("mfu_datasheet")
            lines.append(
                f"| {r.get('d_model')}x{r.get('layers')} {r.get('precision')}"
                f"{' pad ' + str(r['pad_multiple']) if (r.get('pad_multiple') or 1) > 1 else ''}"
                f"{', master weights' if r.get('master_weights') else ''}"
                f"{', cuBLASLt' if r.get('blas') == 'cublaslt' else ''} | "
                f"{_compiled(r)} | {r['tgt_tok_per_s']:,.0f} | {_steps(r)} | "
                f"{'-' if mfu is None else f'{mfu:.1%}'} | "
                f"{'-' if r.get('mfu') is None else format(r['mfu'], '.1%')} | "
                f"{r.get('peak_mem_mb', 0):,.0f} | {_buckets(r)} |"
            )
    lines += _memory_rows(records)
    if records:
        lines += ["", *(f"loader alone: {r['batches_per_s']:,.1f} batches/s, {r['tok_per_s']:,.0f} "
                        f"target tok/s" for r in records if r.get("bench") == "data")]  # fmt: skip
    for run_name, how in (("multi30k", ""), ("multi30k_master", ", bf16 master weights")):
        results = out / run_name / "results.json"
        if results.is_file():
            r = json.loads(results.read_text())
            lines += ["", f"Multi30k de->en{how} test BLEU {r['bleu']:.2f} ({r['signature']})"]
        log = out / run_name / "metrics.jsonl"
        if log.is_file():  # the run's last records: updates, minutes, valid BLEU, why it ended
            lines += ["", f"Multi30k run{how}, last records of metrics.jsonl:", "```",
                      *log.read_text().splitlines()[-3:], "```"]  # fmt: skip
    for prof_name, what in (("profile-buckets", "with shape buckets, the whole step compiled "
                             "(CUDA graphs on CUDA), three updates at bucket shapes met before, "
                             "then three of one batch"),
                            ("profile", "three updates at new shapes, then three at one shape")):
        prof = out / f"{prof_name}.json"
        if prof.is_file():
            lines += ["", f"{prof_name}: {what}: {_profile_line(json.loads(prof.read_text()))}",
                      "", f"```\n{prof.read_text()}\n```"]
    text = "\n".join(lines) + "\n"
    (out / "summary.md").write_text(text)
    return text


SHAPE_BUCKETS = 16  # the news corpus's padding share levels off by about 16 (mt.data.buckets)

def _profile_line(p: dict) -> str:
    """The profile's headline figures: kernel launches per update and the GPU's busy share,
    at the shapes profiled and at one batch again."""
    def part(d: dict) -> str:
        busy = d.get("gpu_busy_share")
        return (f"{d.get('kernel_launches_per_update', 0):,.0f} launches per update, "
                f"{d.get('ms_per_update', 0):,.1f} ms, GPU busy "
                f"{'-' if busy is None else format(busy, '.0%')}")
    line = part(p)
    if p.get("same_shape"):
        line += f"; one batch again: {part(p['same_shape'])}"
    if p.get("shapes"):
        pad = p.get("padding_share", {})
        line += (f"; {p['shapes']} shapes met in {p.get('warmup_s', 0):,.1f} s (compiling and "
                 f"capturing), {p.get('compiled_graphs')} compiled graph(s), padding "
                 f"{pad.get('src', 0):.1%} / {pad.get('tgt', 0):.1%}")
    return line


# The steps and their default order: the open questions first where a budget is short. The
# shape-bucketed, wholly compiled steps on CUDA graphs first, then their profile.
STEPS = ("tests", "base-master-compiled-buckets", "big-master-compiled-buckets",
         "profile-buckets", "memory", "base-master-buckets", "base-master-compiled", "base-master",
         "base-master-lt", "big-master-compiled", "big-master", "big-master-lt", "profile",
         "multi30k-master", "multi30k", "base-compiled", "base", "big", "data", "base-pad8",
         "big-compiled")
# bench train: a preset, then what differs from eager autocast (pad8, master, compiled, lt)
TRAIN_BENCHES = tuple(s for s in STEPS if s.split("-")[0] in ("base", "big"))


def bench_variant(name: str) -> tuple[str, dict]:
    """A bench step's preset and how it differs from eager autocast: ``base-master-compiled``
    -> ``("base", {"compiled": True, "pad8": False, "master": True, "lt": False,
    "buckets": False})``."""
    preset, *how = name.split("-")
    flags = ("compiled", "pad8", "master", "lt", "buckets")
    return preset, {flag: flag in how for flag in flags}


def main(argv: list[str] | None = None) -> int:
    global CLOCK
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT") or "gpu-check")
    p.add_argument("--device", default="cuda")
    p.add_argument("--data-dir", default=os.environ.get("MT_DATA_DIR") or str(ROOT / ".gpu-data"))
    p.add_argument("--wheels", default=str(ROOT / ".whl"))
    p.add_argument("--quick", action="store_true", help="miniature steps (a CPU check)")
    p.add_argument("--step-timeout", type=float, default=900)
    p.add_argument(
        "--budget", type=float, default=540, help="seconds for the whole check (0: none)"
    )
    p.add_argument("--steps", default=",".join(STEPS),
                   help="which steps, comma-separated, in this order "
                        "(default, all of them: %(default)s)")
    p.add_argument("--multi30k-minutes", type=float, help="train.max_minutes of the Multi30k run")
    args = p.parse_args(argv)
    chosen = args.steps.split(",")
    unknown = sorted(set(chosen) - set(STEPS))
    if unknown:
        p.error(f"--steps: unknown {', '.join(unknown)} (known: {', '.join(STEPS)})")
    CLOCK = Clock(args.budget or None)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    paths = [str(ROOT)]
    site = install_wheels(Path(args.wheels), Path("/tmp/mt-site"))
    if site:
        paths.insert(0, site)
    env["PYTHONPATH"] = os.pathsep.join(paths + [env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    if Path(args.data_dir).is_dir():
        env["MT_DATA_DIR"] = str(Path(args.data_dir).resolve())
    info = environment(out, env)

    steps: list[dict] = []

    def record(*done: dict) -> None:  # the summary after every step: a killed check keeps it
        steps.extend(done)
        summary(out, steps, info)

    if args.quick:  # the miniature: one small preset, eager, on random batches
        chosen = [s for s in chosen
                  if s in ("base", "base-master", "multi30k", "multi30k-master", "profile",
                           "memory")]  # fmt: skip
    # The data preparation runs on the CPU, beside the GPU tests.
    m30k_prep, m30k_prepared = None, None
    if {"multi30k", "multi30k-master"} & set(chosen):
        m30k_prep = start([sys.executable, "-m", "mt", "prepare", *multi30k_args(args, out)],
                          out, "multi30k_prepare", env)  # fmt: skip
    wants_news = {*TRAIN_BENCHES, "data"} & set(chosen)
    news_prep = (prepare_news(out, env) if wants_news and news_available(args) and not args.quick
                 else None)  # fmt: skip
    if "tests" in chosen:
        record(run([sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-rs", "-p",
                    "no:cacheprovider"], out, "tests", env, args.step_timeout))  # fmt: skip
    news_step = finish(news_prep, args.step_timeout) if news_prep else None
    if news_step:
        record(news_step)
    data = prepared_news(out, news_step)
    for name in chosen:
        if (name == "base-pad8" or "buckets" in name) and data is None:
            continue  # padding needs the corpus's lengths (random batches would repeat base)
        if name in TRAIN_BENCHES:
            preset, how = bench_variant(name)
            record(bench_train(args, out, env, data, "small" if args.quick else preset, **how))
        elif name == "data" and data is not None:
            record(bench_data(args, out, env, data))
        elif name.startswith("multi30k"):
            if m30k_prepared is None:  # the preparation's end, waited for once
                m30k_prepared = finish(m30k_prep, args.step_timeout)
                record(m30k_prepared)
            record(*multi30k(args, out, env, m30k_prepared, master=name == "multi30k-master"))
        elif name in ("profile", "profile-buckets"):
            record(profile(args, out, env, buckets=name == "profile-buckets"))
        elif name == "memory":
            record(*memory(args, out, env, info))
    print(summary(out, steps, info))
    return 0 if all(s["status"] in (0, "skipped (no CUDA)") for s in steps) else 1


if __name__ == "__main__":
    sys.exit(main())
