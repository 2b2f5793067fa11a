"""Sequence-level knowledge distillation (scripts/distillation.py): the distilled corpus pairs
each training source with the teacher's translation of it, the distilled student's corpora
(alone or beside the real pairs), the summary table, and the recipe end to end on tiny models."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from mt.config import load_config

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import distillation  # noqa: E402

TINY = [
    "data.max_train_pairs=300", "tokenizer.vocab_size=400", "tokenizer.threads=1",
    "model.N=1", "model.d_model=32", "model.d_ff=64", "model.h=2", "train.max_tokens=1000",
    "train.eval_every=0", "train.save_every=0", "train.eval_bleu=false", "train.threads=1",
    "train.log_every=10", "train.precision=fp32", "decode.max_len_b=8", "eval.report=false",
]  # fmt: skip


def test_the_distilled_corpus_pairs_line_k_with_line_k_and_leaves_out_empty_ones(tmp_path):
    sources = tmp_path / "source.de"
    sources.write_text("ein hund\nzwei katzen\ndrei\nvier männer\n", encoding="utf-8")
    hyps = tmp_path / "teacher.en"
    hyps.write_text("a dog\ntwo cats\n \nfour men\n", encoding="utf-8")  # line 3: empty
    decode = load_config(["experiment=multi30k_de_en"]).decode
    record = distillation.distilled_corpus(sources, hyps, tmp_path / "d/train", ("de", "en"),
                                           "t.pt", decode)  # fmt: skip
    de = (tmp_path / "d/train.de").read_text(encoding="utf-8").splitlines()
    en = (tmp_path / "d/train.en").read_text(encoding="utf-8").splitlines()
    assert list(zip(de, en)) == [("ein hund", "a dog"), ("zwei katzen", "two cats"),
                                 ("vier männer", "four men")]  # fmt: skip
    assert record["counts"] == {"sources": 4, "pairs": 3, "empty_translation": 1}
    assert json.loads((tmp_path / "d/train.json").read_text())["beam_size"] == 5
    hyps.write_text("a dog\ntwo cats\n")  # one translation per source line, or nothing
    with pytest.raises(SystemExit) as end:
        distillation.distilled_corpus(sources, hyps, tmp_path / "e/train", ("de", "en"),
                                      "t.pt", decode)  # fmt: skip
    message = str(end.value.code)
    assert str(hyps) in message and str(sources) in message and "2 lines for the 4" in message
    assert not (tmp_path / "e/train.de").exists()


def test_the_distilled_split_is_the_corpus_alone_or_beside_the_real_pairs_at_a_weight():
    split = distillation.train_split("train", Path("/w/distilled/train"), 0.0)
    assert split == "data.splits.train=['/w/distilled/train']"
    split = distillation.train_split(["train", {"name": "extra", "weight": 2.0}],
                                     Path("/w/distilled/train"), 0.5)  # fmt: skip
    assert split == ("data.splits.train=['/w/distilled/train',{name:'train',weight:0.5},"
                     "{name:'extra',weight:1}]")  # fmt: skip
    from mt.data.mixing import corpus_specs

    cfg = load_config(["experiment=smoke", split])
    assert [(s.name, s.weight) for s in corpus_specs(cfg.data.splits.train)] == [
        ("/w/distilled/train", 1.0), ("train", 0.5), ("extra", 1.0)]  # fmt: skip


def _fake_stages(monkeypatch, work: Path) -> list:
    """The recipe's commands recorded, not run: each writes what the real one would."""
    stages = []

    def fake_run(stage, overrides, log):
        stages.append((stage, overrides))
        values = dict(o.split("=", 1) for o in overrides)
        run_dir = Path(values.get("run_dir", work))
        if stage == "train":
            (run_dir / "checkpoints").mkdir(parents=True, exist_ok=True)
            (run_dir / "checkpoints/best.pt").write_bytes(b"x" * 2**20)
        if stage == "evaluate":
            bleu = {"teacher": 40.0, "student_real": 30.0, "student_distilled": 32.5}
            result = {"bleu": bleu[run_dir.name], "chrf": 50.0, "signature": "nrefs:1|tok:13a",
                      "chrf_signature": "nrefs:1|nc:6"}  # fmt: skip
            run_dir.mkdir(parents=True, exist_ok=True)
            (run_dir / "results.json").write_text(json.dumps(result))
        if stage == "translate":
            lines = Path(values["translate.input"]).read_text().splitlines()
            Path(values["translate.output"]).write_text("".join(f"T({x})\n" for x in lines))

    def fake_bench(checkpoints, test_src, decode, args, work, log):
        speed = {"teacher": 100.0, "student_real": 250.0, "student_distilled": 260.0}
        with open(work / "bench.jsonl", "w") as f:
            for c in checkpoints:
                f.write(json.dumps({"checkpoint": str(c), "sent_per_s": speed[c.parts[-3]],
                                    "impl": "mt default", "search": "beam 2", "alpha": 1.0,
                                    "batch_size": 32, "sentences": 1000, "seconds": [1, 2, 3],
                                    "device_name": "a CPU", "threads": 2}) + "\n")  # fmt: skip
        (work / "bench_load.json").write_text(json.dumps({"before": [1.5], "after": [2.5]}))

    monkeypatch.setattr(distillation, "run", fake_run)
    monkeypatch.setattr(distillation, "bench", fake_bench)
    monkeypatch.setattr(distillation, "parameters", lambda path: 1234)
    return stages


def test_both_students_learn_alike_and_the_table_has_each_model(monkeypatch, tmp_path, real_data):
    """The two students differ only in their training pairs: the same model, updates, no
    time cap, the teacher's tokenizer; the summary has a row for each model from its results
    and its decoding speed (the stages here are recorded, not run)."""
    stages = _fake_stages(monkeypatch, tmp_path)
    scores = distillation.main(["--workdir", str(tmp_path), "--steps", "77", "--jobs", "2",
                                "--real-weight", "0.5", "--set", "data.max_train_pairs=20",
                                f"data.dir={real_data / 'multi30k'}"])  # fmt: skip
    trains = {
        Path(v["run_dir"]).name: v
        for v in (dict(o.split("=", 1) for o in ov) for st, ov in stages if st == "train")
    }
    teacher = str(tmp_path / "teacher/checkpoints/best.pt")
    real, distilled = trains["student_real"], trains["student_distilled"]
    for run in (real, distilled):
        assert run["model"] == "student" and run["train.max_steps"] == "77"
        assert run["train.max_minutes"] == "0" and run["tokenizer.reuse"] == teacher
        assert run["train.threads"] == str(max(1, (__import__("os").cpu_count() or 1) // 2))
    assert set(real) ^ set(distilled) == {"data.splits.train"}
    assert distilled["data.splits.train"] == (
        f"['{tmp_path}/distilled/train',{{name:'train',weight:0.5}}]"
    )
    (translate,) = [dict(o.split("=", 1) for o in ov) for st, ov in stages if st == "translate"]
    assert translate["translate.checkpoint"] == teacher
    src = (tmp_path / "distilled/train.de").read_text().splitlines()
    real_src = (real_data / "multi30k/train.de").read_text().splitlines()[:20]
    assert src == real_src  # the training sources in order, data.max_train_pairs of them
    tgt = (tmp_path / "distilled/train.en").read_text().splitlines()
    assert tgt == [f"T({x})" for x in src]
    summary = (tmp_path / "summary.md").read_text()
    assert "| teacher | 40.00 | 50.00 | 1,234 | 1.0 | 100.0 | 1.00x |" in summary
    assert "| student, real targets | 30.00 | 50.00 | 1,234 | 1.0 | 250.0 | 2.50x |" in summary
    assert (
        "| student, distilled targets + real | 32.50 | 50.00 | 1,234 | 1.0 | 260.0 | 2.60x |"
        in summary
    )
    assert "+2.50 BLEU" in summary and "`nrefs:1|tok:13a`" in summary
    assert "load average 1.50 before, 2.50 after" in summary
    assert scores["distilled"]["bleu"] == 32.5 and scores["real"]["sent_per_s"] == 250.0
    # run again: every stage's output is there, so nothing is run again
    stages.clear()
    distillation.main(
        [
            "--workdir",
            str(tmp_path),
            "--steps",
            "77",
            "--set",
            "data.max_train_pairs=20",
            f"data.dir={real_data / 'multi30k'}",
        ]
    )
    assert stages == []


def _stage_in_this_process(stage: str, overrides: list[str], log) -> None:
    """A stage as ``python -m mt STAGE overrides...`` runs it, in this process (the recipe's
    commands are what the test checks, not interpreter start-ups)."""
    import mt.__main__

    log.write(f"$ mt {stage} {' '.join(overrides)}\n")
    argv = sys.argv
    sys.argv = ["python -m mt", stage, *overrides]
    try:
        mt.__main__.main()
    except SystemExit as end:
        assert not end.code, f"mt {stage} exited with {end.code}"
    finally:
        sys.argv = argv


@pytest.mark.slow
def test_the_recipe_end_to_end_on_a_tiny_teacher(monkeypatch, real_data, tmp_path):
    """A teacher trained here, its translations as the students' targets, three evaluations
    and the speed of each model (scripts/bench.py, 1 round)."""
    pytest.importorskip("ctranslate2")
    monkeypatch.setattr(distillation, "run", _stage_in_this_process)
    work = tmp_path / "work"
    scores = distillation.main([
        "--workdir", str(work), "--steps", "20", "--bench-rounds", "1", "--bench-lines", "30",
        "--set", f"cache_dir={tmp_path / 'cache'}", f"data.dir={real_data / 'multi30k'}", *TINY,
        "train.max_steps=40",  # the teacher's
    ])  # fmt: skip
    from mt.decode.translate import Translator

    decode = load_config(["experiment=smoke", *TINY]).decode  # the teacher's search
    teacher = Translator.from_checkpoint(work / "teacher/checkpoints/best.pt", "cpu", decode)
    src = (work / "distilled/train.de").read_text().splitlines()
    tgt = (work / "distilled/train.en").read_text().splitlines()
    record = json.loads((work / "distilled/train.json").read_text())
    assert len(src) == len(tgt) == record["counts"]["pairs"] > 250
    assert record["counts"]["sources"] == 300
    # line k of the target side is the teacher's translation of line k of the source side
    picked = [0, len(src) // 2, len(src) - 1]
    hyps = teacher.translate([src[k] for k in picked])  # torch's search; mt translate: CT2
    assert hyps == [tgt[k] for k in picked]
    summary = (work / "summary.md").read_text()
    for key in ("teacher", "real", "distilled"):
        assert scores[key]["sent_per_s"] > 0
        assert f"| {distillation.LABELS[key]} | {scores[key]['bleu']:.2f} |" in summary
    for d in ("student_real", "student_distilled"):  # --steps, not the teacher's 40
        assert "training stopped at step 20: " in (work / d / "train.log").read_text()
