"""Speed benchmarks of mt: training steps, the data loader, decoding.

Run through make (options pass through ARGS):

    make bench                                    # `all`: a quick run of each benchmark
    make bench ARGS="train --d-model 256 --layers 3 --heads 4 --d-ff 1024 --vocab 8000 \\
        --batch-size 25 --min-len 20 --max-len 40 --steps 20 --threads 2"
    make bench ARGS="train --preset small --baseline torch --steps 20 --threads 2"
    make bench ARGS="train --preset base --data .cache/mt/<hash>/train --max-tokens 4096"
    make bench ARGS="train --preset base --data .cache/mt/<hash>/train --max-tokens 3125 \\
        --precision bf16 --ddp 8"                 # DDP over the 8 local GPUs, torchrun
    make bench ARGS="data --data .cache/mt/<hash>/train --max-tokens 4096"
    make bench ARGS="decode --model small --vocab 8000 --beam 4 --batch-size 32 --src-len 26 \\
        --gen-len 30 --threads 2"
    make bench ARGS="memory --preset big --vocab 37000 --tokens 25000 --precision bf16 \\
        --estimate-only"                          # the step's peak, activation checkpointing or not
    make bench ARGS="serve --checkpoint runs/multi30k_de_en/checkpoints/best.pt --threads 2"
    make bench ARGS="translate --checkpoint runs/multi30k_de_en/checkpoints/best.pt \\
        --input $MT_DATA_DIR/multi30k/test_2016_flickr.de --threads 2"   # against CTranslate2
    make bench ARGS="translate --checkpoint teacher.pt student.pt --settings mt:default \
        --input $MT_DATA_DIR/multi30k/test_2016_flickr.de --beams 5 --threads 2"  # two models

Each measurement is printed as one JSON object per line (and appended to ``--output FILE`` as
JSONL); a short table follows at the end. Training throughput is ``tgt_tok_per_s`` (non-pad
target tokens incl. EOS per second, median over timed steps); decoding reports ``sent_per_s``.
See ``bench_train.py`` for the FLOP count behind MFU.
"""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from mt.allocator import bound_onednn_kernels, preload_allocator  # noqa: E402  (nothing heavy)

if __name__ == "__main__":
    try:  # the allocator mt's commands run under (MT_ALLOCATOR), before torch is imported
        preload_allocator()
    except ValueError as err:
        sys.exit(f"bench: {err}")

from bench_common import PRESETS, Recorder, pick_device, set_threads  # noqa: E402

from mt.schema import DecodeConfig  # noqa: E402  (no torch: the settings' defaults)

log = logging.getLogger("bench")


def _common(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("run")
    g.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    g.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: default)")
    g.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    g.add_argument("--seed", type=int, default=1)
    g.add_argument("--output", help="append each measurement to this JSONL file")
    g.add_argument("--warmup-steps", type=int, default=None, help="untimed steps first")


def _shape(p: argparse.ArgumentParser, default_preset: str | None) -> None:
    g = p.add_argument_group("model shape (explicit flags override the preset)")
    g.add_argument("--preset", "--model", dest="preset", choices=PRESETS, default=default_preset)
    g.add_argument("--d-model", type=int)
    g.add_argument("--layers", type=int, help="N, encoder and decoder layers")
    g.add_argument("--heads", type=int, help="h")
    g.add_argument("--d-ff", type=int)
    g.add_argument("--dropout", type=float, help="default: the preset's (0.1)")
    g.add_argument(
        "--attention-dropout",
        type=float,
        help="on attention weights (default: = --dropout; the paper and ../shared/peers use 0)",
    )
    g.add_argument("--norm", choices=("post", "pre"))
    g.add_argument("--vocab", type=int, default=8000, help="V (random-weight models)")


def _batch(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("batches (random tokens, or a prepared split with --data)")
    g.add_argument("--batch-size", type=int, default=25, help="sentence pairs per batch")
    g.add_argument("--min-len", type=int, default=20, help="shortest random sentence")
    g.add_argument("--max-len", type=int, default=40, help="longest random sentence")
    g.add_argument("--data", help="a prepared split: <cache dir>/<train|valid|test>")
    g.add_argument("--max-tokens", type=int, default=4096, help="batch size with --data")
    g.add_argument(
        "--pad-multiple", type=int, default=1,
        help="with --data: lengths padded up to a multiple (train.pad_multiple; fewer shapes)",
    )  # fmt: skip
    g.add_argument(
        "--shape-buckets", type=int, default=0,
        help="with --data: every batch one of K shapes (train.shape_buckets); with --compile the "
        "whole step compiled per shape, CUDA graphs on CUDA",
    )  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command")

    train = sub.add_parser("train", help="full training steps (tgt_tok_per_s, memory, MFU)")
    _common(train)
    _shape(train, "small")
    _batch(train)
    train.add_argument("--steps", type=int, default=20, help="timed steps")
    train.add_argument("--compile", action="store_true", help="torch.compile the model")
    train.add_argument(
        "--master-weights", action="store_true",
        help="bf16: a 16-bit model and float32 master weights (train.master_weights), no autocast",
    )  # fmt: skip
    train.add_argument(
        "--blas", choices=("default", "cublas", "cublaslt"), default="default",
        help="CUDA: the library torch's matrix products use (torch.backends.cuda."
        "preferred_blas_library); cuBLASLt's host setup of a product can be the cheaper",
    )  # fmt: skip
    train.add_argument(
        "--cpu-kernels",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="CPU: mt's training copy (train.cpu_kernels: oneDNN products, 16-bit dropout masks)",
    )
    train.add_argument(
        "--baseline",
        choices=("none", "torch"),
        default="none",
        help="torch: alternate with torch.nn.Transformer on the same batches",
    )
    train.add_argument(
        "--ddp", type=int, default=0, metavar="N",
        help="N ranks on this machine under torchrun (one GPU each; gloo on a CPU); the "
        "figures are the whole job's, each rank timing its own batches",
    )  # fmt: skip
    train.add_argument("--smoothing", type=float, default=0.1, help="label smoothing eps")
    train.add_argument("--noam-warmup", type=int, default=4000, help="Noam schedule warm-up")
    train.add_argument("--peak-tflops", type=float, help="peak for MFU (GPU default: measured)")

    data = sub.add_parser("data", help="data loader alone (batches/s, tokens/s)")
    _common(data)
    data.add_argument("--data", help="a prepared split (default: synthetic token arrays)")
    data.add_argument("--max-tokens", type=int, default=4096)
    data.add_argument("--sentences", type=int, default=20000, help="synthetic split size")
    data.add_argument("--min-len", type=int, default=5)
    data.add_argument("--max-len", type=int, default=40)
    data.add_argument("--vocab", type=int, default=8000)
    data.add_argument("--epochs", type=int, default=1, help="timed passes over the split")
    data.add_argument("--max-batches", type=int, default=0, help="stop each pass early (0: off)")
    data.add_argument("--shape-buckets", type=int, default=0,
                      help="every batch one of K shapes (train.shape_buckets): padding share")

    decode = sub.add_parser("decode", help="greedy and beam search (sent_per_s, tok_per_s)")
    _common(decode)
    _shape(decode, "small")
    decode.add_argument("--batch-size", type=int, default=32)
    decode.add_argument("--batches", type=int, default=2, help="timed batches per search")
    decode.add_argument("--src-len", type=int, default=26)
    decode.add_argument("--gen-len", type=int, default=30, help="forced output length")
    decode.add_argument("--beam", type=int, default=4, help="beam size (1: greedy only)")
    decode.add_argument("--checkpoint", help="a trained model (real output lengths)")
    decode.add_argument("--input", help="with --checkpoint: source sentences, one per line")
    decode.add_argument(
        "--profile", action="store_true",
        help="also profile one batch of each search: ms in products, attention, the vocabulary "
        "softmax, beam bookkeeping, other ops and Python",
    )  # fmt: skip

    real = sub.add_parser(
        "translate", help="a real test file with a trained checkpoint: mt (its default engine) "
        "against CTranslate2 called directly on the same converted model"
    )  # fmt: skip
    _common(real)
    real.add_argument("--checkpoint", nargs="+", help="the trained model (required); several: "
                      "each round decodes with each in turn (models compared in one sitting)")
    real.add_argument("--input", help="source sentences, one per line (required)")
    real.add_argument("--lines", type=int, default=1000, help="sentences decoded")
    real.add_argument("--beams", type=int, nargs="+", default=[1, 5], help="1: greedy")
    real.add_argument("--alpha", type=float, default=0.0, help="the length penalty (both)")
    real.add_argument("--batch-size", type=int, default=32)
    real.add_argument("--max-len", type=int, default=100, help="output tokens at most (b)")
    real.add_argument("--max-len-a", type=float, default=0.0, help="+ a x source length (mt)")
    real.add_argument("--rounds", type=int, default=3, help="alternating rounds (medians)")
    real.add_argument("--settings", nargs="*", help="e.g. mt:default mt:torch ct2:int8 "
                      "(default all but mt:torch)")  # fmt: skip
    real.add_argument("--inter-threads", type=int, default=0, help="CTranslate2's replicas, "
                      "mt's and the direct call's (0: auto, mt.decode.engine.threads)")
    real.add_argument("--intra-threads", type=int, default=0, help="threads per replica (0: auto)")
    real.add_argument("--workdir", help="where the conversion is timed (default: a temp dir)")
    real.add_argument("--shortlist", help="a lexicon file (mt.decode.shortlist): mt:default+sl "
                      "and ct2:float32+vmap too")  # fmt: skip
    real.add_argument("--shortlist-k", type=int, default=DecodeConfig.shortlist_k,
                      help="decode.shortlist_k")  # fmt: skip
    real.add_argument("--shortlist-frequent", type=int, default=DecodeConfig.shortlist_frequent,
                      help="decode.shortlist_frequent")  # fmt: skip

    serve = sub.add_parser("serve", help="mt-serve on loopback: sentences/s, p50/p99 latency")
    _common(serve)
    serve.add_argument("--checkpoint", help="the model to serve (required)")
    serve.add_argument("--input", help="source sentences, one per line (default: a few built in)")
    serve.add_argument("--requests", type=int, default=96, help="requests per client count")
    serve.add_argument("--seconds", type=float, default=60, help="time bound per client count")
    serve.add_argument("--clients", type=int, nargs="+", default=[1, 16])
    serve.add_argument("--sentences-per-request", type=int, default=1)
    serve.add_argument("--rounds", type=int, default=2, help="alternations of the client counts")
    serve.add_argument("--beam", type=int, default=4)
    serve.add_argument("--batch-sentences", type=int, default=64, help="serve.batch_sentences")
    serve.add_argument("--batch-wait-ms", type=float, default=5.0, help="serve.batch_wait_ms")

    memory = sub.add_parser("memory", help="a training step's peak memory with and without "
                            "activation checkpointing: the memory model, and measured")
    _common(memory)
    _shape(memory, "base")
    memory.add_argument("--tokens", type=int, default=25000, help="padded tokens per batch")
    memory.add_argument("--master-weights", action="store_true",
                        help="bf16: a 16-bit model and float32 master weights")
    memory.add_argument("--checkpointing", choices=("off", "on", "both"), default="both",
                        help="train.activation_checkpointing")
    memory.add_argument("--estimate-only", action="store_true",
                        help="the memory model alone (fake tensors: no memory, any device)")

    every = sub.add_parser("all", help="a quick run of each benchmark (the default)")
    _common(every)
    return parser


def _defaults_for_all(args: argparse.Namespace) -> list[argparse.Namespace]:
    """The quick `all` runs: small shapes, few steps, the common options of the `all` call."""
    parser = build_parser()
    common = ["--device", args.device, "--threads", str(args.threads), "--precision",
              args.precision, "--seed", str(args.seed)]  # fmt: skip
    if args.output:
        common += ["--output", args.output]
    runs = [
        ["train", "--preset", "small", "--batch-size", "8", "--steps", "5", "--warmup-steps", "2"],
        ["data", "--sentences", "5000", "--max-batches", "200"],
        ["decode", "--preset", "small", "--batch-size", "8", "--batches", "1", "--src-len", "20",
         "--gen-len", "20", "--warmup-steps", "1"],
    ]  # fmt: skip
    return [parser.parse_args(run + common) for run in runs]


def run(args: argparse.Namespace, rec: Recorder) -> None:
    args.device_obj = pick_device(args.device)
    if args.command == "train":
        from bench_train import run_train

        args.warmup_steps = 3 if args.warmup_steps is None else args.warmup_steps
        run_train(args, rec)
    elif args.command == "data":
        from bench_data import run_data

        args.warmup_steps = 0 if args.warmup_steps is None else args.warmup_steps
        run_data(args, rec)
    elif args.command == "decode":
        from bench_decode import run_decode

        args.warmup_steps = 1 if args.warmup_steps is None else args.warmup_steps
        run_decode(args, rec)
    elif args.command == "translate":
        from bench_translate import run_translate

        run_translate(args, rec)
    elif args.command == "memory":
        from bench_memory import run_memory

        run_memory(args, rec)
    elif args.command == "serve":
        from bench_serve import run_serve

        run_serve(args, rec)


def _under_torchrun(ranks: int, argv: list[str]) -> int:
    """This benchmark again, as ``ranks`` local processes of one torchrun job."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={ranks}", __file__, *argv]  # fmt: skip
    logging.getLogger("bench").info("%s", " ".join(command))
    return subprocess.call(command)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s | %(levelname)s | %(message)s",
        datefmt="%H:%M:%S", stream=sys.stderr,
    )  # fmt: skip
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0].startswith("-") and argv[0] not in ("-h", "--help"):
        argv = ["all", *argv]
    args = build_parser().parse_args(argv)
    if getattr(args, "ddp", 0) > 1 and "WORLD_SIZE" not in os.environ:
        return _under_torchrun(args.ddp, argv)
    bound_onednn_kernels()  # as the mt commands do (before this process's first kernel)
    set_threads(args.threads)
    rec = Recorder(args.output)
    for one in _defaults_for_all(args) if args.command == "all" else [args]:
        run(one, rec)
    if os.environ.get("RANK", "0") == "0":  # under torchrun, rank 0 reports
        print(rec.table(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
