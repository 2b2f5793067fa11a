"""The Translator API and mt-translate: order, streaming, empty and too-long lines, attention,
and clear errors for files that are not usable checkpoints."""

from __future__ import annotations

import io
import logging
import random

import pytest
import torch

from mt.checkpoint import CheckpointError, model_state, save_checkpoint
from mt.data.tokenizer import Tokenizer
from mt.decode import translate as translate_mod
from mt.decode.search import greedy_search
from mt.decode.translate import Translator, translate_main, translate_stream
from mt.model.transformer import build_model
from mt.schema import Config, DecodeConfig, ModelConfig, TokenizerConfig, TranslateConfig

WORDS = "ein mann hund fährt rennt im schnee auf dem fahrrad eine frau kind spielt park".split()
WORDS_EN = "a man dog rides runs in the snow on bike woman child plays park".split()
FAST = dict(beam_size=2, max_len_a=0.0, max_len_b=5, batch_size=4)


def make_tokenizer(tmp_path, vocab_size: int, seed: int = 0) -> Tokenizer:
    rng = random.Random(seed)
    src, tgt = tmp_path / f"text{vocab_size}.de", tmp_path / f"text{vocab_size}.en"
    src.write_text("".join(" ".join(rng.choices(WORDS, k=6)) + "\n" for _ in range(300)))
    tgt.write_text("".join(" ".join(rng.choices(WORDS_EN, k=6)) + "\n" for _ in range(300)))
    cfg = TokenizerConfig(vocab_size=vocab_size, threads=1, byte_fallback=False)
    return Tokenizer.train(src, tgt, tmp_path / f"spm{vocab_size}", cfg)


def write_checkpoint(path, tokenizer: Tokenizer, max_positions: int = 64, vocab_size=None):
    torch.manual_seed(0)
    cfg = ModelConfig(N=1, d_model=16, d_ff=32, h=2, dropout=0.0, max_positions=max_positions)
    V = vocab_size or tokenizer.vocab_size
    model = build_model(cfg, V)
    state = model_state(model, cfg, tokenizer, V)
    state.update(step=7, epoch=1)
    save_checkpoint(path, state)
    return path


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("translate")
    tokenizer = make_tokenizer(tmp, 60)
    return write_checkpoint(tmp / "best.pt", tokenizer)


@pytest.fixture(scope="module")
def translator(ckpt):
    return Translator.from_checkpoint(ckpt, device="cpu", decode_cfg=DecodeConfig(**FAST))


def sentences(n: int, seed: int = 1) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choices(WORDS, k=rng.randint(1, 9))) for _ in range(n)]


def test_translate_matches_greedy_search_on_the_same_model(translator):
    from mt.data.batches import make_src

    texts = sentences(5)
    out = translator.translate(texts, beam_size=1)
    tok = translator.tokenizer
    ids = tok.encode([tok.normalize(t) for t in texts], side="src")
    for src_ids, got in zip(ids, out):  # one by one, no batching, no sorting
        (hyp,) = greedy_search(translator.model, make_src([src_ids]), 0.0, 5)
        assert got == tok.decode([hyp.tokens])[0]


def test_empty_lines_give_empty_lines(translator):
    texts = ["", "ein mann", "   ", "hund"]
    out = translator.translate(texts)
    assert len(out) == 4 and out[0] == "" and out[2] == ""
    assert out[1] == translator.translate(["ein mann"])[0]


def test_translate_main_file_to_file_in_input_order(ckpt, translator, tmp_path, monkeypatch):
    monkeypatch.setattr(translate_mod, "CHUNK_LINES", 3)  # several chunks and batches
    texts = sentences(11) + [""]
    (tmp_path / "in.de").write_text("\n".join(texts) + "\n", encoding="utf-8")
    cfg = Config(
        translate=TranslateConfig(
            checkpoint=str(ckpt), input=str(tmp_path / "in.de"), output=str(tmp_path / "o")
        )
    )
    cfg.decode = DecodeConfig(**{**FAST, "batch_size": 2})
    cfg.train.device = "cpu"
    translate_main(cfg)
    got = (tmp_path / "o").read_text(encoding="utf-8").split("\n")
    assert got[-1] == "" and len(got) - 1 == len(texts)
    # Each line translated alone gives the same line: order is the input's.
    assert got[:-1] == [translator.translate([t])[0] for t in texts]


def test_translate_main_stdin_to_stdout(ckpt, monkeypatch, capsys):
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(b"ein hund\n\nfrau\n")))
    cfg = Config(translate=TranslateConfig(checkpoint=str(ckpt)))
    cfg.decode = DecodeConfig(**FAST)
    cfg.train.device = "cpu"
    translate_main(cfg)
    lines = capsys.readouterr().out.split("\n")
    assert len(lines) == 4 and lines[1] == "" and lines[3] == ""


def test_stream_never_reads_far_ahead(translator, monkeypatch):
    """Output of the first chunk is written before the input is read beyond that chunk."""
    monkeypatch.setattr(translate_mod, "CHUNK_LINES", 4)
    consumed = 0

    def lines():
        nonlocal consumed
        for text in sentences(1000, seed=3):
            consumed += 1
            yield text + "\n"
            if consumed == 9:
                return  # stop early: a long input need not be decoded for this check

    class Sink(io.StringIO):
        first_write_at = None

        def write(self, s):
            if self.first_write_at is None:
                self.first_write_at = consumed
            return super().write(s)

    sink = Sink()
    cfg = DecodeConfig(**{**FAST, "batch_size": 4})
    assert translate_stream(translator, lines(), sink, cfg) == 9
    assert sink.first_write_at <= 5  # one chunk of 4 (+1 read to notice the chunk is full)
    assert len(sink.getvalue().split("\n")) == 10


def test_nbest_output_format(ckpt, tmp_path):
    (tmp_path / "in").write_text("ein hund\nfrau\n", encoding="utf-8")
    cfg = Config(
        translate=TranslateConfig(
            checkpoint=str(ckpt), input=str(tmp_path / "in"), output=str(tmp_path / "o")
        )
    )
    cfg.decode = DecodeConfig(**{**FAST, "beam_size": 3, "nbest": 3})
    cfg.train.device = "cpu"
    translate_main(cfg)
    rows = [line.split(" ||| ") for line in (tmp_path / "o").read_text().splitlines()]
    assert [int(r[0]) for r in rows] == [0, 0, 0, 1, 1, 1]
    for k in (0, 3):
        scores = [float(r[2]) for r in rows[k : k + 3]]
        assert scores == sorted(scores, reverse=True)


def test_too_long_line_is_an_error_naming_it_or_truncated(tmp_path, caplog):
    tokenizer = make_tokenizer(tmp_path, 60)
    path = write_checkpoint(tmp_path / "short.pt", tokenizer, max_positions=12)
    long_line = " ".join(["fahrrad"] * 30)
    (tmp_path / "in").write_text(f"hund\n\n{long_line}\nfrau\n", encoding="utf-8")
    cfg = Config(
        translate=TranslateConfig(
            checkpoint=str(path), input=str(tmp_path / "in"), output=str(tmp_path / "o")
        )
    )
    cfg.decode = DecodeConfig(**FAST)
    cfg.train.device = "cpu"
    with pytest.raises(SystemExit, match=r"line 3 has \d+ tokens.*too_long=truncate"):
        translate_main(cfg)
    cfg.decode.too_long = "truncate"
    with caplog.at_level(logging.WARNING):
        translate_main(cfg)
    assert "truncated" in caplog.text
    assert len((tmp_path / "o").read_text().split("\n")) == 5


def test_attention_matrix_and_png(ckpt, translator, tmp_path):
    src_pieces, tgt_pieces, matrix = translator.attention("ein mann fährt fahrrad")
    assert matrix.shape == (len(tgt_pieces), len(src_pieces))
    assert src_pieces[-1] == "</s>" and tgt_pieces[-1] == "</s>"
    assert torch.allclose(torch.tensor(matrix).sum(-1), torch.ones(len(tgt_pieces)), atol=1e-4)
    (tmp_path / "in").write_text("\nein hund rennt\nfrau\n", encoding="utf-8")
    png = tmp_path / "attn.png"
    cfg = Config(
        translate=TranslateConfig(
            checkpoint=str(ckpt), input=str(tmp_path / "in"), output=str(tmp_path / "o")
        )
    )
    cfg.translate.attention = str(png)
    cfg.decode = DecodeConfig(**FAST)
    cfg.train.device = "cpu"
    translate_main(cfg)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_not_a_checkpoint_truncated_or_other_vocabulary(ckpt, tmp_path):
    junk = tmp_path / "junk.pt"
    junk.write_bytes(b"this is not a checkpoint at all" * 10)
    with pytest.raises(CheckpointError, match="not a readable mt checkpoint"):
        Translator.from_checkpoint(junk)
    truncated = tmp_path / "truncated.pt"
    truncated.write_bytes(ckpt.read_bytes()[: ckpt.stat().st_size // 2])
    with pytest.raises(CheckpointError):
        Translator.from_checkpoint(truncated)
    # A model built for 60 pieces paired with a 40-piece vocabulary.
    other = write_checkpoint(tmp_path / "other.pt", make_tokenizer(tmp_path, 40), vocab_size=60)
    with pytest.raises(CheckpointError, match="different vocabularies"):
        Translator.from_checkpoint(other)
    # The command line says so in one line instead of a traceback.
    cfg = Config(translate=TranslateConfig(checkpoint=str(junk)))
    with pytest.raises(SystemExit, match="mt-translate: .*not a readable mt checkpoint"):
        translate_main(cfg)
    with pytest.raises(SystemExit, match="no checkpoint at"):
        translate_main(Config(translate=TranslateConfig(checkpoint=str(tmp_path / "missing.pt"))))
