"""Who decodes (mt.decode.engine) and CTranslate2 as an engine (mt.decode.ctranslate2_engine): the
routing alone (with and without ctranslate2, on a CUDA-reporting stub), the fall-back lines
and errors, the converted model's cache, and CTranslate2's searches against torch's on a tiny
model, through the Translator, mt-translate, mt-serve and mt-score."""

from __future__ import annotations

import logging

import pytest
import torch

from mt.checkpoint import model_state, save_checkpoint
from mt.decode import engine as engines
from mt.decode.engine import EngineError, choose, threads
from mt.model.transformer import build_model
from mt.schema import DecodeConfig, EngineConfig, ModelConfig
from mt.vocab import BOS, EOS, PAD

# ---- the routing alone ------------------------------------------------------------------------


def test_auto_takes_ctranslate2_where_it_imports_and_torch_where_not():
    got = choose("auto", "auto", "cpu", True, beam_size=5)
    assert (got.engine, got.device, got.compute_type) == ("ctranslate2", "cpu", "float32")
    got = choose("auto", "auto", "cpu", False, beam_size=5)
    assert got.engine == "torch" and "not installed" in got.reason
    assert choose("torch", "auto", "cpu", True).engine == "torch"


def test_a_cuda_device_never_reaches_cpu_code(monkeypatch):
    """With CUDA reported, CTranslate2 runs on cuda with a GPU compute type, and the torch path
    keeps the GPU the Translator was given."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    from mt.distributed import resolve_device

    device = resolve_device("auto")
    assert str(device).startswith("cuda")
    got = choose("auto", "auto", device, True, beam_size=4)
    assert (got.engine, got.device, got.index, got.compute_type) == (
        "ctranslate2", "cuda", 0, "float16")  # fmt: skip
    got = choose("ctranslate2", "int8_float16", "cuda:1", True)
    assert (got.engine, got.device, got.index, got.compute_type) == (
        "ctranslate2", "cuda", 1, "int8_float16")  # fmt: skip
    # a fall-back (an ensemble) stays torch, on the device it was given: no device here
    assert choose("auto", "auto", device, True, ensemble=True).engine == "torch"
    # GPU-only compute types are refused on a CPU, naming the setting
    with pytest.raises(EngineError, match="serve.compute_type=float16: on a CPU"):
        choose("auto", "float16", "cpu", True, node="serve")


@pytest.mark.parametrize("what, kwargs", [
    ("ensemble", dict(ensemble=True)),
    ("model", dict(model_problem="model.norm=pre")),
    ("prefix", dict(beam_size=4, prefix=True)),
])  # fmt: skip
def test_what_ctranslate2_cannot_run_falls_back_under_auto_and_is_an_error_when_asked(what, kwargs):
    fallback = choose("auto", "auto", "cpu", True, **kwargs)
    assert fallback.engine == "torch"
    with pytest.raises(EngineError, match="score.engine=ctranslate2: .*use score.engine=torch"):
        choose("ctranslate2", "auto", "cpu", True, node="score", **kwargs)


def test_sampling_and_greedy_prefix_routes():
    assert choose("auto", "auto", "cpu", True, sample=True).engine == "torch"  # per-line seeds
    assert choose("ctranslate2", "auto", "cpu", True, sample=True).engine == "ctranslate2"
    assert choose("auto", "auto", "cpu", True, beam_size=1, prefix=True).engine == "ctranslate2"
    with pytest.raises(EngineError, match="translate.engine=fast: expected one of auto"):
        choose("fast", "auto", "cpu", True)
    with pytest.raises(EngineError, match="not installed"):
        choose("ctranslate2", "auto", "cpu", False)


def test_thread_settings():
    assert threads(0, 0, 4) == (4, 1)
    assert threads(0, 2, 4) == (2, 2)
    assert threads(1, 0, 4) == (1, 4)
    with pytest.raises(EngineError):
        threads(-1, 0, 2)


# ---- CTranslate2 on a tiny model --------------------------------------------------------------

ctranslate2 = pytest.importorskip("ctranslate2")

from test_translate import make_tokenizer, sentences  # noqa: E402

from mt.decode import ctranslate2_engine  # noqa: E402
from mt.decode.translate import Translator  # noqa: E402
from mt.export import ct2 as exporter  # noqa: E402


def sharp_checkpoint(path, tokenizer, seed: int = 0):
    """A tiny random model with sharp distributions (few near-ties between its choices), EOS
    likely enough that outputs end at different lengths, and, as in a trained model, next to
    no mass on PAD and BOS (logit 0 beside large ones): CTranslate2 renormalises each step
    over the tokens it may generate, mt's search scores the model's own probabilities."""
    torch.manual_seed(seed)
    cfg = ModelConfig(N=2, d_model=32, d_ff=64, h=4, dropout=0.0, max_positions=64)
    model = build_model(cfg, tokenizer.vocab_size).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(2.0)
        model.embed[EOS] *= 2.0
        model.embed[PAD] = 0.0
        model.embed[BOS] = 0.0
    state = model_state(model, cfg, tokenizer, tokenizer.vocab_size)
    state.update(step=1, epoch=1)
    save_checkpoint(path, state)
    return path


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("engine")
    return sharp_checkpoint(tmp / "best.pt", make_tokenizer(tmp, 60))


DECODE = DecodeConfig(beam_size=4, alpha=1.0, max_len_a=1.0, max_len_b=6, batch_size=8)


@pytest.fixture(scope="module")
def both(ckpt):
    torch_t = Translator.from_checkpoint(ckpt, "cpu", DECODE, EngineConfig(engine="torch"))
    ct2_t = Translator.from_checkpoint(ckpt, "cpu", DECODE, EngineConfig(engine="ctranslate2"),
                                       exporter=exporter)  # fmt: skip
    return torch_t, ct2_t


def _assert_same(a, b):
    assert [[t for t, _ in hyps] for hyps in a] == [[t for t, _ in hyps] for hyps in b]
    for x, y in zip(a, b):
        assert [s for _, s in x] == pytest.approx([s for _, s in y], rel=5e-3, abs=1e-3)


@pytest.mark.parametrize("settings", [
    dict(beam_size=1, alpha=0.0),
    dict(beam_size=1, alpha=1.0),
    dict(beam_size=4, alpha=0.0),
    dict(beam_size=4, alpha=1.0),
    dict(beam_size=4, alpha=1.5, nbest=3),
    dict(beam_size=3, alpha=0.6, max_tokens=40),  # batches by tokens
    dict(beam_size=1, max_len_a=0.0, max_len_b=3),  # outputs cut at the limit
])  # fmt: skip
def test_ctranslate2_finds_torchs_hypotheses_and_scores(both, settings):
    torch_t, ct2_t = both
    lines = sentences(24, seed=3)
    a = torch_t.translate_nbest(lines, **settings)
    b = ct2_t.translate_nbest(lines, **settings)
    _assert_same(a, b)
    assert len({len(h[0][0].split()) for h in a}) > 1  # outputs of several lengths
    if settings.get("nbest", 1) > 1:
        assert all(len(h) == settings["nbest"] for h in b)
    best = {k: v for k, v in settings.items() if k != "nbest"}
    assert torch_t.translate(lines, **best) == ct2_t.translate(lines, **best)


def test_greedy_with_a_prefix_is_torchs_with_mts_scores(both):
    torch_t, ct2_t = both
    lines = sentences(12, seed=5)
    prefix = ["a man" if i % 2 else "" for i in range(len(lines))]
    a = torch_t.translate_nbest(lines, prefix=prefix, beam_size=1, alpha=1.0)
    b = ct2_t.translate_nbest(lines, prefix=prefix, beam_size=1, alpha=1.0)
    _assert_same(a, b)
    assert all(h[0][0].startswith("a man") for h, p in zip(b, prefix) if p)


def test_beam_with_a_prefix_is_an_error_with_ctranslate2(both):
    _, ct2_t = both
    with pytest.raises(EngineError, match="translate.engine=ctranslate2: .*prefix"):
        ct2_t.translate_nbest(["ein mann"], prefix=["a"], beam_size=4)


def test_sampling_through_ctranslate2_follows_its_settings(both):
    _, ct2_t = both
    lines = sentences(8, seed=2)
    greedy = ct2_t.translate(lines, beam_size=1)
    # top_k=1 and temperature 0 leave one choice: greedy search
    assert ct2_t.translate(lines, sample=True, top_k=1) == greedy
    assert ct2_t.translate(lines, sample=True, temperature=0.0) == greedy
    many = [tuple(ct2_t.translate(lines, sample=True, seed=s, temperature=3.0)) for s in range(4)]
    assert len(set(many)) > 1


def test_a_shortlist_becomes_the_vocabulary_map(both, ckpt, tmp_path):
    """decode.shortlist through CTranslate2: the model converted again with the lexicon as its
    vocabulary map (``use_vmap``); with every piece listed, torch's translations."""
    from mt.decode.shortlist import Lexicon

    torch_t, ct2_t = both
    V = torch_t.tokenizer.vocab_size
    every = Lexicon(torch.zeros(V + 1, dtype=torch.long), torch.zeros(0, dtype=torch.long),
                    torch.zeros(0), torch.arange(V))  # fmt: skip
    every.save(tmp_path / "lexicon.pt")
    lines = sentences(10, seed=11)
    settings = dict(shortlist=str(tmp_path / "lexicon.pt"), shortlist_frequent=V)
    assert ct2_t.translate(lines, **settings) == torch_t.translate(lines)
    (key,) = [k for k in ct2_t._ct2 if k[3] is not None]
    assert (ct2_t._ct2[key].model_dir / "vmap.txt").is_file()


def test_scores_of_given_translations_equal_torchs(both):
    torch_t, ct2_t = both
    src, tgt = sentences(10, seed=8), [" ".join(s.split()[::-1]) for s in sentences(10, seed=9)]
    a, b = torch_t.score(src, tgt), ct2_t.score(src, tgt)
    assert [n for _, n in a] == [n for _, n in b]
    assert [lp for lp, _ in a] == pytest.approx([lp for lp, _ in b], abs=1e-3)


# ---- the cache ------------------------------------------------------------------------------


def test_conversion_is_cached_and_a_changed_checkpoint_converts_again(tmp_path, monkeypatch):
    tokenizer = make_tokenizer(tmp_path, 60)
    path = sharp_checkpoint(tmp_path / "model.pt", tokenizer)
    calls = []
    export = exporter.export_ct2
    monkeypatch.setattr(exporter, "export_ct2",
                        lambda *a, **k: calls.append(1) or export(*a, **k))  # fmt: skip
    first, seconds = ctranslate2_engine.converted_model(path, "int8", exporter)
    assert seconds is not None and calls == [1] and (first / "model.bin").is_file()
    assert first.parent == tmp_path / "model.pt.ct2"  # beside the checkpoint
    again, seconds = ctranslate2_engine.converted_model(path, "int8", exporter)
    assert (again, seconds, calls) == (first, None, [1])  # not converted again
    other, _ = ctranslate2_engine.converted_model(path, "float32", exporter)  # its own
    assert other != first and calls == [1, 1]
    sharp_checkpoint(path, tokenizer, seed=1)  # the same file name, other weights
    changed, seconds = ctranslate2_engine.converted_model(path, "int8", exporter)
    assert changed != first and seconds is not None and calls == [1, 1, 1]
    assert not first.exists() and other.exists()  # the stale int8 conversion is gone
    assert not list(changed.parent.glob(".tmp-*"))  # nothing half-written left


def test_a_second_translator_reuses_the_conversion(ckpt, caplog):
    with caplog.at_level(logging.INFO, logger="mt.decode.ctranslate2_engine"):
        for _ in range(2):
            engine = EngineConfig(engine="ctranslate2", compute_type="int8")
            t = Translator.from_checkpoint(ckpt, "cpu", DECODE, engine, exporter=exporter)
            t.translate(["ein mann"])
    assert sum("converted for CTranslate2" in r.message for r in caplog.records) <= 1


# ---- the commands ------------------------------------------------------------------------------


def test_auto_logs_its_choice_once_and_each_fall_back_in_one_line(ckpt, caplog, monkeypatch):
    engines.tell.cache_clear()
    t = Translator.from_checkpoint(ckpt, "cpu", DECODE, EngineConfig(), exporter=exporter)
    with caplog.at_level(logging.INFO, logger="mt.decode.engine"):
        t.translate(["ein mann"])
        t.translate(["ein hund"])
        t.translate(["ein hund"], sample=True)
        t.translate(["ein hund"], prefix=["a"])
    lines = [r.message for r in caplog.records if r.name == "mt.decode.engine"]
    assert len(lines) == 3, lines  # one line per choice, not per call
    assert lines[0] == "decoding with ctranslate2: ctranslate2 is installed, float32 on cpu"
    assert lines[1].startswith("decoding with torch: mt seeds each sentence's sample")
    assert lines[2].startswith("decoding with torch: CTranslate2's beam search scores a target")
    engines.tell.cache_clear()
    monkeypatch.setattr(engines, "ct2_available", lambda: False)
    with caplog.at_level(logging.INFO, logger="mt.decode.engine"):
        assert t.translate(["ein mann"]) == Translator.from_checkpoint(
            ckpt, "cpu", DECODE
        ).translate(["ein mann"])
    assert "decoding with torch: ctranslate2 is not installed" in caplog.text


def test_translate_main_with_each_engine(ckpt, tmp_path):
    from mt.decode.translate import translate_main
    from mt.schema import Config, TranslateConfig

    lines = sentences(20, seed=4)
    (tmp_path / "in").write_text("\n".join(lines) + "\n")
    outs = {}
    for engine in ("torch", "ctranslate2", "auto"):
        out = tmp_path / f"out.{engine}"
        translate_main(Config(decode=DECODE, translate=TranslateConfig(
            checkpoint=str(ckpt), input=str(tmp_path / "in"), output=str(out),
            engine=engine)), exporter)  # fmt: skip
        outs[engine] = out.read_text()
    assert outs["torch"] == outs["ctranslate2"] == outs["auto"]
    with pytest.raises(SystemExit, match="^mt-translate: translate.compute_type=float16: on a CPU"):
        translate_main(Config(decode=DECODE, translate=TranslateConfig(
            checkpoint=str(ckpt), input=str(tmp_path / "in"), output=str(tmp_path / "x"),
            engine="ctranslate2", compute_type="float16")), exporter)  # fmt: skip


def test_without_an_exporter_torch_decodes_and_ctranslate2_is_refused(ckpt):
    """mt.export sits above mt.decode: the commands get the converter from mt.cli."""
    engines.tell.cache_clear()
    auto = Translator.from_checkpoint(ckpt, "cpu", DECODE, EngineConfig())
    assert auto.engine(DECODE) is None
    asked = Translator.from_checkpoint(ckpt, "cpu", DECODE, EngineConfig(engine="ctranslate2"))
    with pytest.raises(EngineError, match="no exporter to convert it with"):
        asked.engine(DECODE)


def test_score_main_through_ctranslate2(ckpt, tmp_path):
    from mt.decode.rescore import score_main
    from mt.schema import Config, ScoreConfig

    (tmp_path / "src").write_text("\n".join(sentences(6, seed=1)) + "\n")
    targets = ["a man", "a dog runs", "", "the snow", "a", "b"]
    (tmp_path / "tgt").write_text("\n".join(targets) + "\n")
    totals = {}
    for engine in ("torch", "ctranslate2"):
        cfg = Config(decode=DECODE, score=ScoreConfig(
            checkpoint=str(ckpt), src=str(tmp_path / "src"), tgt=str(tmp_path / "tgt"),
            output=str(tmp_path / f"out.{engine}"), engine=engine))  # fmt: skip
        totals[engine] = score_main(cfg, exporter)
    assert totals["torch"]["tokens"] == totals["ctranslate2"]["tokens"]
    assert totals["torch"]["logprob"] == pytest.approx(totals["ctranslate2"]["logprob"], abs=1e-3)


def test_serve_through_ctranslate2(ckpt):
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from mt.schema import ServeConfig
    from mt.serve.server import create_app

    lines = sentences(3, seed=6)
    answers = {}
    for engine in ("torch", "ctranslate2"):
        limits = ServeConfig(engine=engine)
        t = Translator.from_checkpoint(ckpt, "cpu", DECODE, limits, "serve", exporter)
        with TestClient(create_app(t, limits)) as client:
            r = client.post("/translate", json={"text": lines, "beam_size": 3, "nbest": 2})
            assert r.status_code == 200, r.text
            answers[engine] = r.json()["translations"]
            assert r.json()["translations"]
            if engine == "ctranslate2":
                assert t._ct2  # the request was decoded by CTranslate2
                # a request CTranslate2 cannot run is refused with its reason (422)
                r = client.post("/translate", json={"text": lines, "sample": True})
                assert r.status_code == 200  # engine=ctranslate2 samples with CTranslate2
    for a, b in zip(answers["torch"], answers["ctranslate2"]):
        assert [h["text"] for h in a["nbest"]] == [h["text"] for h in b["nbest"]]
        assert [h["score"] for h in a["nbest"]] == pytest.approx(
            [h["score"] for h in b["nbest"]], rel=5e-3, abs=1e-3)  # fmt: skip
