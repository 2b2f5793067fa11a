"""Ensembles, mt-score, word alignments, prefixes and interactive mt-translate, through the
Translator API and the command-line functions, on tiny checkpoints."""

from __future__ import annotations

import io

import pytest
import torch
import torch.nn.functional as F
from conftest import sharp_random_model
from test_translate import FAST, make_tokenizer, sentences, write_checkpoint

from mt.checkpoint import CheckpointError
from mt.data.batches import make_src
from mt.decode.alignment import align, pharaoh, word_index
from mt.decode.driver import score_ids, translate_nbest
from mt.decode.ensemble import Ensemble
from mt.decode.rescore import score_main
from mt.decode.search import beam_search
from mt.decode.translate import Translator, translate_main, translate_stream
from mt.schema import Config, DecodeConfig, ScoreConfig, TranslateConfig
from mt.vocab import BOS, EOS


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return make_tokenizer(tmp_path_factory.mktemp("tools"), 60)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory, tokenizer):
    return write_checkpoint(tmp_path_factory.mktemp("tools_ckpt") / "a.pt", tokenizer)


@pytest.fixture(scope="module")
def translator(ckpt):
    return Translator.from_checkpoint(ckpt, device="cpu", decode_cfg=DecodeConfig(**FAST))


def sources(seed: int, lengths: list[int]) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(4, 40, (n,), generator=g).tolist() for n in lengths]


# ---- ensembles -----------------------------------------------------------------------------


def test_ensemble_of_one_and_of_two_copies_equal_the_model():
    model = sharp_random_model()
    ids = sources(0, [5, 12, 3, 8, 20])
    cfg = DecodeConfig(beam_size=3, alpha=0.6, max_len_a=0.5, max_len_b=6, nbest=3)
    alone = translate_nbest(model, ids, cfg)
    for members in ([model], [model, sharp_random_model()]):  # the second: an equal copy
        together = translate_nbest(Ensemble(members), ids, cfg)
        for a, b in zip(alone, together):
            assert [h.tokens for h in a] == [h.tokens for h in b]
            assert [h.score for h in a] == pytest.approx([h.score for h in b], abs=1e-4)


def test_ensemble_averages_log_probabilities():
    a, b = sharp_random_model(), sharp_random_model()
    with torch.no_grad():
        b.embed.mul_(0.5)  # a different model
    src = make_src(sources(1, [4, 7]))
    tgt = torch.tensor([[BOS, 5, 6], [BOS, 7, 8]])
    got = Ensemble([a, b]).decode(tgt, Ensemble([a, b]).encode(src), None)
    expected = (F.log_softmax(a(src, tgt), -1) + F.log_softmax(b(src, tgt), -1)) / 2
    assert torch.allclose(got, expected, atol=1e-5)


def test_ensemble_checkpoints_with_different_tokenizers_are_refused(ckpt, tmp_path):
    other = write_checkpoint(tmp_path / "b.pt", make_tokenizer(tmp_path, 60, seed=5))
    with pytest.raises(CheckpointError, match="tokenizer differs"):
        Translator.from_checkpoint([ckpt, other])
    same = write_checkpoint(tmp_path / "c.pt", Translator.from_checkpoint(ckpt).tokenizer)
    pair = Translator.from_checkpoint([str(ckpt), str(same)], decode_cfg=DecodeConfig(**FAST))
    one = Translator.from_checkpoint(ckpt, decode_cfg=DecodeConfig(**FAST))
    text = sentences(6)
    assert pair.translate(text) == one.translate(text)  # two copies == one model


# ---- scoring -------------------------------------------------------------------------------


def test_score_equals_teacher_forced_sum_and_beam_search_logprob():
    model = sharp_random_model()
    ids = sources(2, [5, 9, 3, 14])
    src = make_src(ids)
    hyps = beam_search(model, src, 4, 0.6, 1.0, 30, nbest=1)
    outs = [h[0].tokens for h in hyps]
    assert all(len(o) < len(i) + 30 for o, i in zip(outs, ids))  # all ended with EOS
    per_token = score_ids(model, ids, outs, batch_size=3)
    for (hyp,), lp, i, out in zip(hyps, per_token, ids, outs):
        assert len(lp) == len(out) + 1
        assert sum(lp) == pytest.approx(hyp.logprob, abs=1e-3)  # beam search's own score
        # An independent teacher-forced computation, one sentence at a time.
        tgt_in = torch.tensor([[BOS, *out]])
        with torch.no_grad():
            logp = F.log_softmax(model(make_src([i]), tgt_in).double(), -1)[0]
        expected = sum(float(logp[t, y]) for t, y in enumerate([*out, EOS]))
        assert sum(lp) == pytest.approx(expected, abs=1e-3)


def test_mt_score_command(ckpt, translator, tmp_path, caplog):
    src = sentences(5, seed=3)
    tgt = translator.translate(src)
    (tmp_path / "s.de").write_text("\n".join(src) + "\n")
    (tmp_path / "t.en").write_text("\n".join(tgt) + "\n")
    out = tmp_path / "scores.tsv"
    cfg = Config(
        score=ScoreConfig(
            checkpoint=str(ckpt),
            src=str(tmp_path / "s.de"),
            tgt=str(tmp_path / "t.en"),
            output=str(out),
        )
    )
    result = score_main(cfg)
    rows = [line.split("\t") for line in out.read_text().splitlines()]
    assert len(rows) == 5 and result["sentences"] == 5
    expected = translator.score(src, tgt)
    for (total, count, per), (e_total, e_count) in zip(rows, expected):
        assert float(total) == pytest.approx(e_total, abs=1e-3) and int(count) == e_count
        assert float(per) == pytest.approx(e_total / e_count, abs=1e-3)
    assert result["logprob"] == pytest.approx(sum(e for e, _ in expected), abs=1e-2)
    (tmp_path / "short.en").write_text("one line\n")
    with pytest.raises(SystemExit, match="short.en ends at line 1"):
        score_main(
            Config(
                score=ScoreConfig(
                    checkpoint=str(ckpt), src=str(tmp_path / "s.de"), tgt=str(tmp_path / "short.en")
                )
            )
        )


# ---- alignments ----------------------------------------------------------------------------


def test_word_alignment_from_an_attention_matrix():
    assert word_index(["\u2581Ein", "\u2581Hund", "e", "\u2581rennt"]) == [0, 1, 1, 2]
    # Target pieces: "▁A", "▁dog", "s"; rows attend most to source pieces 0, 2, 1; last row EOS.
    matrix = torch.tensor(
        [
            [0.7, 0.1, 0.1, 0.0, 0.1],
            [0.1, 0.2, 0.6, 0.0, 0.1],
            [0.0, 0.8, 0.1, 0.0, 0.1],
            [0.0, 0.0, 0.0, 0.1, 0.9],
        ]  # fmt: skip
    )
    pairs = align(matrix, [0, 1, 1, 2], [0, 1, 1])
    assert pairs == [(0, 0), (1, 1)]
    assert pharaoh(pairs) == "0-0 1-1"


def test_alignment_file_has_one_valid_line_per_input(ckpt, tmp_path):
    src = sentences(7, seed=4)
    src[2] = ""
    (tmp_path / "in.de").write_text("\n".join(src) + "\n")
    cfg = Config(
        translate=TranslateConfig(
            checkpoint=str(ckpt),
            input=str(tmp_path / "in.de"),
            output=str(tmp_path / "out.en"),
            alignment=str(tmp_path / "a.txt"),
        ),
        decode=DecodeConfig(**FAST),
    )
    translate_main(cfg)
    outs = (tmp_path / "out.en").read_text().splitlines()
    lines = (tmp_path / "a.txt").read_text().splitlines()
    assert len(lines) == len(src) == len(outs) and lines[2] == ""
    for s, o, line in zip(src, outs, lines):
        for pair in line.split():
            i, j = map(int, pair.split("-"))
            assert 0 <= i < len(s.split()) and 0 <= j < max(1, len(o.split()))


# ---- prefixes and interactive use ----------------------------------------------------------


def test_translate_with_prefix_list_and_file(ckpt, translator, tmp_path):
    src = sentences(4, seed=5)
    long = {**FAST, "max_len_b": 15}  # the prefix counts toward the maximum length
    free = translator.translate(src, **long)
    prefix = ["a man", "", "the dog", "a"]
    forced = translator.translate(src, prefix=prefix, **long)
    assert forced[1] == free[1]
    for p, f in zip(prefix, forced):
        assert f.startswith(p)
    (tmp_path / "in.de").write_text("\n".join(src) + "\n")
    (tmp_path / "prefix.en").write_text("\n".join(prefix) + "\n")
    cfg = Config(
        translate=TranslateConfig(
            checkpoint=str(ckpt),
            input=str(tmp_path / "in.de"),
            output=str(tmp_path / "out.en"),
            prefix=str(tmp_path / "prefix.en"),
        ),
        decode=DecodeConfig(**long),
    )
    translate_main(cfg)
    assert (tmp_path / "out.en").read_text().splitlines() == forced
    (tmp_path / "prefix.en").write_text("a\n")
    with pytest.raises(SystemExit, match="prefix file has fewer lines"):
        translate_main(cfg)


class Typist(io.StringIO):
    """An input that records how many output lines exist each time a line is read."""

    def __init__(self, lines: list[str], out: io.StringIO) -> None:
        super().__init__("".join(line + "\n" for line in lines))
        self.out, self.seen = out, []

    def __next__(self) -> str:
        self.seen.append(self.out.getvalue().count("\n"))
        return super().__next__()


def test_interactive_translates_each_line_as_it_is_read(translator):
    out = io.StringIO()
    typed = Typist(sentences(4, seed=6), out)
    n = translate_stream(translator, typed, out, translator.decode_cfg, interactive=True)
    assert n == 4 and typed.seen[:4] == [0, 1, 2, 3]  # line k read after k answers
    assert out.getvalue().splitlines() == translator.translate(sentences(4, seed=6))
    batched = io.StringIO()
    typed = Typist(sentences(4, seed=6), batched)
    translate_stream(translator, typed, batched, translator.decode_cfg)
    assert typed.seen[:4] == [0, 0, 0, 0]  # from a file or pipe: read ahead, in chunks


def test_command_line_takes_a_checkpoint_list_and_interactive_setting():
    from mt.config import load_config

    overrides = ["checkpoint=[a.pt,b.pt]", "interactive=true", "alignment_layer=0"]
    cfg = load_config(overrides, command="translate").translate
    assert cfg.checkpoint == ["a.pt", "b.pt"] and cfg.interactive and cfg.alignment_layer == 0
    assert load_config().translate.interactive is None  # decided by whether stdin is a terminal
