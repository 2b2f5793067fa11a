"""Sequence-level knowledge distillation end to end, one command: teacher -> distilled corpus ->
students -> a summary table.

The recipe of Kim & Rush (2016), as the mt commands it runs (each printed before it runs, so any
step can be repeated by hand):

1. the teacher: ``--teacher CHECKPOINT``, or trained here with the preset's experiment
   (``mt prepare``, ``mt train``, ``mt evaluate``);
2. ``mt translate``: the teacher translates the training sources with the experiment's beam
   search (``decode.*``; CTranslate2, mt-translate's default engine, where it is installed).
   ``distilled/train.<src>`` and ``distilled/train.<tgt>`` pair each source with the teacher's
   translation of it, line for line; a pair whose translation is empty is left out
   (``distilled/train.json`` counts them);
3. the student (``model=student``, conf/model/student.yaml) on the distilled pairs (with
   ``--real-weight W`` beside the real pairs at weight W), and the same student on the real
   pairs alone: both ``--steps`` updates with no time cap (so the machine's load does not change
   what they learn), both on the teacher's SentencePiece model (``tokenizer.reuse``);
   ``--jobs 2`` trains them side by side, each on half the cores;
4. ``mt evaluate`` of each model on the test split, and ``scripts/bench.py translate``: each
   model's CPU decoding speed (mt-translate's default engine, the experiment's beam), the
   models taking turns within each round.

``summary.md`` in the work directory: test BLEU and chrF with their sacreBLEU signatures,
parameters, checkpoint size and decoding speed (sentences/s, with the load average) of the
teacher and both students. A stage whose output exists (the translations, a run's
``results.json``, ``bench.jsonl``) is kept, so the command resumes after an interruption.

Presets: ``smoke`` (default: a tiny teacher trained here on a slice of Multi30k, students of its
size with one decoder layer: minutes on 2 cores) and ``multi30k`` (students of the Multi30k
15-minute recipe; give its teacher with ``--teacher``, or it is trained first). Any other
setting goes to every stage with ``--set``.

    python scripts/distillation.py                      # make distillation
    python scripts/distillation.py --preset multi30k --teacher runs/m30k/checkpoints/best.pt \\
        --steps 2400 --jobs 2 --workdir runs/distill --set train.precision=bf16
"""

from __future__ import annotations

import argparse
import concurrent.futures
import itertools
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PRESETS = {
    "smoke": {"experiment": "smoke", "steps": 200},
    "multi30k": {"experiment": "multi30k_de_en_15min", "steps": 2400},
}
LABELS = {"teacher": "teacher", "real": "student, real targets",
          "distilled": "student, distilled targets"}  # fmt: skip


def quoted(value: str) -> str:
    """A string as a Hydra override value."""
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


def show(cmd: list[str], log) -> str:
    shown = " ".join(shlex.quote(c) for c in cmd)
    print(f"\n$ {shown}", flush=True)
    log.write(f"$ {shown}\n")
    log.flush()
    return shown


def run(stage: str, overrides: list[str], log) -> None:
    shown = show(["mt", stage, *overrides], log)
    if subprocess.run([sys.executable, "-m", "mt", stage, *overrides]).returncode != 0:
        sys.exit(f"distillation: `{shown}` failed")


def pipeline(run_dir: Path, overrides: list[str], log, stages=("prepare", "train", "evaluate")):
    """prepare -> train -> evaluate, as ``make train`` runs them; kept if already evaluated."""
    if (run_dir / "results.json").is_file():
        print(f"\ndistillation: kept {run_dir} (it has results.json)", flush=True)
        return
    for stage in stages:
        run(stage, [*overrides, f"run_dir={run_dir}"], log)


def write_sources(data, path: Path) -> int:
    """The source side of the training split, as the data stage reads it (each corpus of the
    split in turn, at most ``data.max_train_pairs`` pairs of each), one line each."""
    from mt.data.corpus import open_corpus
    from mt.files import atomic_text_output

    corpus, limit, n = open_corpus(data), data.max_train_pairs or None, 0
    with atomic_text_output(path) as f:
        for part in range(corpus.num_parts("train")):
            for src, _ in itertools.islice(corpus.part_pairs("train", part), limit):
                f.write(src + "\n")
                n += 1
    return n


def distilled_corpus(sources: Path, translations: Path, prefix: Path, langs: tuple[str, str],
                     teacher: str, decode) -> dict:  # fmt: skip
    """``<prefix>.<src>`` and ``<prefix>.<tgt>``: source line k beside translation line k; a
    pair whose translation is empty is left out. Also ``<prefix>.json``: what was made, how.

    Raises:
        SystemExit: the two files differ in line count (one line naming both).
    """
    from mt.data.corpus import count_lines, read_lines
    from mt.files import atomic_text_output, write_json

    n, m = count_lines(sources), count_lines(translations)
    if n != m:
        sys.exit(f"distillation: {translations} has {m:,} lines for the {n:,} of {sources}: "
                 "the teacher's translations must be one per source line")  # fmt: skip
    counts = {"sources": n, "pairs": 0, "empty_translation": 0}
    src_path, tgt_path = (Path(f"{prefix}.{lang}") for lang in langs)
    with atomic_text_output(src_path) as fs, atomic_text_output(tgt_path) as ft:
        for src, hyp in zip(read_lines(sources), read_lines(translations)):
            if not hyp.strip():
                counts["empty_translation"] += 1
                continue
            fs.write(src + "\n")
            ft.write(hyp + "\n")
            counts["pairs"] += 1
    record = {"corpus": str(prefix), "source": str(src_path), "target": str(tgt_path),
              "teacher": teacher, "beam_size": decode.beam_size, "alpha": decode.alpha,
              "counts": counts}  # fmt: skip
    write_json(f"{prefix}.json", record)
    return record


def train_split(real, distilled: Path, real_weight: float) -> str:
    """``data.splits.train`` of the distilled student: the distilled corpus, and with
    ``real_weight`` > 0 each real corpus beside it at its weight times ``real_weight``."""
    from mt.data.mixing import corpus_specs

    parts = [quoted(str(distilled))]
    if real_weight > 0:
        parts += [f"{{name:{quoted(s.name)},weight:{s.weight * real_weight:g}}}"
                  for s in corpus_specs(real)]  # fmt: skip
    return "data.splits.train=[" + ",".join(parts) + "]"


def distill(common: list[str], data, teacher: Path, work: Path, log) -> dict:
    """Stage 2: the teacher's translations of the training sources, and the distilled corpus."""
    from mt.config import load_config

    out = work / "distilled"
    sources, translations = out / f"source.{data.src_lang}", out / f"teacher.{data.tgt_lang}"
    if not translations.is_file():
        write_sources(data, sources)
        run("translate", [*common, f"translate.checkpoint={teacher}",
                          f"translate.input={sources}", f"translate.output={translations}",
                          "decode.too_long=truncate"], log)  # fmt: skip
    prefix = out / "train"
    if Path(f"{prefix}.json").is_file():
        return json.loads(Path(f"{prefix}.json").read_text())
    decode = load_config(common).decode
    record = distilled_corpus(sources, translations, prefix, (data.src_lang, data.tgt_lang),
                              str(teacher), decode)  # fmt: skip
    c = record["counts"]
    print(f"\ndistillation: {prefix}: {c['pairs']:,} pairs of {c['sources']:,} sources "
          f"({c['empty_translation']:,} empty translations left out)", flush=True)  # fmt: skip
    return record


def bench(checkpoints: list[Path], test_src: Path, decode, args, work: Path, log) -> None:
    """Stage 4: scripts/bench.py translate over the models, alternating (``bench.jsonl``), and
    the load average before and after (``bench_load.json``)."""
    out = work / "bench.jsonl"
    if out.is_file():
        print(f"\ndistillation: kept {out}", flush=True)
        return
    load, partial = {"before": list(os.getloadavg())}, work / "bench.partial.jsonl"
    cmd = [sys.executable, str(ROOT / "scripts/bench.py"), "translate",
           "--checkpoint", *map(str, checkpoints), "--input", str(test_src),
           "--settings", "mt:default", "--beams", str(decode.beam_size),
           "--alpha", str(decode.alpha), "--max-len-a", str(decode.max_len_a),
           "--max-len", str(decode.max_len_b), "--rounds", str(args.bench_rounds),
           "--lines", str(args.bench_lines), "--threads", str(os.cpu_count() or 1),
           "--workdir", str(work / "bench"), "--output", str(partial)]  # fmt: skip
    shown = show(["python", *cmd[1:]], log)
    partial.unlink(missing_ok=True)
    if subprocess.run(cmd).returncode != 0:
        sys.exit(f"distillation: `{shown}` failed")
    load["after"] = list(os.getloadavg())
    (work / "bench_load.json").write_text(json.dumps(load) + "\n")
    os.replace(partial, out)


def cpu_name() -> str:
    """The CPU as /proc/cpuinfo names it (model name, family, model), else the platform's."""
    import platform

    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    info = dict(line.split(":", 1) for line in text.split("\n\n")[0].splitlines() if ":" in line)
    info = {k.strip(): v.strip() for k, v in info.items()}
    return (f"{info.get('model name', platform.machine())} (family {info.get('cpu family', '?')}"
            f", model {info.get('model', '?')})")  # fmt: skip


def parameters(checkpoint: Path) -> int:
    """The model's parameters (a tied embedding counted once)."""
    from mt.checkpoint import load_model

    model, _, _ = load_model(checkpoint)
    return sum(p.numel() for p in model.parameters())


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="smoke")
    ap.add_argument("--experiment", help="the teacher's and students' experiment (default: the "
                    "preset's)")  # fmt: skip
    ap.add_argument("--teacher", help="the teacher's checkpoint (default: train one here)")
    ap.add_argument("--workdir", default="runs/distillation")
    ap.add_argument("--steps", type=int, help="train.max_steps of both students (--set "
                    "train.max_steps=N: the teacher's, when it is trained here)")
    ap.add_argument(
        "--real-weight",
        type=float,
        default=0.0,
        help="train the distilled student "
        "on the real pairs too, at this weight (0: the distilled pairs alone)",
    )
    ap.add_argument(
        "--jobs",
        type=int,
        choices=(1, 2),
        default=1,
        help="2: the students train side by side, each on half the cores",
    )
    ap.add_argument("--bench-rounds", type=int, default=3)
    ap.add_argument("--bench-lines", type=int, default=1000, help="test sentences decoded")
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                    help="overrides for every stage, e.g. train.precision=bf16")  # fmt: skip
    args = ap.parse_args(argv)
    if args.real_weight < 0:
        ap.error("--real-weight must be >= 0")

    from mt.config import load_config

    preset = PRESETS[args.preset]
    experiment = args.experiment or preset["experiment"]
    steps = args.steps or preset["steps"]
    common = [f"experiment={experiment}", *args.set]
    cfg = load_config(common)
    data = cfg.data
    work = Path(args.workdir).resolve()
    work.mkdir(parents=True, exist_ok=True)
    dirs = {k: work / ("teacher" if k == "teacher" else f"student_{k}") for k in LABELS}
    with open(work / "commands.txt", "a", encoding="utf-8") as log:
        # 1. the teacher
        if args.teacher:
            teacher = Path(args.teacher).resolve()
            if not teacher.is_file():
                sys.exit(f"distillation: --teacher {teacher}: no such file")
            teacher_runs = [f"tokenizer.reuse={teacher}", f"eval.checkpoint={teacher}"]
            pipeline(dirs["teacher"], [*common, *teacher_runs], log, ("evaluate",))
        else:
            teacher = dirs["teacher"] / "checkpoints/best.pt"
            pipeline(dirs["teacher"], common, log)
        # 2. and 3.: the distilled corpus, the two students
        threads = [f"train.threads={max(1, (os.cpu_count() or 1) // args.jobs)}"]
        # the budget after --set: a train.max_steps there is the teacher's (trained here)
        student = [f"experiment={experiment}", "model=student", f"tokenizer.reuse={teacher}",
                   *(threads if args.jobs > 1 else []), *args.set, "train.max_minutes=0",
                   f"train.max_steps={steps}"]  # fmt: skip
        record = {}

        def on_distilled() -> None:
            record.update(distill(common, data, teacher, work, log))
            split = train_split(data.splits.train, work / "distilled/train", args.real_weight)
            pipeline(dirs["distilled"], [*student, split], log)

        def on_real() -> None:
            pipeline(dirs["real"], student, log)

        if args.jobs > 1:
            with concurrent.futures.ThreadPoolExecutor(2) as pool:
                for job in [pool.submit(on_real), pool.submit(on_distilled)]:
                    job.result()
        else:
            on_distilled()
            on_real()
        # 4. the speed of each
        test_src = work / f"test.{data.src_lang}"
        if not test_src.is_file():
            from mt.data.corpus import open_corpus
            from mt.files import write_lines

            write_lines(test_src, (s for s, _ in open_corpus(data).pairs("test")))
        checkpoints = {"teacher": teacher, **{k: dirs[k] / "checkpoints/best.pt"
                                              for k in ("real", "distilled")}}  # fmt: skip
        bench(list(checkpoints.values()), test_src, cfg.decode, args, work, log)
    return summarize(work, dirs, checkpoints, record, args, steps, experiment)


def speeds(work: Path) -> dict[str, dict]:
    """bench.jsonl's decoding records by checkpoint."""
    records = [json.loads(x) for x in (work / "bench.jsonl").read_text().splitlines() if x]
    return {r["checkpoint"]: r for r in records if "sent_per_s" in r}


def summarize(work: Path, dirs: dict, checkpoints: dict, record: dict, args, steps: int,
              experiment: str) -> dict:  # fmt: skip
    """summary.md: each model's test scores, size and decoding speed (see the docstring)."""
    fast = speeds(work)
    load = json.loads((work / "bench_load.json").read_text())
    base = fast[str(checkpoints["teacher"])]["sent_per_s"]
    rows, results, scores = [], {}, {}
    for key, label in LABELS.items():
        label += " + real" if key == "distilled" and args.real_weight else ""
        result = json.loads((dirs[key] / "results.json").read_text())
        results[key] = result
        ckpt = checkpoints[key]
        speed = fast[str(ckpt)]["sent_per_s"]
        scores[key] = {"bleu": result["bleu"], "chrf": result.get("chrf"), "sent_per_s": speed}
        rows.append(f"| {label} | {result['bleu']:.2f} | {result.get('chrf', float('nan')):.2f} "
                    f"| {parameters(ckpt):,} | {ckpt.stat().st_size / 2**20:.1f} | {speed:.1f} "
                    f"| {speed / base:.2f}x |")  # fmt: skip
    one = fast[str(checkpoints["teacher"])]
    c = record.get("counts") or json.loads((work / "distilled/train.json").read_text())["counts"]
    mix = f" beside the real pairs at weight {args.real_weight:g}" if args.real_weight else ""
    gain = scores["distilled"]["bleu"] - scores["real"]["bleu"]
    text = "\n".join([
        "# Sequence-level knowledge distillation", "",
        f"Experiment `{experiment}`; teacher {checkpoints['teacher']}. Distilled corpus: "
        f"{c['pairs']:,} pairs, the teacher's beam-search translations of {c['sources']:,} "
        f"training sources ({c['empty_translation']:,} empty left out){mix}. Both students: "
        f"`model=student`, {steps:,} updates, no time cap.", "",
        "| model | test BLEU | chrF | parameters | size (MB) | sent/s (CPU) | speed |",
        "|---|---|---|---|---|---|---|", *rows, "",
        f"Distilled student - real-data student: {gain:+.2f} BLEU.", "",
        f"BLEU: `{results['teacher']['signature']}`; "
        f"chrF: `{results['teacher'].get('chrf_signature', '')}`.", "",
        f"Speed: `scripts/bench.py translate` ({one['impl']}, {one['search']}, alpha "
        f"{one['alpha']:g}, batches of {one['batch_size']}, {one['sentences']} test sentences, "
        f"median of {len(one['seconds'])} rounds, the models alternating) on {cpu_name()}"
        f" with {one['threads']} threads; load average {load['before'][0]:.2f} before, "
        f"{load['after'][0]:.2f} after.", "",
    ])  # fmt: skip
    (work / "summary.md").write_text(text, encoding="utf-8")
    print("\n" + text)
    return scores


if __name__ == "__main__":
    main()
