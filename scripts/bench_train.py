"""Training-step benchmark: mt's Transformer (and optionally torch.nn.Transformer) on one shape.

A step is what training does, through the training code itself (``mt.train.update.Updater``):
forward, label-smoothed loss, backward, gradient norm, Adam, Noam scheduler.
Throughput is non-pad target tokens (EOS included; fairseq's ``wps``) per second of a step,
the median over the timed steps after ``--warmup-steps`` untimed ones. With ``--baseline torch``
the two implementations alternate step by step on the same batches, so their ratio comes from
one run on a shared machine. The baseline computes its loss the textbook way (fairseq's):
logits at every position, ``log_softmax`` in float32, padding masked (``textbook_loss``); mt
projects only the non-pad positions and uses its fused loss (``mt.model.loss``).

MFU (model FLOPs utilisation) counts the useful (non-pad) work of a batch:

    FLOPs = 6 * (P_enc * sum(S_i) + (P_dec + D * V) * sum(T_i))
          + 12 * D * (N_enc * sum(S_i^2) + N_dec * sum(T_i^2 + T_i * S_i))

(6 = 2 forward + 4 backward FLOPs per weight per token; attention: Q K^T and A V are 2 * L * D
FLOPs each per query token and layer forward, times 3 with backward; the causal half is not
discounted), divided by the step time and by the peak (a measured bf16 matmul or --peak-tflops).
"""

from __future__ import annotations

import argparse
import logging
import math
import time
from typing import Any

import torch
import torch.nn.functional as F
from bench_common import (
    Recorder,
    autocast,
    environment,
    measure_peak_tflops,
    median,
    model_config,
    peak_memory_mb,
    random_batches,
    reset_peak_memory,
    shape_fields,
    sync,
)
from torch import nn

from mt import distributed
from mt.fast.compile import compile_step, compiled_graphs, step_loss
from mt.fast.graphs import graph_memory_gb
from mt.fast.training import for_training
from mt.model.loss import label_smoothed_nll_loss
from mt.model.transformer import build_model, sinusoidal_positions
from mt.schema import Config, ModelConfig
from mt.train.schedule import noam_lambda
from mt.train.state import TrainState
from mt.train.update import Updater, build_optimizer
from mt.vocab import PAD

log = logging.getLogger("bench")

FLOPS_FORMULA = (
    "6*(P_enc*sum(S_i) + (P_dec + d_model*V)*sum(T_i)) + 12*d_model*(N_enc*sum(S_i^2) + "
    "N_dec*sum(T_i^2 + T_i*S_i)), per non-pad target token (incl. EOS); S_i, T_i non-pad "
    "lengths incl. EOS; P_enc/P_dec = encoder/decoder layer parameters (no embeddings)"
)


class TorchTransformer(nn.Module):
    """The same shape with ``torch.nn.Transformer``: shared sqrt(D)-scaled embedding, sinusoidal
    positions, tied output projection (note: nn.Transformer adds a final LayerNorm per stack
    even in post-LN mode)."""

    def __init__(self, cfg: ModelConfig, vocab_size: int) -> None:
        super().__init__()
        self.d_model = cfg.d_model
        self.embed = nn.Embedding(vocab_size, cfg.d_model, padding_idx=PAD)
        nn.init.normal_(self.embed.weight, std=cfg.d_model**-0.5)
        self.register_buffer("pe", sinusoidal_positions(cfg.max_positions, cfg.d_model), False)
        self.dropout = nn.Dropout(cfg.dropout)
        self.transformer = nn.Transformer(
            d_model=cfg.d_model,
            nhead=cfg.h,
            num_encoder_layers=cfg.N,
            num_decoder_layers=cfg.N_dec or cfg.N,
            dim_feedforward=cfg.d_ff,
            dropout=cfg.dropout,
            batch_first=True,
            norm_first=cfg.norm == "pre",
        )

    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) * math.sqrt(self.d_model)  # (B, L, D)
        return self.dropout(x + self.pe[: tokens.size(1)])

    def forward(self, src: torch.Tensor, tgt_in: torch.Tensor, real=None) -> torch.Tensor:
        """src (B, S), tgt_in (B, T) -> logits (B, T, V) (all positions, as fairseq does)."""
        T = tgt_in.size(1)
        causal = nn.Transformer.generate_square_subsequent_mask(T, device=src.device)
        src_pad = src == PAD  # torch's polarity: True = ignore
        h = self.transformer(
            self._embed(src),
            self._embed(tgt_in),
            tgt_mask=causal,
            src_key_padding_mask=src_pad,
            memory_key_padding_mask=src_pad,
            tgt_is_causal=True,
        )
        return F.linear(h, self.embed.weight)

    def stack_params(self) -> tuple[int, int]:
        enc = sum(p.numel() for p in self.transformer.encoder.parameters())
        dec = sum(p.numel() for p in self.transformer.decoder.parameters())
        return enc, dec


def mt_stack_params(model: nn.Module) -> tuple[int, int]:
    """(encoder, decoder) parameters of mt's Transformer, layers and final norms, no embeddings."""
    enc = sum(p.numel() for m in (model.encoder, model.encoder_norm) for p in m.parameters())
    dec = sum(p.numel() for m in (model.decoder, model.decoder_norm) for p in m.parameters())
    return enc, dec


def batch_flops(batch, p_enc: int, p_dec: int, cfg: ModelConfig, vocab: int) -> float:
    """Training FLOPs of one batch (see the module docstring)."""
    S = (batch.src != PAD).sum(dim=1).double()  # (B,) non-pad source lengths incl. EOS
    T = (batch.tgt_out != PAD).sum(dim=1).double()  # (B,)
    D, n_enc, n_dec = cfg.d_model, cfg.N, cfg.N_dec or cfg.N
    dense = 6 * (p_enc * S.sum() + (p_dec + D * vocab) * T.sum())
    attn = 12 * D * (n_enc * (S * S).sum() + n_dec * (T * T + T * S).sum())
    return float(dense + attn)


# Dense bf16 tensor-core peaks from NVIDIA's datasheets (TFLOP/s, no sparsity): what MFU is
# quoted against by MLPerf and the papers (the measured matmul peak is reported beside it).
DATASHEET_BF16_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0, "L40S": 362.0}


def datasheet_tflops(device: torch.device, precision: str) -> float | None:
    """The datasheet's dense bf16 peak of this GPU (None: a CPU, fp32, or a GPU not listed)."""
    if device.type != "cuda" or precision != "bf16":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in DATASHEET_BF16_TFLOPS.items() if k in name), None)


def textbook_loss(model, batch, eps: float, precision: str):
    """The loss as fairseq and most PyTorch code compute it: logits at every position,
    ``log_softmax`` in float32, then the label-smoothed NLL with padding masked out."""
    with autocast(batch.src.device, precision):
        logits = model(batch.src, batch.tgt_in)  # (B, T, V)
    lprobs = F.log_softmax(logits.float(), dim=-1)
    loss, nll = label_smoothed_nll_loss(
        lprobs.view(-1, lprobs.size(-1)), batch.tgt_out.reshape(-1), eps
    )
    return loss * batch.weight, nll * batch.weight


class Runner:
    """One implementation under test, stepped by the training code's own ``mt.train.update.Updater``
    (forward, label-smoothed loss, backward, gradient norm, Adam, Noam), set up as
    ``mt.train.recipe.setup`` does."""

    def __init__(
        self, name: str, model: nn.Module, args, cfg: ModelConfig, device, textbook: bool = False,
        info: distributed.DistInfo | None = None, shapes: list | None = None,
    ) -> None:  # fmt: skip
        self.name, self.device = name, device
        self.model = model.to(device).train()
        # what the optimiser updates: the model's parameters, or the float32 master weights
        # that a 16-bit working copy follows (train.master_weights)
        master = getattr(model, "master", None)
        params = master.params if master is not None else list(self.model.parameters())
        self.n_params = sum(p.numel() for p in params)
        run_cfg = Config(model=cfg)
        tc = run_cfg.train
        tc.label_smoothing, tc.precision, tc.compile = args.smoothing, args.precision, args.compile
        tc.warmup, tc.clip_norm = args.noam_warmup, 0.0
        if textbook:  # the baseline: torch's default Adam and the textbook loss (fairseq's)
            opt = torch.optim.Adam(params, lr=1.0, betas=(tc.beta1, tc.beta2), eps=tc.eps)
        else:  # mt: the training code's own optimiser (fused Adam) and loss
            opt = build_optimizer(params, tc, device)
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, noam_lambda(cfg.d_model, tc.warmup, tc.factor, tc.lr)
        )
        scaler = torch.amp.GradScaler(device.type, enabled=tc.precision == "fp16")
        tc.shape_buckets = 0 if textbook else getattr(args, "shape_buckets", 0)
        # as mt.train: dynamic shapes when compiled; with shape buckets the whole step per shape
        forward = compile_step(self.model, tc, device, shapes)
        world = 1
        if info is not None and info.distributed:  # as mt.train.recipe: compiled, then DDP
            forward, world = distributed.wrap(forward, info), info.world_size
        self.update = Updater(
            forward, params, opt, sched, scaler, run_cfg, world,
            textbook_loss if textbook else step_loss(forward),
        )  # fmt: skip
        self.state = TrainState()
        self.tok_per_s: list[float] = []
        self.seconds: list[float] = []
        self.tokens = 0
        self.flops = 0.0
        self.peak_mem = 0.0
        self.losses: list[float] = []
        self.first_shape_s: list[float] = []  # the steps at a shape met first

    def step(self, batch) -> tuple[float, float]:
        """One full training update; returns (seconds, loss per target token)."""
        sync(self.device)
        start = time.perf_counter()
        result = self.update([batch], self.state)  # one read of the device (step or skip)
        sync(self.device)
        seconds = time.perf_counter() - start
        return seconds, result.loss if result is not None else float("nan")


def batch_dims(batch) -> tuple[int, int, int]:
    """(sentences, source width, target width) of a batch."""
    return batch.src.size(0), batch.src.size(1), batch.tgt_in.size(1)


def padding_share(batches) -> dict[str, float]:
    """Each side's share of padded positions over ``batches`` (a shape bucket's empty rows
    count as padding, their one EOS too)."""
    real = {"src": 0, "tgt": 0}
    total = {"src": 0, "tgt": 0}
    for b in batches:
        rows = (b.tgt_out != PAD).any(1)
        real["src"] += int((b.src[rows] != PAD).sum())
        real["tgt"] += int(b.ntokens)
        total["src"] += b.src.numel()
        total["tgt"] += b.tgt_out.numel()
    return {k: round(1 - real[k] / max(total[k], 1), 4) for k in real}


def run_train(args, rec: Recorder) -> list[dict[str, Any]]:
    """Benchmark training steps; emits one record per implementation.

    Under torchrun (``--ddp N``) every rank steps its own batches through DDP; a step's figure
    is the tokens of all ranks over the slowest rank's time, and rank 0 emits the records."""
    info = None
    if args.ddp > 1:
        if args.baseline != "none":
            raise SystemExit("--ddp measures mt alone: leave out --baseline")
        info = distributed.setup(args.device)
        args.device_obj = info.device
    device = args.device_obj
    rank, world = (info.rank, info.world_size) if info else (0, 1)
    if args.data:
        from bench_data import load_prepared, real_batches

        prepared, split = load_prepared(args.data)
        if args.vocab != prepared.vocab_size:
            log.info("--data: vocabulary %d (the prepared tokenizer's)", prepared.vocab_size)
        args.vocab = prepared.vocab_size
    cfg = model_config(args)
    if args.blas != "default":
        if device.type != "cuda":
            raise SystemExit(f"--blas {args.blas} chooses a CUDA library: not for {device}")
        torch.backends.cuda.preferred_blas_library(args.blas)
    torch.manual_seed(args.seed)
    mt_model = build_model(cfg, args.vocab).to(device)  # before any copy for_training makes
    p_enc, p_dec = mt_stack_params(mt_model)
    mt_forward = for_training(  # as mt.train
        mt_model, device, args.cpu_kernels, args.precision, args.compile,
        master_weights=args.master_weights,
    )
    n = args.warmup_steps + args.steps
    buckets = getattr(args, "shape_buckets", 0)
    if buckets and not args.data:
        raise SystemExit("--shape-buckets needs --data (the shapes come from its lengths)")
    if args.data:
        batches = real_batches(
            split, args.data, args.max_tokens, n, args.seed, rank, world, args.pad_multiple,
            one_graph=args.compile, buckets=buckets,
        )
        source = args.data
    else:  # each rank its own batches (seeds rank x 1000 on)
        batches = random_batches(
            argparse.Namespace(**{**vars(args), "seed": args.seed + 1000 * rank}), n
        )
        source = f"random B={args.batch_size} len=[{args.min_len},{args.max_len}]"
    shapes = sorted({batch_dims(b) for b in batches}) if buckets else None
    runners = [Runner("mt", mt_forward, args, cfg, device, info=info, shapes=shapes)]
    if args.baseline == "torch":
        torch_model = TorchTransformer(cfg, args.vocab)
        runners.append(Runner("torch", torch_model, args, cfg, device, textbook=True))

    peak_tflops = args.peak_tflops
    peak_source = "--peak-tflops" if peak_tflops else None
    if peak_tflops is None and device.type == "cuda":
        peak_tflops = measure_peak_tflops(device)
        peak_source = "measured bf16 matmul 8192^3"
        rec.emit({"bench": "peak", "size": 8192, "peak_tflops": peak_tflops, **environment(device)})

    datasheet = datasheet_tflops(device, args.precision)
    log.info("train: %d warm-up + %d timed steps, %s", args.warmup_steps, args.steps, source)
    seen: set = set()
    for i, batch in enumerate(batches):
        batch = batch.to(device)
        flops = batch_flops(batch, p_enc, p_dec, cfg, args.vocab)
        # Alternate the order too, so neither implementation always runs on a warmer cache.
        order = runners if i % 2 == 0 else runners[::-1]
        first = batch_dims(batch) not in seen  # a shape met first: compiled, graphs captured
        seen.add(batch_dims(batch))
        for r in order:
            reset_peak_memory(device)
            seconds, loss = r.step(batch)
            if first:
                r.first_shape_s.append(seconds)
            r.peak_mem = max(r.peak_mem, peak_memory_mb(device)[0])
            if not math.isfinite(loss):
                raise RuntimeError(f"{r.name}: non-finite loss at step {i}")
            r.losses.append(loss)
            if i >= args.warmup_steps:
                r.seconds.append(seconds)
                r.tok_per_s.append(batch.ntokens / seconds)
                r.tokens += batch.ntokens
                r.flops += flops

    if world > 1:
        _whole_job(runners[0])
        if rank != 0:
            distributed.cleanup()
            return []
    records = []
    for r in runners:
        tok_s = median(r.tok_per_s)
        flops_per_tok = r.flops / max(r.tokens, 1)
        record = {
            "bench": "train",
            "impl": r.name,
            **shape_fields(cfg, args.vocab),
            "params": r.n_params,
            "precision": args.precision,
            "compile": args.compile,
            # graphs Dynamo made over the warm-up and timed steps (each is minutes on a GPU host)
            "compiled_graphs": compiled_graphs() if args.compile else None,
            "master_weights": bool(args.master_weights and r.name == "mt"),
            "blas": args.blas,
            "cpu_kernels": bool(args.cpu_kernels and device.type == "cpu" and r.name == "mt"),
            "source": source,
            "batch_size": args.batch_size if not args.data else None,
            "min_len": args.min_len if not args.data else None,
            "max_len": args.max_len if not args.data else None,
            "max_tokens": args.max_tokens if args.data else None,
            "pad_multiple": args.pad_multiple if args.data else None,
            "shape_buckets": buckets,
            "shapes_met": len(seen),
            # the steps that met a shape first: compiling and, on CUDA with buckets, capturing
            "first_shape_s": round(sum(r.first_shape_s), 2),
            "padding_share": padding_share(batches),
            **({"graph_memory": graph_memory_gb(device)} if device.type == "cuda" else {}),
            "steps": args.steps,
            "warmup_steps": args.warmup_steps,
            "tgt_tok_per_s": tok_s,
            "tgt_tok_per_s_mean": r.tokens / sum(r.seconds) if r.seconds else float("nan"),
            "step_ms_median": 1000 * median(r.seconds),
            "step_ms": [round(1000 * s, 1) for s in r.seconds],  # each timed step, in order
            "tgt_tokens_per_step": r.tokens / max(len(r.seconds), 1),
            "first_loss": r.losses[0],
            "last_loss": r.losses[-1],
            "peak_mem_mb": r.peak_mem,
            "peak_mem_kind": peak_memory_mb(device)[1],
            "flops_formula": FLOPS_FORMULA,
            "flops_per_tgt_tok": flops_per_tok,
            "achieved_tflops": tok_s * flops_per_tok / 1e12,
            "peak_tflops": peak_tflops,
            "peak_source": peak_source,
            "mfu": tok_s * flops_per_tok / (world * peak_tflops * 1e12) if peak_tflops else None,
            "datasheet_tflops": datasheet,
            "mfu_datasheet": (
                tok_s * flops_per_tok / (world * datasheet * 1e12) if datasheet else None
            ),
            "ranks": world,
            "tgt_tok_per_s_per_rank": tok_s / world,
            **environment(device),
        }
        if device.type == "cpu" and len(runners) > 1:
            record["peak_mem_note"] = "max RSS of the whole process (both implementations)"
        records.append(record)
    if len(records) == 2:
        ratio = records[0]["tgt_tok_per_s"] / records[1]["tgt_tok_per_s"]
        log.info("mt / torch.nn.Transformer throughput ratio: %.3f", ratio)
        for record in records:
            record["ratio_mt_over_torch"] = ratio
    for record in records:
        rec.emit(record)
    if world > 1:
        distributed.cleanup()
    return records


def _whole_job(r: Runner) -> None:
    """Turn rank-local step figures into the whole job's: per step, the tokens of all ranks
    over the slowest rank's seconds; tokens and FLOPs summed, peak memory the largest rank's."""
    dist = torch.distributed
    seconds = torch.tensor(r.seconds, dtype=torch.float64)
    tokens = torch.tensor([t * s for t, s in zip(r.tok_per_s, r.seconds)], dtype=torch.float64)
    totals = torch.tensor([r.tokens, r.flops], dtype=torch.float64)
    peak = torch.tensor([r.peak_mem], dtype=torch.float64)
    for t, op in ((seconds, dist.ReduceOp.MAX), (tokens, dist.ReduceOp.SUM),
                  (totals, dist.ReduceOp.SUM), (peak, dist.ReduceOp.MAX)):  # fmt: skip
        dist.all_reduce(t, op=op)
    r.seconds, r.tok_per_s = seconds.tolist(), (tokens / seconds).tolist()
    r.tokens, r.flops, r.peak_mem = int(totals[0]), float(totals[1]), float(peak)
