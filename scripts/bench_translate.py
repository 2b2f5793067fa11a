"""Decoding a real test file with a trained checkpoint: mt against CTranslate2 on the same model.

    make bench ARGS="translate --checkpoint runs/multi30k_de_en/checkpoints/best.pt \\
        --input $MT_DATA_DIR/multi30k/test_2016_flickr.de --beams 1 5 --rounds 3 --threads 2"

The checkpoint is exported with ``mt-export format=ctranslate2`` (into ``--workdir``, once per
checkpoint and shortlist settings); then each engine and setting (mt: fp32, int8, bf16;
CTranslate2: float32, int8, each also with ``+mkl``, its ``CT2_USE_MKL=1``) decodes the whole file
in a process of its own (so each peak RSS is its own: CTranslate2's loads neither torch nor the mt
checkpoint, only the export and its ``spm.model``), with the same beam, batches of ``--batch-size``
sentences, no length penalty, and the same length limit (``--max-len`` output tokens, absolute:
CTranslate2 has one limit per call), and the same ``--workers``: batches decoded side by side,
``--threads`` shared among them (mt's ``decode.workers``, CTranslate2's ``inter_threads`` with
``intra_threads`` = threads / workers; 0: one worker per thread). A warm-up pass over the first
batch is not timed. Rounds alternate the engines; each figure is the median over rounds of
sentences/s and output tokens/s (pieces + EOS). Outputs are compared with mt fp32's: ``identical``
counts the sentences whose ids are the same. With ``--shortlist LEXICON``
(``mt.decode.shortlist``), mt's fp32 and int8 run again with ``decode.shortlist`` (``+sl``), and
CTranslate2's float32 and int8 with the same lists as the export's vocabulary map (``+vmap``,
``use_vmap=True``; CTranslate2 gives a batch the union of its sentences' lists, where mt holds each
sentence to its own). Named in ``--settings`` only: ``mt:fp32+torchattn`` (and int8, bf16), mt
with ``MT_NATIVE_KERNELS=0``, its decoder steps' attention through torch's products instead of
its C++ kernel (``mt.fast.native``); ``mt:int8+fbgemm`` and ``mt:int8+sl+fbgemm``, int8 on
fbgemm's products instead of mt's VNNI kernel (``MT_INT8_KERNEL=fbgemm``).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ENGINES = {"mt": ("fp32", "int8", "bf16"), "ct2": ("float32", "int8", "float32+mkl", "int8+mkl")}
# With --shortlist FILE (a lexicon, mt.decode.shortlist): mt's settings again with it ("+sl"),
# and CTranslate2's with the same lists as its vocabulary map ("+vmap": use_vmap=True).
SHORTLISTED = {"mt": ("fp32+sl", "int8+sl"), "ct2": ("float32+vmap", "int8+vmap")}
# Only when named in --settings: mt without its C++ attention kernel (MT_NATIVE_KERNELS=0),
# the decoder steps' attention through torch's products, to measure what the kernel buys; and
# int8 on fbgemm's products instead of mt's VNNI kernel (MT_INT8_KERNEL=fbgemm).
ON_REQUEST = {"mt": ("fp32+torchattn", "int8+torchattn", "bf16+torchattn", "int8+fbgemm",
                    "int8+sl+fbgemm"), "ct2": ()}
# CTranslate2 uses Intel MKL's products only on Intel CPUs unless CT2_USE_MKL=1 asks for them
# (elsewhere oneDNN's): "+mkl" sets it, so that CTranslate2's best setting is measured on AMD too.


def worker(args) -> dict:
    """One engine, one setting, one beam: decode the file, report seconds and outputs."""
    import resource

    from mt.data.tokenizer import Tokenizer

    n = args.batch_size
    workers = args.workers  # resolved by run_translate, as threads
    if args.engine == "mt":
        import torch

        torch.set_num_threads(args.threads)
        from mt.checkpoint import load_model
        from mt.decode.driver import translate_ids
        from mt.schema import DecodeConfig

        model, tok, _ = load_model(args.checkpoint)
        setting, _, extra = args.setting.partition("+")
        quantize = "int8" if setting == "int8" else "none"
        precision = "bf16" if setting == "bf16" else "fp32"
        cfg = DecodeConfig(beam_size=args.beam, alpha=0.0, max_len_a=0.0, max_len_b=args.max_len,
                           batch_size=n, quantize=quantize, precision=precision,
                           workers=workers,
                           shortlist=args.shortlist if "sl" in extra.split("+") else None,
                           shortlist_k=args.shortlist_k,
                           shortlist_frequent=args.shortlist_frequent)  # fmt: skip

        def decode(ids):
            return translate_ids(model, ids, cfg)
    else:  # CTranslate2 alone in its process (no torch, no mt model): its own memory
        import ctranslate2

        tok = Tokenizer.load([Path(args.ct2_dir) / "spm.model"])  # the export's, mt's own
        translator = ctranslate2.Translator(
            args.ct2_dir,
            device="cpu",
            compute_type=args.setting.partition("+")[0],
            inter_threads=workers,
            intra_threads=max(1, args.threads // workers),
        )
        sp = tok.model("src")
        vocab = {sp.id_to_piece(i): i for i in range(sp.vocab_size())}

        def decode(ids):
            pieces = [[sp.id_to_piece(i) for i in s] for s in ids]
            results = translator.translate_batch(
                pieces, beam_size=args.beam, length_penalty=0.0, max_batch_size=n,
                batch_type="examples", max_decoding_length=args.max_len, min_decoding_length=0,
                suppress_sequences=[["<pad>"], ["<s>"]], use_vmap=args.setting.endswith("+vmap"),
            )  # fmt: skip
            return [[vocab[p] for p in r.hypotheses[0]] for r in results]

    lines = Path(args.input).read_text(encoding="utf-8").splitlines()[: args.lines]
    src = tok.encode([tok.normalize(s) for s in lines], side="src")
    decode(src[:n])  # warm-up: not timed
    start = time.perf_counter()
    out = decode(src)
    seconds = time.perf_counter() - start
    return {
        "seconds": seconds,
        "tokens": sum(len(o) + 1 for o in out),
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        # mt's forked decoding workers (mt.decode.driver.side_by_side): the largest one's peak,
        # pages shared with this process (the model) counted in both
        "worker_peak_rss_mb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024,
        "outputs": out,
    }


def _one(args, engine: str, setting: str, beam: int) -> dict:
    cmd = [sys.executable, __file__, "--worker", "--engine", engine, "--setting", setting,
           "--beam", str(beam), "--checkpoint", args.checkpoint, "--input", args.input,
           "--lines", str(args.lines), "--batch-size", str(args.batch_size),
           "--max-len", str(args.max_len), "--threads", str(args.threads),
           "--workers", str(args.workers),
           "--ct2-dir", args.ct2_dir, "--shortlist", str(args.shortlist or ""),
           "--shortlist-k", str(args.shortlist_k),
           "--shortlist-frequent", str(args.shortlist_frequent)]  # fmt: skip
    env = None
    if setting.endswith("+mkl"):
        env = dict(os.environ, CT2_USE_MKL="1")
    elif setting.endswith("+torchattn"):
        env = dict(os.environ, MT_NATIVE_KERNELS="0")
    elif setting.endswith("+fbgemm"):
        env = dict(os.environ, MT_INT8_KERNEL="fbgemm")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"{engine} {setting} beam {beam} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run_translate(args, rec) -> None:
    """The comparison (see the module docstring); one record per engine, setting and beam."""
    from bench_common import environment

    from mt.export import export

    if not args.checkpoint or not args.input:
        raise SystemExit("bench translate needs --checkpoint and --input")
    import torch

    args.threads = args.threads or torch.get_num_threads()  # 0: the count bench.py left in force
    args.workers = args.workers or args.threads  # 0: one per thread
    work = Path(args.workdir or tempfile.mkdtemp(prefix="mt-bench-translate-"))
    ct2 = work / ("ct2-shortlist" if args.shortlist else "ct2")  # with its vocabulary map
    args.ct2_dir = str(ct2)
    # a --workdir export is reused only for the same checkpoint and lists
    made = json.dumps([str(args.checkpoint), args.shortlist or None, args.shortlist_k,
                       args.shortlist_frequent])  # fmt: skip
    stamp = ct2 / "mt-export.json"
    if not (ct2 / "model.bin").is_file() or not stamp.is_file() or stamp.read_text() != made:
        export(args.checkpoint, "ctranslate2", ct2, args.shortlist or None, args.shortlist_k,
               args.shortlist_frequent)  # fmt: skip
        stamp.write_text(made)
    engines = dict(ENGINES)
    if args.shortlist:
        engines = {e: ENGINES[e] + SHORTLISTED[e] for e in ENGINES}
    settings = [(e, s) for e, ss in engines.items() for s in ss
                if not args.settings or f"{e}:{s}" in args.settings]  # fmt: skip
    settings += [(e, s) for e, ss in ON_REQUEST.items() for s in ss
                 if args.settings and f"{e}:{s}" in args.settings]  # fmt: skip
    env = environment(args.device_obj)
    for beam in args.beams:
        runs: dict[tuple[str, str], list[dict]] = {k: [] for k in settings}
        for r in range(args.rounds):
            order = settings if r % 2 == 0 else settings[::-1]  # alternate the engines
            for key in order:
                runs[key].append(_one(args, *key, beam))
        reference = runs.get(("mt", "fp32"), [None])[0]
        for (engine, setting), results in runs.items():
            secs = statistics.median(x["seconds"] for x in results)
            outs = results[0]["outputs"]
            same = None
            if reference is not None:
                same = sum(a == b for a, b in zip(outs, reference["outputs"]))
            rec.emit({
                "bench": "translate", "impl": f"{engine} {setting}", "search": f"beam {beam}",
                "sentences": len(outs), "sent_per_s": round(len(outs) / secs, 2),
                "tgt_tok_per_s": round(results[0]["tokens"] / secs, 1),
                "seconds": [round(x["seconds"], 6) for x in results],
                "peak_rss_mb": round(max(x["peak_rss_mb"] for x in results), 1),
                "worker_peak_rss_mb": round(max(x["worker_peak_rss_mb"] for x in results), 1),
                "identical_to_mt_fp32": same, "beam": beam, "max_len": args.max_len,
                "batch_size": args.batch_size, "workers": args.workers,
                "shortlist": [args.shortlist, args.shortlist_k, args.shortlist_frequent]
                if {"sl", "vmap"} & set(setting.split("+")) else None,
                "checkpoint": args.checkpoint,
                "input": args.input, **env,
            })  # fmt: skip


def _worker_main(argv: list[str]) -> None:
    import argparse

    p = argparse.ArgumentParser()
    p.add_argument("--worker", action="store_true")
    for name in ("--engine", "--setting", "--checkpoint", "--input", "--ct2-dir", "--shortlist"):
        p.add_argument(name)
    for name in ("--beam", "--lines", "--batch-size", "--max-len", "--threads", "--workers",
                 "--shortlist-k", "--shortlist-frequent"):  # fmt: skip
        p.add_argument(name, type=int)
    result = worker(p.parse_args(argv))
    print(json.dumps(result))


if __name__ == "__main__":
    _worker_main(sys.argv[1:])
