"""Decoding a real test file with a trained checkpoint: mt against a direct CTranslate2 call on the
same converted model and settings.

    make bench ARGS="translate --checkpoint runs/multi30k_de_en/checkpoints/best.pt \\
        --input $MT_DATA_DIR/multi30k/test_2016_flickr.de --beams 1 5 --rounds 3 --threads 2"

Settings (``--settings``, default all but ``mt:torch``):

* ``mt:default``: mt's Translator with the default engine settings (``engine=auto``,
  ``compute_type=auto``, its thread settings), as ``mt-translate`` decodes;
* ``mt:int8``: the same with ``compute_type=int8``; ``mt:torch``: ``engine=torch`` (mt's own
  search, the reference of the translations);
* ``ct2:float32``, ``ct2:int8``: ``ctranslate2.Translator`` called directly on the model mt
  converted (``mt.decode.ctranslate2_engine.converted_model``, the same directory), with the same
  beam, batches, length penalty and limit, and the same ``inter_threads`` / ``intra_threads``.

With ``--shortlist LEXICON`` also ``mt:default+sl`` (``decode.shortlist``) and
``ct2:float32+vmap`` (the model converted with that vocabulary map, ``use_vmap=True``).

Each setting decodes the whole file in a process of its own (each peak RSS its own: CTranslate2's
loads neither torch nor the mt checkpoint). A warm-up call over the first batch is not timed. The
length limit is ``--max-len-a`` x source length + ``--max-len`` output tokens per sentence for
mt; CTranslate2 has one limit per call, the largest of the file's (with ``--max-len-a 0``, the
default, both have the same). With several ``--checkpoint`` models (a teacher and its students)
each round decodes with every model and setting in turn. Rounds alternate the settings; each
figure is the median over rounds of sentences/s and output tokens/s (pieces + EOS).
``identical`` counts the sentences whose ids equal the first setting's (of the same model). The
conversion that mt makes on its first call is timed on its own, once per compute type and model,
from a fresh copy of the checkpoint (``conversion`` records).
"""

from __future__ import annotations

import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SETTINGS = ("mt:default", "mt:int8", "ct2:float32", "ct2:int8")
ON_REQUEST = ("mt:torch",)
SHORTLISTED = ("mt:default+sl", "ct2:float32+vmap")


def _compute(setting: str) -> str:
    """The CTranslate2 compute type a setting decodes with (mt: its resolved ``auto``)."""
    from mt.decode.engine import compute_type

    name = setting.split(":")[1].split("+")[0]
    return compute_type("auto" if name in ("default", "torch") else name, "cpu")


def worker(args) -> dict:
    """One setting, one beam: decode the file, report seconds and outputs."""
    import resource

    from mt.data.tokenizer import Tokenizer
    from mt.decode.engine import threads
    from mt.schema import DecodeConfig

    engine, setting = args.setting.split(":")
    shortlisted = setting.endswith(("+sl", "+vmap"))
    shortlist = (args.shortlist, args.shortlist_k, args.shortlist_frequent) if shortlisted else None
    cfg = DecodeConfig(beam_size=args.beam, alpha=args.alpha, max_len_a=args.max_len_a,
                       max_len_b=args.max_len, batch_size=args.batch_size,
                       shortlist=args.shortlist if shortlisted else None,
                       shortlist_k=args.shortlist_k,
                       shortlist_frequent=args.shortlist_frequent)  # fmt: skip
    inter, intra = threads(args.inter_threads, args.intra_threads, args.threads)
    if engine == "mt":
        import torch

        torch.set_num_threads(args.threads)
        from mt.decode.driver import translate_ids
        from mt.decode.translate import Translator
        from mt.export import ct2 as exporter
        from mt.schema import EngineConfig

        name = setting.split("+")[0]
        ecfg = EngineConfig(engine="torch" if name == "torch" else "auto",
                            compute_type="auto" if name in ("default", "torch") else name,
                            inter_threads=args.inter_threads,
                            intra_threads=args.intra_threads)  # fmt: skip
        t = Translator.from_checkpoint(args.checkpoint, "cpu", cfg, ecfg, exporter=exporter)
        tok = t.tokenizer
        ct2 = t.engine(cfg)

        def decode(ids):
            if ct2 is not None:
                return [h[0].tokens for h in ct2.translate_nbest(ids, cfg)]
            return translate_ids(t.model, ids, cfg)
    else:  # CTranslate2 alone in its process (no torch, no mt model): its own memory
        import ctranslate2

        from mt.decode.ctranslate2_engine import converted_model
        from mt.export import ct2 as exporter

        model_dir, _ = converted_model(args.checkpoint, _compute(args.setting), exporter, shortlist)
        tok = Tokenizer.load([model_dir / "spm.model"])  # the conversion's, mt's own
        translator = ctranslate2.Translator(str(model_dir), device="cpu",
                                            compute_type=_compute(args.setting),
                                            inter_threads=inter,
                                            intra_threads=intra)  # fmt: skip
        sp = tok.model("src")
        vocab = {sp.id_to_piece(i): i for i in range(sp.vocab_size())}

        def decode(ids):
            limit = max(int(args.max_len_a * len(s) + args.max_len) for s in ids)
            pieces = [[sp.id_to_piece(i) for i in s] for s in ids]
            results = translator.translate_batch(
                pieces, beam_size=args.beam, length_penalty=args.alpha,
                max_batch_size=args.batch_size, batch_type="examples",
                max_decoding_length=limit, min_decoding_length=0, max_input_length=0,
                suppress_sequences=[["<pad>"], ["<s>"]], use_vmap=shortlisted,
            )  # fmt: skip
            return [[vocab[p] for p in r.hypotheses[0]] for r in results]

    lines = Path(args.input).read_text(encoding="utf-8").splitlines()[: args.lines]
    src = tok.encode([tok.normalize(s) for s in lines], side="src")
    decode(src[: args.batch_size])  # warm-up: not timed
    start = time.perf_counter()
    out = decode(src)
    seconds = time.perf_counter() - start
    return {
        "seconds": seconds,
        "tokens": sum(len(o) + 1 for o in out),
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "inter_threads": inter, "intra_threads": intra,
        "outputs": out,
    }  # fmt: skip


def _one(args, setting: str, beam: int, checkpoint: str) -> dict:
    cmd = [sys.executable, __file__, "--worker", "--setting", setting, "--beam", str(beam),
           "--checkpoint", checkpoint, "--input", args.input, "--lines", str(args.lines),
           "--batch-size", str(args.batch_size), "--max-len", str(args.max_len),
           "--max-len-a", str(args.max_len_a), "--alpha", str(args.alpha),
           "--threads", str(args.threads), "--inter-threads", str(args.inter_threads),
           "--intra-threads", str(args.intra_threads), "--shortlist", str(args.shortlist or ""),
           "--shortlist-k", str(args.shortlist_k),
           "--shortlist-frequent", str(args.shortlist_frequent)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{setting} beam {beam} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def conversion_seconds(checkpoint: str, compute_type: str, work: Path, shortlist=None) -> float:
    """The seconds of mt's first-call conversion, made from a fresh copy of ``checkpoint``."""
    from mt.decode.ctranslate2_engine import converted_model
    from mt.export import ct2 as exporter

    fresh = Path(tempfile.mkdtemp(prefix="convert-", dir=work))
    try:
        shutil.copy(checkpoint, fresh / "model.pt")
        _, seconds = converted_model(fresh / "model.pt", compute_type, exporter, shortlist)
    finally:
        shutil.rmtree(fresh, ignore_errors=True)
    return seconds


def run_translate(args, rec) -> None:
    """The comparison (see the module docstring); one record per setting and beam."""
    from bench_common import environment

    from mt.decode.ctranslate2_engine import converted_model
    from mt.export import ct2 as exporter

    if not args.checkpoint or not args.input:
        raise SystemExit("bench translate needs --checkpoint and --input")
    checkpoints = [args.checkpoint] if isinstance(args.checkpoint, str) else args.checkpoint
    import torch

    args.threads = args.threads or torch.get_num_threads()  # 0: the count bench.py left in force
    work = Path(args.workdir or tempfile.mkdtemp(prefix="mt-bench-translate-"))
    work.mkdir(parents=True, exist_ok=True)
    every = SETTINGS + ON_REQUEST + (SHORTLISTED if args.shortlist else ())
    chosen = [s for s in every if (s in args.settings if args.settings else s not in ON_REQUEST)]
    env = environment(args.device_obj)
    shortlist = (args.shortlist, args.shortlist_k, args.shortlist_frequent)
    for checkpoint in checkpoints:
        for compute in sorted({_compute(s) for s in chosen}):  # the first call's conversion
            rec.emit({"bench": "translate", "impl": f"conversion {compute}",
                      "seconds": round(conversion_seconds(checkpoint, compute, work), 3),
                      "checkpoint": checkpoint, **env})  # fmt: skip
            converted_model(checkpoint, compute, exporter)  # the model every setting then loads
            if args.shortlist:
                converted_model(checkpoint, compute, exporter, shortlist)
    pairs = [(c, s) for c in checkpoints for s in chosen]
    for beam in args.beams:
        runs: dict[tuple[str, str], list[dict]] = {k: [] for k in pairs}
        for r in range(args.rounds):
            order = pairs if r % 2 == 0 else pairs[::-1]  # alternate models and settings
            for checkpoint, key in order:
                runs[checkpoint, key].append(_one(args, key, beam, checkpoint))
        for (checkpoint, setting), results in runs.items():
            reference = runs[checkpoint, chosen[0]][0]["outputs"]
            secs = statistics.median(x["seconds"] for x in results)
            outs = results[0]["outputs"]
            rec.emit({
                "bench": "translate", "impl": setting.replace(":", " "), "search": f"beam {beam}",
                "sentences": len(outs), "sent_per_s": round(len(outs) / secs, 2),
                "tgt_tok_per_s": round(results[0]["tokens"] / secs, 1),
                "seconds": [round(x["seconds"], 6) for x in results],
                "peak_rss_mb": round(max(x["peak_rss_mb"] for x in results), 1),
                f"identical_to_{chosen[0]}": sum(a == b for a, b in zip(outs, reference)),
                "beam": beam, "alpha": args.alpha, "max_len": args.max_len,
                "max_len_a": args.max_len_a, "batch_size": args.batch_size,
                "inter_threads": results[0]["inter_threads"],
                "intra_threads": results[0]["intra_threads"],
                "shortlist": list(shortlist) if setting in SHORTLISTED else None,
                "checkpoint": checkpoint, "input": args.input, **env,
            })  # fmt: skip


def _worker_main(argv: list[str]) -> None:
    import argparse

    p = argparse.ArgumentParser()
    p.add_argument("--worker", action="store_true")
    for name in ("--setting", "--checkpoint", "--input", "--shortlist"):
        p.add_argument(name)
    for name in ("--beam", "--lines", "--batch-size", "--max-len", "--threads", "--inter-threads",
                 "--intra-threads", "--shortlist-k", "--shortlist-frequent"):  # fmt: skip
        p.add_argument(name, type=int)
    for name in ("--alpha", "--max-len-a"):
        p.add_argument(name, type=float)
    args = p.parse_args(argv)
    args.shortlist = args.shortlist or None
    print(json.dumps(worker(args)))


if __name__ == "__main__":
    _worker_main(sys.argv[1:])
