"""Back-translation end to end, one command: reverse model -> synthetic corpus -> forward model.

The recipe of Sennrich et al. (2016) and Edunov et al. (2018), as the mt commands it runs (each
printed before it runs, so any step can be repeated by hand):

1. train the reverse model, target -> source, on the real pairs (the forward experiment with
   its languages swapped): ``mt prepare``, ``mt train``, ``mt evaluate``;
2. ``mt backtranslate``: the reverse model translates monolingual target-side text (by default
   the English, or German, side of the WMT news sets in $MT_DATA_DIR/wmt_newstest_de-en) by
   sampling (``--method sample``) or beam search plus noise (``--method beam-noise``), each
   synthetic source tagged ``<BT>`` unless ``--no-tag``;
3. train the forward model on the real pairs plus the synthetic ones at ``--weight``
   (``data.splits.train=[<real>,{name:<synthetic>,weight:W}]``, the tag one SentencePiece piece);
4. with ``--baseline``, the forward model again without the synthetic pairs, for comparison.

``summary.md`` in the work directory lists each run's test BLEU with its sacreBLEU signature.

Presets: ``smoke`` (default: tiny models on a slice of Multi30k and 2,000 news lines, a few
minutes on 2 cores) and ``small`` (the Multi30k 15-minute recipe in both directions, all the
news sets: about an hour on 2 cores). Any other setting goes to every stage with ``--set``.

    python scripts/backtranslation.py                     # make backtranslation
    python scripts/backtranslation.py --preset small --baseline --workdir runs/bt-small
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

PRESETS = {
    "smoke": {"experiment": "smoke", "mono_lines": 2000, "stage": []},
    "small": {"experiment": "multi30k_de_en_15min", "mono_lines": 0, "stage": []},
}


def default_mono(lang: str) -> list[str]:
    """The ``lang`` side of the WMT news sets in $MT_DATA_DIR (shared/data's layout)."""
    root = Path(os.environ.get("MT_DATA_DIR", "data")) / "wmt_newstest_de-en"
    files = sorted(str(p) for p in root.glob(f"newstest*.{lang}"))
    if not files:
        sys.exit(f"backtranslation: no monolingual text: no {root}/newstest*.{lang} "
                 "(set MT_DATA_DIR, or give --mono FILE ...)")  # fmt: skip
    return files


def quoted(value: str) -> str:
    """A string as a Hydra override value (``<BT>`` needs quotes)."""
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


def run(stage: str, overrides: list[str], log) -> None:
    cmd = [sys.executable, "-m", "mt", stage, *overrides]
    shown = "mt " + stage + " " + " ".join(shlex.quote(o) for o in overrides)
    print(f"\n$ {shown}", flush=True)
    log.write(f"$ {shown}\n")
    log.flush()
    if subprocess.run(cmd).returncode != 0:
        sys.exit(f"backtranslation: `{shown}` failed")


def pipeline(name: str, overrides: list[str], log) -> None:
    """prepare -> train -> evaluate, as ``make train`` runs them."""
    for stage in ("prepare", "train", "evaluate"):
        run(stage, overrides, log)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="smoke")
    ap.add_argument("--experiment", help="the forward experiment (default: the preset's)")
    ap.add_argument("--workdir", default="runs/backtranslation")
    ap.add_argument("--mono", nargs="+", help="monolingual target-side files (default: news)")
    ap.add_argument("--mono-lines", type=int, help="back-translate at most this many lines")
    ap.add_argument("--method", choices=["sample", "beam-noise"], default="sample")
    ap.add_argument("--weight", type=float, default=1.0, help="the synthetic corpus's weight")
    ap.add_argument("--tag", default="<BT>")
    ap.add_argument("--no-tag", action="store_true", help="untagged back-translation")
    ap.add_argument("--baseline", action="store_true", help="also train without synthetic data")
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                    help="overrides for every stage, e.g. train.max_steps=50")  # fmt: skip
    args = ap.parse_args(argv)

    from mt.config import load_config

    preset = PRESETS[args.preset]
    experiment = args.experiment or preset["experiment"]
    common = [f"experiment={experiment}", *preset["stage"], *args.set]
    data = load_config(common).data
    src, tgt = data.src_lang, data.tgt_lang
    work = Path(args.workdir).resolve()
    work.mkdir(parents=True, exist_ok=True)
    mono = args.mono or default_mono(tgt)
    lines = preset["mono_lines"] if args.mono_lines is None else args.mono_lines
    tag = None if args.no_tag else args.tag
    runs = {}
    with open(work / "commands.txt", "a", encoding="utf-8") as log:
        # 1. the reverse model: the same experiment, target -> source
        reverse = [*common, f"data.src_lang={tgt}", f"data.tgt_lang={src}",
                   f"name={experiment}_reverse", f"run_dir={work / 'reverse'}"]  # fmt: skip
        pipeline("reverse", reverse, log)
        runs["reverse"] = work / "reverse"
        # 2. the synthetic corpus
        method = ["decode=sample"] if args.method == "sample" else ["backtranslate.noise=true"]
        synthetic = work / "synthetic"
        run("backtranslate", [
            *common, *method, f"run_dir={work / 'forward'}",
            f"backtranslate.checkpoint={work / 'reverse/checkpoints/best.pt'}",
            "backtranslate.input=[" + ",".join(quoted(m) for m in mono) + "]",
            f"backtranslate.output={synthetic}", f"backtranslate.max_lines={lines}",
            *([f"backtranslate.tag={quoted(tag)}"] if tag else []),
        ], log)  # fmt: skip
        # 3. the forward model on real + synthetic pairs
        real = data.splits.train if isinstance(data.splits.train, list) else [data.splits.train]
        mix = [quoted(r) if isinstance(r, str) else r for r in real]
        mix.append(f"{{name:{quoted(str(synthetic / 'bt'))},weight:{args.weight}}}")
        forward = [*common, f"run_dir={work / 'forward'}", f"name={experiment}_bt",
                   "data.splits.train=[" + ",".join(map(str, mix)) + "]"]  # fmt: skip
        if tag:
            forward.append(f"tokenizer.user_symbols=[{quoted(tag)}]")
        pipeline("forward", forward, log)
        runs["forward (real + back-translated)"] = work / "forward"
        if args.baseline:
            pipeline("baseline", [*common, f"run_dir={work / 'baseline'}"], log)
            runs["baseline (real only)"] = work / "baseline"
    return summarize(work, runs, json.loads((synthetic / "bt.json").read_text()), args)


def summarize(work: Path, runs: dict, synthetic: dict, args) -> dict:
    """summary.md: each run's test scores with their signatures, and the synthetic corpus."""
    rows, scores = [], {}
    for label, run_dir in runs.items():
        result = json.loads((run_dir / "results.json").read_text())
        scores[label] = result["bleu"]
        rows.append(f"| {label} | {result['bleu']:.2f} | {result.get('chrf', float('nan')):.2f} "
                    f"| `{result['signature']}` |")  # fmt: skip
    c = synthetic["counts"]
    text = "\n".join([
        "# Back-translation", "",
        f"Synthetic corpus: {c['pairs']:,} pairs from {c['read']:,} monolingual lines "
        f"({synthetic['method']}; tag {synthetic['tag'] or 'none'}), weight {args.weight:g} "
        f"beside the real pairs. Reverse model: {synthetic['reverse_checkpoint']}.", "",
        "| run | test BLEU | chrF | BLEU signature |", "|---|---|---|---|", *rows, "",
    ])  # fmt: skip
    (work / "summary.md").write_text(text, encoding="utf-8")
    print("\n" + text)
    return scores


if __name__ == "__main__":
    main()
