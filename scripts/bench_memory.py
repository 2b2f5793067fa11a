"""``bench memory``: the peak memory of one training step, with and without activation
checkpointing, by the memory model (``mt.fast.footprint.estimate_step_gb``, fake tensors) and,
unless ``--estimate-only``, measured on the device.

The measured step is the one the memory model computes (a fresh model, one forward pass, the
blockwise loss, the backward pass, Adam's first step; sentences of 25 tokens), counted from
nothing allocated: on CUDA ``torch.cuda.max_memory_allocated`` over training's own step
(``mt.fast.for_training``), on a CPU the bytes torch's CPU allocator holds at most while the
step runs (``torch.profiler`` with ``profile_memory``: every allocation and free is recorded).
"""

from __future__ import annotations

import time

import torch
from bench_common import environment, model_config, shape_fields

SENTENCE = 25  # tokens per sentence, as the memory model's batches


def measure_step_gb(model_cfg, vocab: int, tokens: int, precision: str, master_weights: bool,
                    checkpointing: bool, device: torch.device) -> float:  # fmt: skip
    """The step's measured peak in GiB (module docstring), from a fresh model."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        _step(model_cfg, vocab, tokens, precision, master_weights, checkpointing, device)
        torch.cuda.synchronize(device)
        return (torch.cuda.max_memory_allocated(device) - before) / 2**30
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        _step(model_cfg, vocab, tokens, precision, master_weights, checkpointing, device)
    return cpu_peak_bytes(prof) / 2**30


def cpu_peak_bytes(prof) -> int:
    """The most bytes torch's CPU allocator held at once under ``prof``: its running total at
    each allocation (the total counts only what was allocated while profiling)."""
    from torch._C._profiler import _EventType

    peak, stack = 0, list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        event = stack.pop()
        stack.extend(event.children)
        if event.tag == _EventType.Allocation and str(event.extra_fields.device) == "cpu":
            peak = max(peak, event.extra_fields.total_allocated)
    return peak


def _step(model_cfg, vocab, tokens, precision, master_weights, checkpointing, device) -> None:
    from mt.fast import for_training
    from mt.fast.footprint import train_step
    from mt.fast.master import MasterWeights
    from mt.fast.training import TrainingModel, checkpointed
    from mt.model.transformer import build_model

    torch.manual_seed(0)
    model = build_model(model_cfg, vocab).to(device)
    if device.type == "cuda":  # training's step on a GPU: what the memory model plans for
        step = for_training(model, device, precision=precision, master_weights=master_weights,
                            activation_checkpointing=checkpointing)  # fmt: skip
    else:  # the same step on a CPU (mt's CPU training copy is another step)
        master = MasterWeights(model, precision) if master_weights else None
        step = TrainingModel(model if master is None else master.model, blockwise=True,
                             master=master)  # fmt: skip
        step = checkpointed(step) if checkpointing else step
    master = step.master
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    src, tgt = (torch.randint(4, vocab, (max(1, tokens // SENTENCE), SENTENCE), device=device)
                for _ in range(2))  # fmt: skip
    train_step(step, opt, master, src, tgt, model_cfg.d_model, precision, device.type)


def run_memory(args, rec) -> None:
    from mt.fast.footprint import estimate_step_gb

    cfg = model_config(args)
    for checkpointing in {"off": [False], "on": [True], "both": [False, True]}[args.checkpointing]:
        t0 = time.perf_counter()
        estimate = estimate_step_gb(cfg, args.vocab, args.tokens, args.precision,
                                    args.master_weights, checkpointing)  # fmt: skip
        record = {"bench": "memory", "preset": args.preset, **shape_fields(cfg, args.vocab),
                  "tokens": args.tokens, "precision": args.precision,
                  "master_weights": args.master_weights, "activation_checkpointing": checkpointing,
                  "estimated_gb": round(estimate["total"], 3),
                  "estimated_activation_gb": round(estimate.get("activation", 0.0), 3),
                  "estimate_s": round(time.perf_counter() - t0, 1)}  # fmt: skip
        if not args.estimate_only:
            record["measured_gb"] = round(measure_step_gb(
                cfg, args.vocab, args.tokens, args.precision, args.master_weights, checkpointing,
                args.device_obj), 3)  # fmt: skip
            record["measured_kind"] = ("cuda_max_memory_allocated" if args.device_obj.type ==
                                       "cuda" else "cpu_profiler_allocations")  # fmt: skip
        rec.emit({**record, **environment(args.device_obj)})
