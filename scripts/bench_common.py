"""Shared pieces of the benchmarks: device, threads, precision, model shape, batches, memory.

Imported by ``scripts/bench.py`` and its ``bench_*`` helpers (the scripts directory is on
``sys.path`` when ``bench.py`` runs).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import platform
import resource
import statistics
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mt.allocator import active_allocator
from mt.schema import ModelConfig, attention_dropout

log = logging.getLogger("bench")

REPO = Path(__file__).resolve().parent.parent


# --------------------------------------------------------------------------- environment


def pick_device(name: str) -> torch.device:
    """``auto`` -> cuda when available, else cpu (``mt.distributed.resolve_device``)."""
    from mt.distributed import resolve_device

    return resolve_device(name)


def set_threads(threads: int) -> int:
    """Set torch's intra-op threads (0 keeps torch's default); returns the count in force."""
    if threads > 0:
        torch.set_num_threads(threads)
    return torch.get_num_threads()


def autocast(device: torch.device, precision: str):
    """bf16 autocast on CPU or GPU; fp32 = no autocast."""
    if precision == "fp32":
        return contextlib.nullcontext()
    if precision == "bf16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    raise ValueError(f"precision must be fp32 or bf16, got {precision!r}")


def sync(device: torch.device) -> None:
    """Wait for queued GPU work, so wall-clock timings are honest."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_mb(device: torch.device) -> tuple[float, str]:
    """Peak memory in MiB and its kind: ``max_memory_allocated`` on GPU, process max RSS on CPU.

    The CPU figure is the whole process's peak so far (it never goes down).
    """
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20, "cuda_max_memory_allocated"
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "max_rss"


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return platform.processor() or platform.machine()


def git_commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True
        )
    except OSError:
        return None
    return out.stdout.strip() or None


def environment(device: torch.device) -> dict[str, Any]:
    """Fields every measurement carries."""
    return {
        "device": str(device),
        "device_name": device_name(device),
        "threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "allocator": active_allocator(),  # tcmalloc, jemalloc or system (MT_ALLOCATOR)
        "commit": git_commit(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }


# --------------------------------------------------------------------------- model shape

PRESETS = ("small", "base", "big")


def model_config(args) -> ModelConfig:
    """A ModelConfig from ``--preset`` (conf/model/<preset>.yaml) and explicit shape flags.

    Explicit flags (``--d-model --layers --heads --d-ff --dropout --attention-dropout
    --norm``) override the preset, so a shape can be given exactly even if the presets change.
    """
    cfg = ModelConfig()
    if args.preset:
        from omegaconf import OmegaConf

        from mt.config import conf_dir

        values = OmegaConf.to_container(
            OmegaConf.load(conf_dir() / "model" / f"{args.preset}.yaml")
        )
        cfg = ModelConfig(**{**asdict(cfg), **values})
    overrides = {
        "d_model": args.d_model,
        "N": args.layers,
        "h": args.heads,
        "d_ff": args.d_ff,
        "dropout": args.dropout,
        "attention_dropout": getattr(args, "attention_dropout", None),
        "norm": args.norm,
    }
    values = {k: v for k, v in overrides.items() if v is not None}
    cfg = ModelConfig(**{**asdict(cfg), **values})
    longest = 2 + max(
        getattr(args, "max_len", 0) or 0,
        getattr(args, "src_len", 0) or 0,
        getattr(args, "gen_len", 0) or 0,
    )
    if longest > cfg.max_positions:
        cfg.max_positions = longest
    return cfg


def shape_fields(cfg: ModelConfig, vocab: int) -> dict[str, Any]:
    return {
        "d_model": cfg.d_model,
        "layers": cfg.N,
        "dec_layers": cfg.N_dec or cfg.N,
        "heads": cfg.h,
        "d_ff": cfg.d_ff,
        "vocab": vocab,
        "norm": cfg.norm,
        "dropout": cfg.dropout,
        "attention_dropout": attention_dropout(cfg),
    }


# --------------------------------------------------------------------------- batches


def random_pairs(
    n: int, min_len: int, max_len: int, vocab: int, seed: int
) -> list[tuple[np.ndarray, np.ndarray]]:
    """``n`` random (src, tgt) id pairs, each side's length uniform in [min_len, max_len].

    Ids are drawn from the non-special range [4, vocab), without BOS/EOS (collate adds them).
    """
    rng = np.random.default_rng(seed)
    pairs = []
    for _ in range(n):
        s, t = rng.integers(min_len, max_len + 1, size=2)
        pairs.append((rng.integers(4, vocab, size=s), rng.integers(4, vocab, size=t)))
    return pairs


def random_batches(args, count: int) -> list:
    """``count`` random ``mt.data.batches.Batch``es of ``--batch-size`` pairs (seeded; with
    ``--compile`` as compiled training collates them: ``one_graph``)."""
    from mt.data.batches import collate

    return [
        collate(
            random_pairs(args.batch_size, args.min_len, args.max_len, args.vocab, args.seed + i),
            one_graph=getattr(args, "compile", False),
        )
        for i in range(count)
    ]


# --------------------------------------------------------------------------- output


@dataclass
class Recorder:
    """Prints each measurement as one JSON line, appends it to ``--output``, keeps it for the
    final table."""

    output: str | None = None
    rows: list[dict[str, Any]] = field(default_factory=list)

    def emit(self, record: dict[str, Any]) -> None:
        line = json.dumps(record, sort_keys=False)
        print(line, flush=True)
        if self.output:
            with open(self.output, "a", encoding="utf-8") as f:
                f.write(line + "\n")
        self.rows.append(record)

    def table(self) -> str:
        """A short fixed-width summary of all measurements."""
        head = f"{'bench':<8} {'impl':<12} {'shape':<26} {'prec':<5} {'figure':>22} {'mem MiB':>9}"
        lines = [head, "-" * len(head)]
        for r in self.rows:
            shape = f"{r.get('d_model', '')}x{r.get('layers', '')} h{r.get('heads', '')} " + (
                f"B{r.get('batch_size', '')}"
            )
            if r["bench"] == "train":
                figure = f"{r['tgt_tok_per_s']:,.0f} tgt tok/s"
                if r.get("mfu") is not None:
                    figure += f" {100 * r['mfu']:.1f}%"
            elif r["bench"] == "decode":
                figure = f"{r['sent_per_s']:,.1f} sent/s"
            elif r["bench"] == "translate" and "search" not in r:  # the first call's conversion
                shape, figure = "first call", f"{r['seconds']:,.1f} s"
            elif r["bench"] == "translate":
                shape = f"{r['search']}, {r['sentences']} sentences"
                figure = f"{r['sent_per_s']:,.1f} sent/s"
            elif r["bench"] == "data":
                shape = f"max_tokens {r.get('max_tokens')}"
                figure = f"{r['tok_per_s']:,.0f} tok/s"
            elif r["bench"] == "serve":
                shape = f"{r.get('clients', '')} clients"
                figure = (f"{r['sent_per_s']:,.1f} sent/s" if "sent_per_s" in r
                          else f"{r.get('ratio', 0):.2f}x")  # fmt: skip
            elif r["bench"] == "memory":
                ckpt = "on" if r["activation_checkpointing"] else "off"
                shape = f"{shape.split(' h')[0]} {r['tokens']} tok, ckpt {ckpt}"
                figure = f"{r['estimated_gb']:.2f} GiB estimated"
                if r.get("measured_gb") is not None:
                    figure = f"{r['measured_gb']:.2f} measured, {r['estimated_gb']:.2f} est"
            elif r["bench"] == "peak":
                shape, figure = f"matmul {r['size']}^3", f"{r['peak_tflops']:.1f} TFLOP/s"
            else:
                figure = ""
            impl = str(r.get("impl", r.get("search", "")))
            prec = "int8" if r.get("quantize") == "int8" else r.get("precision", "")
            mem = r.get("peak_mem_mb", r.get("peak_rss_mb"))
            mem_s = f"{mem:,.0f}" if isinstance(mem, (int, float)) else ""
            lines.append(
                f"{r['bench']:<8} {impl:<12} {shape:<26} {prec:<5} {figure:>22} {mem_s:>9}"
            )
        return "\n".join(lines)


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def measure_peak_tflops(device: torch.device, size: int = 8192, reps: int = 10) -> float:
    """Dense bf16 matmul throughput (size^3 products), the peak MFU is measured against."""
    a = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    b = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    sync(device)
    start = time.perf_counter()
    for _ in range(reps):
        a @ b
    sync(device)
    seconds = (time.perf_counter() - start) / reps
    return 2 * size**3 / seconds / 1e12
