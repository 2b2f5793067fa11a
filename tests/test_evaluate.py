"""sacreBLEU scoring: published WMT17 scores reproduced, and mt-evaluate hyp= ref= end to end."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mt.evaluation.evaluate import evaluate_main, read_lines
from mt.evaluation.metrics import score
from mt.schema import Config, EvalConfig, ModelConfig

ROOT = Path(__file__).resolve().parents[1]

# The sacreBLEU README's published BLEU (13a) and chrF2 for WMT17 en-de newstest2017 systems.
PUBLISHED = {
    "online-A.0": (20.8, 52.0),
    "online-B.0": (26.7, 56.3),
    "online-F.0": (15.5, 49.3),
    "online-G.0": (18.2, 51.6),
    "LIUM-NMT.4900": (26.6, 55.9),
}


def wmt17(real_data: Path) -> Path:
    folder = real_data / "wmt17_ende_systems"
    if not folder.is_dir():
        pytest.skip("wmt17_ende_systems not in MT_DATA_DIR")
    return folder


@pytest.mark.parametrize("system", sorted(PUBLISHED))
def test_score_reproduces_published_wmt17_numbers(real_data, system):
    folder = wmt17(real_data)
    hyps = read_lines(folder / "systems" / f"newstest2017.{system}.en-de")
    refs = read_lines(folder / "newstest2017.de")
    assert len(hyps) == len(refs) == 3004
    with_chrf = system in ("online-A.0", "LIUM-NMT.4900")  # chrF is slow: two systems suffice
    result = score(hyps, refs, metrics=["bleu", "chrf"] if with_chrf else ["bleu"])
    bleu, chrf = PUBLISHED[system]
    assert round(result["bleu"], 1) == bleu
    assert result["signature"].startswith("nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|version:")
    if with_chrf:
        assert round(result["chrf"], 1) == chrf
        assert result["chrf_signature"].startswith("nrefs:1|case:mixed|eff:yes|nc:6|nw:0|space:no")
    else:
        assert result["chrf"] is None


def test_bom_is_kept_as_in_the_published_score(real_data):
    """online-A line 1 starts with U+FEFF; the published 20.8 includes it (read as sacreBLEU)."""
    folder = wmt17(real_data)
    hyps = read_lines(folder / "systems" / "newstest2017.online-A.0.en-de")
    assert hyps[0].startswith("\ufeff")


def test_cli_scores_files_and_writes_json(real_data, tmp_path):
    folder = wmt17(real_data)
    out = tmp_path / "scores.json"
    hyp = folder / "systems" / "newstest2017.online-B.0.en-de"
    ref = folder / "newstest2017.de"
    code = "from mt.cli import evaluate_main as m; m()"
    proc = subprocess.run(
        [sys.executable, "-c", code, f"hyp={hyp}", f"ref={ref}", f"output={out}"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=dict(os.environ),
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "BLEU = 26.65" in proc.stdout  # sacreBLEU's own verbose line (SOURCE.md: 26.65)
    assert "nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp" in proc.stdout
    assert "chrF2 = 56.26" in proc.stdout
    data = json.loads(out.read_text())
    assert isinstance(data["bleu"], float) and round(data["bleu"], 1) == 26.7
    assert round(data["chrf"], 1) == 56.3
    assert {"signature", "chrf_signature", "n_sentences"} <= set(data)


def test_several_references_as_a_list(real_data, tmp_path, capsys):
    """ref=[A,B]: a second reference can only add matches; the same one twice changes nothing."""
    folder = wmt17(real_data)
    n = 300
    hyps = read_lines(folder / "systems" / "newstest2017.online-F.0.en-de")[:n]
    refs = read_lines(folder / "newstest2017.de")[:n]
    other = read_lines(folder / "systems" / "newstest2017.uedin-nmt.4722.en-de")[:n]
    for name, lines in [("hyp", hyps), ("ref", refs), ("other", other)]:
        (tmp_path / name).write_text("".join(x + "\n" for x in lines), encoding="utf-8")
    one = score(hyps, refs)
    out = tmp_path / "s.json"
    args = EvalConfig(hyp=str(tmp_path / "hyp"), ref=[str(tmp_path / "ref")] * 2)
    twice = evaluate_main(Config(eval=args))
    assert twice["bleu"] == pytest.approx(one["bleu"], abs=1e-9)
    assert twice["signature"].startswith("nrefs:2|")
    assert f"BLEU = {one['bleu']:.2f}" in capsys.readouterr().out
    refs = [str(tmp_path / "ref"), str(tmp_path / "other")]
    cfg = Config(eval=EvalConfig(hyp=str(tmp_path / "hyp"), ref=refs))
    cfg.eval.output = str(out)
    two = evaluate_main(cfg)
    assert two["bleu"] > one["bleu"]
    assert json.loads(out.read_text())["bleu"] == pytest.approx(two["bleu"])


def test_score_against_an_independent_bleu():
    """Tiny corpus: BLEU recomputed by hand from clipped n-gram counts (13a leaves these alone)."""
    hyps = ["the cat sat on the mat today", "a dog runs fast"]
    refs = ["the cat sat on the mat", "a dog runs very fast"]

    def ngrams(words, n):
        return [tuple(words[i : i + n]) for i in range(len(words) - n + 1)]

    import math
    from collections import Counter

    logs = []
    for n in range(1, 5):
        match = total = 0
        for h, r in zip(hyps, refs):
            hc, rc = Counter(ngrams(h.split(), n)), Counter(ngrams(r.split(), n))
            match += sum(min(c, rc[g]) for g, c in hc.items())
            total += sum(hc.values())
        logs.append(math.log(match / total))
    hyp_len = sum(len(h.split()) for h in hyps)
    ref_len = sum(len(r.split()) for r in refs)
    bp = 1.0 if hyp_len > ref_len else math.exp(1 - ref_len / hyp_len)
    expected = 100 * bp * math.exp(sum(logs) / 4)
    assert score(hyps, refs)["bleu"] == pytest.approx(expected, abs=1e-6)


def test_score_rejects_mismatched_lengths():
    with pytest.raises(ValueError, match="reference stream 1 has 1 lines"):
        score(["a", "b"], ["a"])


def test_hyp_without_ref_is_an_error():
    with pytest.raises(ValueError, match="ref="):
        evaluate_main(Config(eval=EvalConfig(hyp="x.txt")))


def test_evaluate_run_decodes_scores_and_writes_the_run(tmp_path, capsys):
    """Mode (b): decode the test split of prepared local data with a checkpoint."""
    import random

    import sacrebleu
    import torch

    from mt.checkpoint import model_state, save_checkpoint
    from mt.config import load_config
    from mt.data.build import prepare
    from mt.model.transformer import build_model

    rng = random.Random(0)
    de = "ein mann hund fährt rennt im schnee auf dem fahrrad eine frau".split()
    en = "a man dog rides runs in the snow on bike woman".split()
    data = tmp_path / "data"
    data.mkdir()
    for split, n in [("train", 200), ("valid", 5), ("test", 7)]:
        for lang, words in [("de", de), ("en", en)]:
            lines = [" ".join(rng.choices(words, k=rng.randint(2, 6))) for _ in range(n)]
            (data / f"{split}.{lang}").write_text("\n".join(lines) + "\n", encoding="utf-8")
    run_dir = tmp_path / "run"
    cfg = load_config(
        [
            "data=local",
            f"data.dir={data}",
            "tokenizer.vocab_size=60",
            "tokenizer.byte_fallback=false",
            "tokenizer.threads=1",
            f"cache_dir={tmp_path / 'cache'}",
            f"run_dir={run_dir}",
            "train.device=cpu",
            "decode.beam_size=2",
            "decode.max_len_a=0",
            "decode.max_len_b=4",
            "eval.report=true",
        ]
    )
    prepared = prepare(cfg)
    torch.manual_seed(0)
    mcfg = ModelConfig(N=1, d_model=16, d_ff=32, h=2, dropout=0.0, max_positions=64)
    model = build_model(mcfg, prepared.vocab_size)
    state = model_state(model, mcfg, prepared.tokenizer, prepared.vocab_size)
    save_checkpoint(run_dir / "checkpoints" / "best.pt", {**state, "step": 3, "epoch": 1})

    result = evaluate_main(cfg)
    stdout = capsys.readouterr().out.strip().splitlines()
    assert stdout[-1] == str(run_dir)  # the run directory is the last line
    assert any(line.startswith("BLEU = ") for line in stdout)
    hyps = read_lines(run_dir / "translations" / "test.txt")
    refs = read_lines(data / "test.en")
    assert len(hyps) == len(refs) == 7
    saved = json.loads((run_dir / "results.json").read_text())
    expected = sacrebleu.corpus_bleu(hyps, [refs]).score  # independent of mt.evaluation
    assert saved["bleu"] == pytest.approx(expected)
    for key in ("chrf", "signature", "chrf_signature", "split", "checkpoint", "beam_size",
                "alpha", "n_sentences", "decode_seconds"):  # fmt: skip
        assert key in saved
    assert saved["split"] == "test" and saved["n_sentences"] == 7 and saved["beam_size"] == 2
    assert result["bleu"] == saved["bleu"]
    assert (run_dir / "report.md").is_file()
    assert (run_dir / "attention.png").is_file()  # the first test sentence's heatmap
