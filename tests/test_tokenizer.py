"""Stage 2: SentencePiece with fixed special ids, exact round trips on real sentences."""

from __future__ import annotations

import itertools
import unicodedata
from pathlib import Path

import pytest
import sentencepiece as spm

from mt.data.tokenizer import Tokenizer, TokenizerError, canonical_model
from mt.schema import TokenizerConfig
from mt.vocab import BOS, EOS, PAD, UNK


def lines(path: Path, n: int | None = None) -> list[str]:
    """Lines split on "\\n" only (an independent reader)."""
    return path.read_bytes().decode("utf-8").split("\n")[:-1][:n]


def norm(s: str) -> str:
    return unicodedata.normalize("NFC", s).strip()


def train_files(tmp: Path, src: list[str], tgt: list[str]) -> tuple[Path, Path]:
    (tmp / "s").write_text("".join(norm(s) + "\n" for s in src), encoding="utf-8")
    (tmp / "t").write_text("".join(norm(s) + "\n" for s in tgt), encoding="utf-8")
    return tmp / "s", tmp / "t"


@pytest.fixture(scope="module")
def corpus(real_data, tmp_path_factory):
    """2000 Multi30k training pairs as files, plus real held-out sentences (captions, news)."""
    m30k = real_data / "multi30k"
    src, tgt = lines(m30k / "train.de", 2000), lines(m30k / "train.en", 2000)
    files = train_files(tmp_path_factory.mktemp("tok"), src, tgt)
    held_out = (
        lines(m30k / "test_2016_flickr.de", 300)
        + lines(m30k / "test_2016_flickr.en", 300)
        + lines(real_data / "wmt14" / "newstest2014.de", 300)
        + lines(real_data / "wmt14" / "newstest2014.en", 300)
    )
    return files, src + tgt, held_out


@pytest.fixture(scope="module")
def joint(corpus, tmp_path_factory):
    (s, t), _, _ = corpus
    cfg = TokenizerConfig(vocab_size=1000, threads=1)
    return Tokenizer.train(s, t, tmp_path_factory.mktemp("joint"), cfg)


def test_specials_and_vocab_size(joint, tmp_path):
    assert joint.joint and joint.vocab_size == 1000
    sp = joint.models[0]
    assert [sp.pad_id(), sp.unk_id(), sp.bos_id(), sp.eos_id()] == [PAD, UNK, BOS, EOS]
    assert sp.id_to_piece([PAD, UNK, BOS, EOS]) == ["<pad>", "<unk>", "<s>", "</s>"]


def test_round_trip_real_sentences_byte_fallback(joint, corpus):
    _, _, held_out = corpus
    texts = [Tokenizer.normalize(s) for s in held_out]
    ids = joint.encode(texts, side="src")
    assert all(UNK not in seq for seq in ids)
    assert joint.decode(ids, side="tgt") == texts
    assert max(max(seq) for seq in ids if seq) < joint.vocab_size


def test_round_trip_without_byte_fallback_is_exact_on_seen_characters(corpus, tmp_path):
    (s, t), train_text, held_out = corpus
    cfg = TokenizerConfig(vocab_size=1000, byte_fallback=False, threads=1)
    tok = Tokenizer.train(s, t, tmp_path, cfg)
    seen = set(itertools.chain.from_iterable(norm(x) for x in train_text))
    texts = [Tokenizer.normalize(x) for x in held_out]
    decoded = tok.decode(tok.encode(texts), side="src")
    covered = [i for i, x in enumerate(texts) if set(x) <= seen | {" "}]
    assert len(covered) > 300
    assert all(decoded[i] == texts[i] for i in covered)
    unseen = [i for i in range(len(texts)) if i not in set(covered)]
    assert unseen and all(UNK in tok.encode([texts[i]])[0] for i in unseen)  # honest: <unk>


def test_unigram_small_vocab(corpus, tmp_path):
    (s, t), _, held_out = corpus
    tok = Tokenizer.train(s, t, tmp_path, TokenizerConfig(type="unigram", vocab_size=1000))
    texts = [norm(x) for x in held_out[:200]]
    assert tok.decode(tok.encode(texts)) == texts


def test_separate_models(corpus, tmp_path):
    (s, t), _, held_out = corpus
    tok = Tokenizer.train(s, t, tmp_path, TokenizerConfig(vocab_size=600, joint=False))
    assert not tok.joint and len(tok.to_bytes()) == 2
    assert (tmp_path / "spm.src.model").is_file() and (tmp_path / "spm.tgt.model").is_file()
    src_sp, tgt_sp = tok.models
    assert tok.vocab_size == max(src_sp.vocab_size(), tgt_sp.vocab_size())
    de = norm(held_out[0])
    assert tok.encode([de], side="src") == [src_sp.encode(de)]
    assert tok.encode([de], side="tgt") == [tgt_sp.encode(de)]
    assert tok.decode(tok.encode([de], "src"), side="src") == [de]
    loaded = Tokenizer.load([tmp_path / "spm.src.model", tmp_path / "spm.tgt.model"])
    assert loaded.encode([de], "tgt") == tok.encode([de], "tgt")


def test_bytes_round_trip_and_load(joint, corpus, tmp_path):
    texts = [norm(x) for x in corpus[2][:50]]
    again = Tokenizer.from_bytes(joint.to_bytes())
    assert again.encode(texts) == joint.encode(texts)
    paths = joint.save(tmp_path)
    assert Tokenizer.load(paths).encode(texts) == joint.encode(texts)
    with pytest.raises(TokenizerError, match="not a SentencePiece model"):
        Tokenizer.from_bytes([b"garbage"])


def test_a_model_trained_again_elsewhere_has_the_same_bytes(joint, corpus, tmp_path):
    """SentencePiece records its input paths, model prefix and threads in the model; the
    tokenizer's bytes (what checkpoints embed and resume compares) leave them out, so the same
    training in another (temporary) folder with other threads is the same tokenizer."""
    (s, t), _, _ = corpus
    moved = [tmp_path / "elsewhere" / p.name for p in (s, t)]
    moved[0].parent.mkdir()
    for old, new in zip((s, t), moved):
        new.write_bytes(old.read_bytes())
    again = Tokenizer.train(*moved, tmp_path / "out", TokenizerConfig(vocab_size=1000, threads=2))
    raw = [sp.serialized_model_proto() for sp in (joint.models[0], again.models[0])]
    assert raw[0] != raw[1]  # the paths differ in SentencePiece's own bytes
    assert again.to_bytes() == joint.to_bytes() and again.sha256() == joint.sha256()
    assert canonical_model(joint.to_bytes()[0]) == joint.to_bytes()[0]  # idempotent


def test_the_canonical_bytes_are_the_model_without_its_run_fields(joint):
    """Checked with protobuf's own parser: every field kept but the four of the training run."""
    pb = pytest.importorskip("sentencepiece.sentencepiece_model_pb2")
    raw = joint.models[0].serialized_model_proto()
    expected = pb.ModelProto()
    expected.ParseFromString(raw)
    assert list(expected.trainer_spec.input) and expected.trainer_spec.model_prefix
    for name in ("input", "input_format", "model_prefix", "num_threads"):
        expected.trainer_spec.ClearField(name)
    got = pb.ModelProto()
    got.ParseFromString(canonical_model(raw))
    assert got == expected and len(got.pieces) == 1000
    with pytest.raises(TokenizerError, match="truncated"):
        canonical_model(raw[:-3])


def test_foreign_specials_rejected(corpus, tmp_path):
    (s, _), _, _ = corpus
    spm.SentencePieceTrainer.train(  # SentencePiece's defaults: unk=0 bos=1 eos=2, no pad
        input=str(s), model_prefix=str(tmp_path / "other"), vocab_size=300, minloglevel=2
    )
    with pytest.raises(TokenizerError, match="special ids"):
        Tokenizer.load([tmp_path / "other.model"])


def test_decode_stops_at_eos_and_drops_pad_bos(joint):
    ids = joint.encode(["Ein Hund läuft."])[0]
    out = joint.decode([[BOS, *ids, EOS, *ids, PAD], [*ids, PAD, PAD]])
    assert out == ["Ein Hund läuft.", "Ein Hund läuft."]


def test_unicode_separators_stay_inside_sentence(tmp_path):
    src = ["ein\u2028Hund", "zwei\x85Katzen"] * 20 + ["drei Vögel"] * 20
    s, t = train_files(tmp_path, src, src)
    tok = Tokenizer.train(s, t, tmp_path, TokenizerConfig(vocab_size=300))
    assert tok.decode(tok.encode(["ein\u2028Hund", "zwei\x85Katzen"])) == [
        "ein\u2028Hund",
        "zwei\x85Katzen",
    ]


def test_normalize_is_nfc_and_strip():
    assert Tokenizer.normalize("  Cafe\u0301\t\n") == "Caf\u00e9"
