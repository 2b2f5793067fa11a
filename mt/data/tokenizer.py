"""Stage 2: SentencePiece subwords with the project's fixed special ids.

One joint model over source and target text (the shared embedding needs one vocabulary), or
one model per language (``tokenizer.joint=false``, for pairs with different scripts). Every model
reserves pad=0, unk=1, bos=2, eos=3 (``mt.vocab``) and is checked for them when loaded.

SentencePiece's own normalisation is switched off (``identity``, extra whitespace kept): the
pipeline normalises text itself (:meth:`Tokenizer.normalize`, NFC + strip), so
``decode(encode(normalize(s))) == normalize(s)`` holds exactly (with ``byte_fallback``, even for
characters never seen in training).
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import zipfile
from pathlib import Path

import sentencepiece as spm

from mt.data.cleaning import normalize_line
from mt.files import one_line, write_bytes
from mt.schema import TokenizerConfig
from mt.vocab import BOS, EOS, PAD, SPECIALS, UNK

log = logging.getLogger(__name__)

SIDES = ("src", "tgt")
LANG_TAG = re.compile(r"<2([A-Za-z][\w-]*)>")


def lang_tag(lang: str) -> str:
    """The token that asks a many-direction model for target language ``lang``: ``<2en>``, as
    fairseq's ``--encoder-langtok tgt`` and NLLB put it, before the source sentence."""
    return f"<2{lang}>"


class TokenizerError(ValueError):
    """A SentencePiece model that does not fit the project (wrong special ids, bad bytes)."""


def num_threads(threads: int) -> int:
    """Threads to use: ``threads`` or, for 0, the cores this process may run on."""
    if threads > 0:
        return threads
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _check_specials(sp: spm.SentencePieceProcessor, where: str) -> None:
    got = {"pad": sp.pad_id(), "unk": sp.unk_id(), "bos": sp.bos_id(), "eos": sp.eos_id()}
    if got != SPECIALS:
        raise TokenizerError(f"{where}: special ids {got} differ from the project's {SPECIALS}")


# Where a model was trained, not what it is: TrainerSpec's input files (1), input format (7),
# model prefix (2) and thread count (16), inside ModelProto's trainer_spec (2).
_TRAINER_SPEC, _RUN_FIELDS = 2, frozenset({1, 2, 7, 16})


def _varint(data: bytes, i: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if i >= len(data):
            raise TokenizerError("not a SentencePiece model: truncated bytes")
        byte = data[i]
        value |= (byte & 0x7F) << shift
        i, shift = i + 1, shift + 7
        if byte < 0x80:
            return value, i


def _fields(data: bytes):
    """(field number, raw bytes of the whole field, payload of a length-delimited field)."""
    i = 0
    while i < len(data):
        start = i
        key, i = _varint(data, i)
        wire, payload = key & 7, None
        if wire == 0:
            _, i = _varint(data, i)
        elif wire == 1:
            i += 8
        elif wire == 5:
            i += 4
        elif wire == 2:
            size, i = _varint(data, i)
            payload, i = data[i : i + size], i + size
        else:
            raise TokenizerError(f"not a SentencePiece model: protobuf wire type {wire}")
        if i > len(data):
            raise TokenizerError("not a SentencePiece model: truncated bytes")
        yield key >> 3, data[start:i], payload


def _encode_varint(value: int) -> bytes:
    out = bytearray()
    while True:
        out.append((value & 0x7F) | (0x80 if value > 0x7F else 0))
        value >>= 7
        if not value:
            return bytes(out)


def canonical_model(blob: bytes) -> bytes:
    """A SentencePiece model's bytes without what only records how its training ran (the
    input files' paths, the model prefix, the thread count): the same pieces, scores and
    settings give the same bytes wherever and whenever they were trained, so a model compares
    equal to itself re-trained in another temporary folder. Encoding is unchanged."""
    out = bytearray()
    for number, raw, payload in _fields(bytes(blob)):
        if number != _TRAINER_SPEC or payload is None:
            out += raw
            continue
        spec = b"".join(r for n, r, _ in _fields(payload) if n not in _RUN_FIELDS)
        out += _encode_varint(_TRAINER_SPEC << 3 | 2) + _encode_varint(len(spec)) + spec
    return bytes(out)


class Tokenizer:
    """One joint SentencePiece model, or a (source, target) pair of them."""

    def __init__(self, models: list[spm.SentencePieceProcessor]):
        if len(models) not in (1, 2):
            raise TokenizerError(f"expected 1 (joint) or 2 (src, tgt) models, got {len(models)}")
        for i, sp in enumerate(models):
            _check_specials(sp, f"SentencePiece model {i}")
        self.models = models

    @classmethod
    def train(
        cls,
        src_texts_path: str | Path,
        tgt_texts_path: str | Path,
        out_dir: str | Path,
        cfg: TokenizerConfig,
    ) -> Tokenizer:
        """Train SentencePiece on text files (one sentence per line) into ``out_dir``'s
        ``spm.model`` (joint) or ``spm.src.model`` and ``spm.tgt.model``.

        SentencePiece samples at most ``cfg.input_sentence_size`` lines at random (shuffled), so
        memory stays bounded on any corpus size. The vocabulary limit is soft: on very small
        data the model may have fewer pieces than asked (logged).
        """
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        if cfg.type not in ("bpe", "unigram"):
            raise TokenizerError(f"tokenizer.type={cfg.type!r}: expected bpe or unigram")
        if cfg.joint:
            jobs = [("spm", [src_texts_path, tgt_texts_path])]
        else:
            jobs = [("spm.src", [src_texts_path]), ("spm.tgt", [tgt_texts_path])]
        spm.set_random_generator_seed(cfg.seed)  # the sample of input_sentence_size lines
        models = []
        for prefix, inputs in jobs:
            spm.SentencePieceTrainer.train(
                input=[str(p) for p in inputs],
                model_prefix=str(out_dir / prefix),
                model_type=cfg.type,
                vocab_size=cfg.vocab_size,
                hard_vocab_limit=False,  # tiny corpora: fewer pieces instead of an error
                character_coverage=cfg.character_coverage,
                input_sentence_size=cfg.input_sentence_size,
                shuffle_input_sentence=cfg.shuffle,
                byte_fallback=cfg.byte_fallback,
                normalization_rule_name="identity",  # mt normalises (NFC + strip) itself
                remove_extra_whitespaces=False,
                pad_id=PAD,
                unk_id=UNK,
                bos_id=BOS,
                eos_id=EOS,
                pad_piece="<pad>",
                num_threads=num_threads(cfg.threads),
                user_defined_symbols=[str(x) for x in cfg.user_symbols],
                minloglevel=2,
            )
            sp = spm.SentencePieceProcessor(model_file=str(out_dir / f"{prefix}.model"))
            if sp.vocab_size() < cfg.vocab_size:
                log.warning(
                    "%s: %d pieces, fewer than vocab_size=%d (small training text)",
                    prefix,
                    sp.vocab_size(),
                    cfg.vocab_size,
                )
            models.append(sp)
        return cls(models)

    @classmethod
    def load(cls, paths: list[str | Path]) -> Tokenizer:
        """Load 1 model file (joint) or 2 ([src, tgt]); TokenizerError names a file that is
        missing or not a SentencePiece model."""
        models = []
        for p in paths:
            try:
                models.append(spm.SentencePieceProcessor(model_file=str(p)))
            except (RuntimeError, OSError) as err:
                msg = " ".join(str(err).split())
                raise TokenizerError(f"{p} is not a readable SentencePiece model: {msg}") from None
        return cls(models)

    @classmethod
    def from_reference(cls, path: str | Path) -> Tokenizer:
        """The SentencePiece model(s) of ``tokenizer.reuse``: a ``.model`` file (joint) or an mt
        checkpoint (a zip written by ``torch.save``; its embedded models, joint or a pair);
        TokenizerError for a missing file, or one that is neither."""
        path = Path(path)
        if not path.is_file():
            raise TokenizerError(f"tokenizer.reuse={path}: no such file")
        if zipfile.is_zipfile(path):
            import torch  # only here: the tokenizer needs torch for checkpoints alone

            try:
                ckpt = torch.load(path, map_location="cpu", weights_only=True)
                blobs = [t.numpy().tobytes() for t in ckpt["tokenizer"]["models"]]
            except (RuntimeError, KeyError, TypeError) as err:
                raise TokenizerError(
                    f"tokenizer.reuse={path}: not an mt checkpoint with a tokenizer ({err})"
                ) from err
        else:
            blobs = [path.read_bytes()]
        try:
            return cls.from_bytes(blobs)
        except TokenizerError as err:
            raise TokenizerError(f"tokenizer.reuse={path}: {err}") from err

    @classmethod
    def from_bytes(cls, blobs: list[bytes]) -> Tokenizer:
        """Rebuild from :meth:`to_bytes` (what a checkpoint embeds)."""
        models = []
        for blob in blobs:
            try:
                models.append(spm.SentencePieceProcessor(model_proto=bytes(blob)))
            except (RuntimeError, OSError) as err:
                raise TokenizerError(f"not a SentencePiece model: {err}") from err
        return cls(models)

    def to_bytes(self) -> list[bytes]:
        """The serialized model(s), so a checkpoint is self-contained (:func:`canonical_model`:
        equal bytes, equal tokenizers)."""
        return [canonical_model(sp.serialized_model_proto()) for sp in self.models]

    def sha256(self) -> str:
        """One hex digest of the model bytes: equal digests, identical pieces and ids."""
        parts = b"".join(hashlib.sha256(b).digest() for b in self.to_bytes())
        return hashlib.sha256(parts).hexdigest()

    def save(self, out_dir: str | Path) -> list[Path]:
        """Write the model file(s) into ``out_dir``; returns their paths (for :meth:`load`)."""
        names = ["spm.model"] if self.joint else ["spm.src.model", "spm.tgt.model"]
        paths = [Path(out_dir) / n for n in names]
        for path, blob in zip(paths, self.to_bytes()):
            write_bytes(path, blob)
        return paths

    @property
    def joint(self) -> bool:
        return len(self.models) == 1

    @property
    def vocab_size(self) -> int:
        """Joint: the model's size; separate: the larger of the two (one id space per side)."""
        return max(sp.vocab_size() for sp in self.models)

    def model(self, side: str) -> spm.SentencePieceProcessor:
        """The SentencePiece processor for ``side`` ("src" or "tgt")."""
        if side not in SIDES:
            raise ValueError(f"side must be 'src' or 'tgt', got {side!r}")
        return self.models[0 if self.joint or side == "src" else 1]

    @staticmethod
    def normalize(text: str) -> str:
        """The pipeline's normalisation applied before encoding: Unicode NFC, then strip."""
        return normalize_line(text)

    def encode(self, texts: list[str], side: str = "src") -> list[list[int]]:
        """Piece ids of each text, no BOS/EOS. Texts should already be :meth:`normalize`-d."""
        return self.model(side).encode(list(texts), out_type=int)

    def sample(self, texts: list[str], side: str, alpha: float, seed: int) -> list[list[int]]:
        """:meth:`encode` with subword regularisation: each text split into one of its
        segmentations drawn at random (BPE-dropout, Provilkov et al. 2020, for a ``bpe`` model:
        each merge skipped with probability ``alpha``; for a ``unigram`` model, a segmentation
        drawn from the model's distribution smoothed by ``alpha``, Kudo 2018). The pieces
        decode to the same text as :meth:`encode`'s.

        ``seed`` seeds SentencePiece's generator for this call (its generator is per thread, on
        a thread of its own here): the same call in one process draws the same pieces, but
        SentencePiece 0.2 draws other pieces in another process from the same seed, so a draw
        is kept (``mt.data.build.encode_sampled``), never repeated.
        """
        spm.set_random_generator_seed(seed)
        return self.model(side).encode(
            list(texts), out_type=int, enable_sampling=True, alpha=alpha, nbest_size=-1,
            num_threads=1,
        )  # fmt: skip

    def decode(self, ids: list[list[int]], side: str = "tgt") -> list[str]:
        """Text of each id sequence: stops at the first EOS, drops PAD and BOS.

        A piece that decodes to a line break (byte fallback, user symbols) gives a space
        instead, so one sentence is always one line wherever the text goes (translation
        files, mt-translate's output, BLEU).
        """
        clean = []
        for seq in ids:
            seq = [int(i) for i in seq]
            if EOS in seq:
                seq = seq[: seq.index(EOS)]
            clean.append([i for i in seq if i != PAD and i != BOS])
        return [one_line(text) for text in self.model(side).decode(clean)]

    def target_langs(self) -> list[str]:
        """The languages a many-direction model writes: the ``<2xx>`` pieces of its source
        vocabulary (``data.directions`` adds them as user symbols); empty for one direction."""
        sp = self.model("src")
        tags = map(LANG_TAG.fullmatch, map(sp.id_to_piece, range(sp.get_piece_size())))
        return sorted(match[1] for match in tags if match)

    def pieces(self, text: str, side: str = "src") -> list[str]:
        """The pieces of one text (for inspection and attention plots)."""
        return self.model(side).encode(text, out_type=str)
