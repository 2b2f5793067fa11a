"""Back-translation: Edunov et al.'s noise, the language check of the monolingual input, the
synthetic corpus (aligned, tagged, independent of batching), and the whole recipe end to end on
tiny models (scripts/backtranslation.py)."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from mt.config import load_config
from mt.data.corpus import DataError
from mt.data.tokenizer import Tokenizer
from mt.decode.backtranslate import add_noise, backtranslate

ROOT = Path(__file__).resolve().parents[1]

TINY = [
    "data.max_train_pairs=1500", "tokenizer.vocab_size=600", "tokenizer.threads=1",
    "model.N=1", "model.d_model=32", "model.d_ff=64", "model.h=2", "train.max_steps=30",
    "train.max_tokens=1000", "train.eval_every=0", "train.save_every=0",
    "train.eval_bleu=false", "train.threads=1", "train.log_every=10",
]  # fmt: skip


def test_noise_moves_no_word_three_places_and_drops_and_blanks_at_their_rates():
    words = [f"w{i}" for i in range(4000)]
    for seed in range(5):
        out = add_noise(words, np.random.default_rng(seed), drop=0.0, blank=0.0, shuffle=3.0)
        assert sorted(out) == sorted(words) and out != words
        assert max(abs(out.index(w) - i) for i, w in enumerate(words[:500])) < 3
    out = add_noise(words, np.random.default_rng(0), drop=0.1, blank=0.1, filler="_")
    kept = len(out) / len(words)
    blanks = out.count("_") / len(out)
    assert 0.88 < kept < 0.92 and 0.08 < blanks < 0.12  # 4,000 draws: within ~3 sigma
    assert len(add_noise(["a", "b"], np.random.default_rng(0), drop=1.0)) == 1  # never empty
    assert add_noise([], np.random.default_rng(0)) == []


def _cfg(real_data, tmp_path, *extra):
    return load_config(
        ["experiment=smoke", f"data.dir={real_data / 'multi30k'}", *TINY,
         f"cache_dir={tmp_path / 'cache'}", *extra],
        command="backtranslate",
    )  # fmt: skip


def test_input_in_the_source_language_is_refused_naming_the_file(real_data, tmp_path):
    news = real_data / "wmt_newstest_de-en"
    german = tmp_path / "mono.txt"
    german.write_bytes((news / "newstest2018.de").read_bytes()[:50_000])
    for path, said in [(news / "newstest2018.de", "named as the source language (de)"),
                       (german, "reads as de, the source language")]:  # fmt: skip
        cfg = _cfg(real_data, tmp_path, f"input={path}", "checkpoint=x.pt", "output=o")
        with pytest.raises(DataError) as err:
            backtranslate(cfg)
        message = str(err.value)
        assert str(path) in message and said in message and "target language (en" in message
    proc = subprocess.run(
        [sys.executable, "-m", "mt", "backtranslate", "experiment=smoke",
         f"data.dir={real_data / 'multi30k'}", f"input={german}", "checkpoint=x.pt",
         f"output={tmp_path / 'o'}"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    errors = [x for x in proc.stderr.splitlines() if x.strip()]
    assert proc.returncode == 1 and len(errors) == 1 and "reads as de" in errors[0], proc.stderr


def _stage_in_this_process(stage: str, overrides: list[str], log) -> None:
    """A stage of the recipe as ``python -m mt STAGE overrides...`` runs it (the same entry
    point, the same command line), in this process: the recipe's seven commands are what the
    test checks, not seven interpreter start-ups."""
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


@pytest.fixture(scope="module")
def recipe(real_data, tmp_path_factory):
    """scripts/backtranslation.py on tiny models: reverse, synthetic corpus, forward."""
    import backtranslation

    patch = pytest.MonkeyPatch()
    patch.setattr(backtranslation, "run", _stage_in_this_process)
    work = tmp_path_factory.mktemp("bt")
    mono = work / "mono.en"
    lines = (real_data / "wmt_newstest_de-en/newstest2018.en").read_text().splitlines()[:150]
    mono.write_text("\n".join(lines[:70] + [""] + lines[70:]) + "\n")  # an empty line: skipped
    quick = ["decode.max_len_b=8", "eval.report=false"]  # (the baseline: a test of its own)
    scores = backtranslation.main([
        "--preset", "smoke", "--workdir", str(work), "--mono", str(mono), "--weight", "2",
        "--set", f"cache_dir={work / 'cache'}", *TINY, *quick,
    ])  # fmt: skip
    patch.undo()
    return work, scores, lines


@pytest.mark.slow
def test_the_recipe_trains_on_real_and_tagged_synthetic_pairs(recipe):
    work, scores, lines = recipe
    synthetic = work / "synthetic"
    record = json.loads((synthetic / "bt.json").read_text())
    src = (synthetic / "bt.de").read_text().splitlines()
    tgt = (synthetic / "bt.en").read_text().splitlines()
    assert record["counts"]["read"] == 150 and len(src) == len(tgt) == record["counts"]["pairs"]
    assert record["counts"]["pairs"] + record["counts"]["empty_translation"] == 150
    assert set(tgt) <= set(lines) and all(s.startswith("<BT> ") for s in src)
    assert record["method"].startswith("sampling")
    # the forward run: the tag is one piece, both corpora in each epoch (the synthetic twice)
    metas = {p.parent: json.loads(p.read_text()) for p in (work / "cache").glob("*/meta.json")}
    (prepared,) = [d for d, m in metas.items() if m["tokenizer"]["user_symbols"] == ["<BT>"]]
    real, bt = [c["pairs"] for c in metas[prepared]["counts"]["train"]["corpora"]]
    assert 0 < bt <= len(src) and 1400 < real <= 1500  # as cleaned (a 30-update model babbles)
    log = (work / "forward/train.log").read_text()
    assert f"pairs by corpus: train {real:,} (" in log and f"bt {2 * bt:,} (" in log
    tok = Tokenizer.load([prepared / "spm.model"])
    assert "<BT>" in tok.pieces("<BT> Ein Hund")
    summary = (work / "summary.md").read_text()
    for label in ("reverse", "forward (real + back-translated)"):
        assert f"| {label} | {scores[label]:.2f} |" in summary
    assert "nrefs:1|case:mixed" in summary
    commands = (work / "commands.txt").read_text()
    assert "mt backtranslate" in commands and "weight:2.0}]" in commands


@pytest.mark.slow
def test_sampled_synthetic_sources_do_not_depend_on_batching(recipe, real_data, tmp_path):
    work, _, _ = recipe
    outs = []
    for size in (7, 64):
        cfg = _cfg(real_data, tmp_path, "decode=sample", f"decode.batch_size={size}",
                   f"checkpoint={work / 'reverse/checkpoints/best.pt'}",
                   f"input={work / 'mono.en'}", f"output={tmp_path / str(size)}")  # fmt: skip
        cfg = dataclasses.replace(cfg, backtranslate=dataclasses.replace(cfg.backtranslate,
                                                                         max_lines=40))
        backtranslate(cfg)
        outs.append((tmp_path / str(size) / "bt.de").read_text())
    assert outs[0] == outs[1] and len(outs[0].splitlines()) > 30


def test_each_stage_runs_as_the_command_it_prints_and_a_failure_ends_the_recipe(tmp_path):
    """The recipe's stages are `python -m mt` commands, each printed and logged before it runs
    (the test of the whole recipe runs them in its own process)."""
    import backtranslation

    with open(tmp_path / "commands.txt", "w") as log:
        with pytest.raises(SystemExit) as end:
            backtranslation.run("prepare", ["train.no_such_key=1"], log)
    assert "`mt prepare train.no_such_key=1` failed" in str(end.value.code)
    assert (tmp_path / "commands.txt").read_text() == "$ mt prepare train.no_such_key=1\n"


def test_the_baseline_is_the_forward_run_without_the_synthetic_corpus(monkeypatch, tmp_path):
    """--baseline: a fourth run with the same settings and the real corpus only; the summary
    has a row for each run (the stages here are recorded, not run)."""
    import backtranslation

    stages = []

    def fake_run(stage, overrides, log):
        stages.append((stage, overrides))
        values = dict(o.split("=", 1) for o in overrides)
        if stage == "evaluate":
            result = {"bleu": float(len(stages)), "chrf": 1.0, "signature": "nrefs:1|case:mixed"}
            (Path(values["run_dir"]) / "results.json").write_text(json.dumps(result))
        if stage == "backtranslate":
            out = Path(values["backtranslate.output"])
            out.mkdir(parents=True)
            record = {"counts": {"pairs": 5, "read": 6}, "method": "sampling", "tag": "<BT>",
                      "reverse_checkpoint": values["backtranslate.checkpoint"]}  # fmt: skip
            (out / "bt.json").write_text(json.dumps(record))
        if stage == "prepare":
            Path(values["run_dir"]).mkdir(parents=True, exist_ok=True)

    monkeypatch.setattr(backtranslation, "run", fake_run)
    scores = backtranslation.main(["--workdir", str(tmp_path), "--mono", "m.en", "--baseline"])
    runs = [dict(o.split("=", 1) for o in ov) for st, ov in stages if st == "train"]
    assert [Path(r["run_dir"]).name for r in runs] == ["reverse", "forward", "baseline"]
    forward, baseline = runs[1], runs[2]
    assert "synthetic/bt" in forward["data.splits.train"] and "tokenizer.user_symbols" in forward
    assert "data.splits.train" not in baseline and "tokenizer.user_symbols" not in baseline
    assert baseline["experiment"] == forward["experiment"] == "smoke"
    assert "data.src_lang" not in baseline
    summary = (tmp_path / "summary.md").read_text()
    for label in ("reverse", "forward (real + back-translated)", "baseline (real only)"):
        assert f"| {label} | {scores[label]:.2f} |" in summary
