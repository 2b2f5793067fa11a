"""Decoding benchmark: greedy and beam search sentences/s and tokens/s.

On random weights (the default) every output is forced to exactly ``--gen-len`` tokens: EOS is
forbidden until then (``min_len``) and the maximum length is ``--gen-len`` (``max_len_a=0``), so
the figure measures a fixed amount of work whatever the weights predict. With ``--checkpoint``
a trained model decodes real sentences (``--input`` file, one per line, else random ids) with
the checkpoint's own length rule, as translation would.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np
import torch
from bench_common import (
    Recorder,
    environment,
    median,
    model_config,
    peak_memory_mb,
    reset_peak_memory,
    shape_fields,
    sync,
)

from mt.data.batches import make_src
from mt.decode.driver import resolve_decode
from mt.decode.search import beam_search, greedy_search
from mt.device import autocast
from mt.model.transformer import build_model
from mt.schema import DecodeConfig

log = logging.getLogger("bench")


def _random_sources(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(4, vocab, size=length).tolist() for _ in range(n)]


def _load(args, device):
    """(model, src_ids, shape fields, forced) for a checkpoint or a randomly initialised model."""
    if args.checkpoint:
        from mt.checkpoint import load_model

        model, tokenizer, ckpt = load_model(args.checkpoint, device)
        vocab = int(ckpt["vocab_size"])
        if args.input:
            with open(args.input, encoding="utf-8") as f:
                lines = [tokenizer.normalize(line) for line in f.read().splitlines()]
            lines = lines[: args.batch_size * args.batches]
            src_ids = tokenizer.encode(lines, side="src")
        else:
            src_ids = _random_sources(
                args.batch_size * args.batches, args.src_len, vocab, args.seed
            )
        return model, src_ids, shape_fields(model.cfg, vocab), False
    cfg = model_config(args)
    torch.manual_seed(args.seed)
    model = build_model(cfg, args.vocab).to(device)
    src_ids = _random_sources(args.batch_size * args.batches, args.src_len, args.vocab, args.seed)
    return model, src_ids, shape_fields(cfg, args.vocab), True


def _searcher(model, args, device, k: int, a: float, b: float, min_len: int):
    """One search over a batch with ``model`` as written (``mt.decode.search``), under the
    autocast ``--precision`` asks for (``decode.precision``, ``auto`` resolved as decoding
    resolves it)."""
    precision = resolve_decode(DecodeConfig(precision=args.precision), model, device).precision

    def run(src):
        with autocast(device, precision):
            if k == 1:
                return [[h] for h in greedy_search(model, src, a, b, min_len, alpha=0.0)]
            return beam_search(model, src, k, DecodeConfig().alpha, a, b, 1, min_len)

    run.precision = precision
    return run


# Where a decoder step's time goes: top-level torch ops (called from Python) by kind.
PRODUCTS = {"aten::linear", "aten::addmm", "aten::mm"}
ATTENTION = {"aten::matmul", "aten::bmm", "aten::softmax", "aten::_softmax",
             "aten::scaled_dot_product_attention", "aten::masked_fill_"}  # fmt: skip
VOCAB = {"aten::log_softmax", "aten::_log_softmax"}
BEAM = {"aten::topk", "aten::sort", "aten::argsort", "aten::gather", "aten::nonzero",
        "aten::repeat_interleave", "aten::index", "aten::index_select", "aten::cat",
        "aten::index_copy_", "aten::index_put_", "aten::isfinite", "aten::any", "aten::eq",
        "aten::ne", "aten::all", "aten::where", "aten::cumsum", "aten::tolist",
        "aten::_local_scalar_dense", "aten::item", "aten::copy_", "aten::clamp",
        "aten::arange", "aten::tril", "aten::ones", "aten::full", "aten::tensor"}  # fmt: skip


def profile_breakdown(run, src) -> dict[str, float]:
    """Milliseconds of one search of ``src`` by kind: the model's products, attention over the
    cache, the softmax over the vocabulary, beam bookkeeping (selection, row copies, caches),
    other ops (norms, residuals, embeddings), and Python (the wall time no op accounts for)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:  # started outside the time: the
        start = time.perf_counter()  # first profile of a process takes ~1.5 s to start
        run(src)
        wall = (time.perf_counter() - start) * 1e3
    kinds = {"products": 0.0, "attention": 0.0, "vocab_softmax": 0.0, "beam_bookkeeping": 0.0,
             "other_ops": 0.0}  # fmt: skip
    def kind_of(name: str) -> str:
        return ("products" if name in PRODUCTS else "attention" if name in ATTENTION
                else "vocab_softmax" if name in VOCAB else "beam_bookkeeping" if name in BEAM
                else "other_ops")  # fmt: skip

    for event in prof.events():
        if event.cpu_parent is not None:
            continue
        kinds[kind_of(event.name)] += event.cpu_time_total / 1e3
    # the profiler's own cost inflates the Python share a little; the op times are its own
    kinds["python"] = max(0.0, wall - sum(kinds.values()))
    return {k: round(v, 3) for k, v in kinds.items()} | {"wall_ms": round(wall, 3)}


def run_decode(args, rec: Recorder) -> list[dict[str, Any]]:
    """Benchmark greedy and beam search with the model as written; one record per search."""
    device = args.device_obj
    model, src_ids, shape, forced = _load(args, device)
    model.eval()
    dcfg = DecodeConfig()
    if forced:
        a, b, min_len = 0.0, args.gen_len, args.gen_len
    else:
        a, b, min_len = dcfg.max_len_a, dcfg.max_len_b, 0
    batches = [
        make_src(src_ids[i : i + args.batch_size]).to(device)
        for i in range(0, len(src_ids), args.batch_size)
    ]
    searches = [("greedy", 1)] + ([("beam", args.beam)] if args.beam > 1 else [])
    records = []
    for name, k in searches:
        run = _searcher(model, args, device, k, a, b, min_len)
        for _ in range(args.warmup_steps):
            run(batches[0])
        reset_peak_memory(device)
        per_batch, sents, tokens, total = [], 0, 0, 0.0
        for src in batches:
            sync(device)
            start = time.perf_counter()
            hyps = run(src)
            sync(device)
            seconds = time.perf_counter() - start
            total += seconds
            per_batch.append(src.size(0) / seconds)
            sents += src.size(0)
            tokens += sum(len(h[0].tokens) for h in hyps)
        profile = profile_breakdown(run, batches[0]) if getattr(args, "profile", False) else None
        if forced and tokens != sents * args.gen_len:
            raise RuntimeError(f"{name}: {tokens} tokens, expected {sents} x {args.gen_len}")
        record = {
            "bench": "decode",
            "impl": name,
            "search": name,
            "beam": k,
            **shape,
            "checkpoint": args.checkpoint,
            "precision": run.precision,
            "batch_size": args.batch_size,
            "batches": len(batches),
            "src_len": args.src_len if not args.input else None,
            "gen_len": args.gen_len if forced else None,
            "forced_length": forced,
            "sent_per_s": sents / total,
            "sent_per_s_median_batch": median(per_batch),
            "tok_per_s": tokens / total,
            "mean_out_len": tokens / sents,
            "peak_mem_mb": peak_memory_mb(device)[0],
            "peak_mem_kind": peak_memory_mb(device)[1],
            **({"profile_ms": profile} if profile is not None else {}),
            **environment(device),
        }
        rec.emit(record)
        records.append(record)
    return records
