"""Using a trained model: the :class:`Translator` Python API and ``mt-translate``.

A checkpoint carries its model configuration and its SentencePiece model(s), so it is all that
decoding needs:

    >>> from mt.decode.translate import Translator
    >>> t = Translator.from_checkpoint("runs/multi30k_de_en/checkpoints/best.pt")
    >>> t.translate(["Ein Hund rennt im Schnee."], beam_size=4)  # doctest: +SKIP
    ['A dog runs in the snow.']

``mt-translate`` (docs/decoding.md) translates stdin or ``input=FILE`` to stdout or
``output=FILE`` in chunks, one line per input line in input order (an empty line gives an empty
line), so an input of any size is never held in memory at once. Lines end at ``"\n"`` (or
``"\r\n"``; a lone ``"\r"`` stays inside its line); a line that is not UTF-8, holds a NUL or is
longer than the model's ``max_positions`` (unless ``decode.too_long=truncate``) is an error
naming it. ``output=FILE`` appears only complete. ``decode.nbest=N > 1`` writes Moses n-best
lines ``<line index from 0> ||| <translation> ||| <score>``. From a terminal (or with
``interactive=true``) each line is translated as soon as it is read. ``engine=`` picks who
decodes: see mt.decode.engine.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import sys
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, TextIO

import torch

from mt.checkpoint import CheckpointError, load_model
from mt.data.tokenizer import TokenizerError, lang_tag
from mt.decode import engine as engines
from mt.decode.alignment import alignments, attention_map, plot_attention
from mt.decode.driver import fit_to_model, score_ids, translate_nbest
from mt.decode.ensemble import Ensemble
from mt.decode.search import Hypothesis
from mt.decode.shortlist import resolve_shortlist
from mt.distributed import resolve_device
from mt.files import TextError, atomic_text_output, read_lines
from mt.schema import Config, DecodeConfig, EngineConfig

log = logging.getLogger(__name__)

CHUNK_LINES = 2048  # lines read, translated and written at a time by mt-translate


class Translator:
    """A model, its tokenizer and decoding settings: text in, text out.

    ``model`` is an mt Transformer (eval mode, on ``device``) or an mt.decode.ensemble.Ensemble
    of them (attention maps and alignments then come from its first member); ``decode_cfg``
    the default search (DecodeConfig's when None); ``engine`` who decodes (mt.decode.engine;
    None: torch). CTranslate2 converts ``checkpoint``, the file the model came from, with
    ``exporter``: ``mt.export.ct2`` (its ``check_exportable`` and ``export_ct2``), which the
    commands get from mt.cli, as mt.export sits above mt.decode (None: torch decodes).
    ``node``: the command's settings node, for messages (``translate``, ``serve``, ``score``).
    """

    def __init__(self, model, tokenizer, device="cpu", decode_cfg: DecodeConfig | None = None,
                 engine: EngineConfig | None = None, checkpoint: str | Path | None = None,
                 node: str = "translate", exporter: Any = None):  # fmt: skip
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.device = torch.device(device)
        self.decode_cfg = decode_cfg or DecodeConfig()
        self.max_positions = model.max_positions
        self.engine_cfg = engine or EngineConfig(engine="torch")
        self.checkpoint = checkpoint
        self.node = node
        self.exporter = exporter
        self._ct2: dict[tuple, Any] = {}  # CTranslate2 translators, by shortlist settings

    @property
    def single_model(self):
        """The Transformer attention is drawn from: the model, or an ensemble's first member."""
        return self.model.members[0] if isinstance(self.model, Ensemble) else self.model

    @classmethod
    def from_checkpoint(
        cls,
        path: str | Path | list[str | Path],
        device: str = "cpu",
        decode_cfg: DecodeConfig | None = None,
        engine: EngineConfig | None = None,
        node: str = "translate",
        exporter: Any = None,
    ) -> Translator:
        """Load a checkpoint written by mt-train, or a list of them as an ensemble (their
        log-probabilities averaged at each step; they must share one tokenizer). CheckpointError:
        a file is missing, not a checkpoint, truncated, its model and vocabulary do not fit
        together, or ensemble members have different tokenizers."""
        if isinstance(path, (list, tuple)) and len(path) == 1:
            path = path[0]
        if isinstance(path, (list, tuple)):
            members = [cls.from_checkpoint(p, device, decode_cfg) for p in path]
            first = members[0].tokenizer.to_bytes()
            for p, member in zip(path[1:], members[1:]):
                if member.tokenizer.to_bytes() != first:
                    raise CheckpointError(
                        f"{p}: its tokenizer differs from {path[0]}'s; an ensemble needs "
                        f"checkpoints trained with one tokenizer"
                    )
            ensemble = Ensemble([m.model for m in members])
            return cls(ensemble, members[0].tokenizer, device, decode_cfg, engine, None, node)
        try:
            model, tokenizer, ckpt = load_model(path, device)
        except TokenizerError as err:
            raise CheckpointError(f"{path}: the embedded tokenizer is unusable: {err}") from err
        if tokenizer.vocab_size != int(ckpt["vocab_size"]):
            raise CheckpointError(
                f"{path}: its tokenizer has {tokenizer.vocab_size} pieces but the model was "
                f"built for a vocabulary of {ckpt['vocab_size']}: different vocabularies"
            )
        log.info("loaded %s (step %s) on %s", path, ckpt.get("step"), device)
        return cls(model, tokenizer, device, decode_cfg, engine, path, node, exporter)

    def _model_problem(self) -> str | None:
        """Why CTranslate2 cannot take this model, or None."""
        if self.checkpoint is None:
            return "the model did not come from a checkpoint file"
        if self.exporter is None:
            return "no exporter to convert it with: Translator(exporter=mt.export.ct2)"
        try:
            self.exporter.check_exportable(self.single_model.cfg, self.tokenizer.joint,
                                           "ctranslate2")  # fmt: skip
        except ValueError as err:  # mt.export.hf.ExportError
            return str(err)
        return None

    def engine(self, cfg: DecodeConfig, prefix: bool = False) -> Any:
        """The engine of a request with settings ``cfg``: None for torch (mt's search), or the
        CTranslate2 engine (mt.decode.ctranslate2_engine), made on first use (the checkpoint
        converted once). The choice is logged once per engine and reason; EngineError:
        ``engine=ctranslate2`` with what it cannot run."""
        e = self.engine_cfg
        choice = engines.choose(
            e.engine, e.compute_type, self.device, engines.ct2_available(),
            beam_size=cfg.beam_size, sample=cfg.sample, prefix=prefix,
            ensemble=isinstance(self.model, Ensemble),
            model_problem=None if e.engine == "torch" else self._model_problem(),
            node=self.node,
        )  # fmt: skip
        engines.tell(choice.engine, choice.reason)
        if choice.engine == "torch":
            return None
        shortlist = None
        if cfg.shortlist:
            shortlist = (str(cfg.shortlist), cfg.shortlist_k, cfg.shortlist_frequent)
        key = (choice.device, choice.index, choice.compute_type, shortlist)
        if key not in self._ct2:
            from mt.decode.ctranslate2_engine import CTranslate2Engine

            inter, intra = (1, 1) if choice.device == "cuda" else engines.threads(
                e.inter_threads, e.intra_threads, torch.get_num_threads())  # fmt: skip
            self._ct2[key] = CTranslate2Engine(
                self.checkpoint, self.exporter, self.tokenizer, self.max_positions, choice.device,
                choice.index, choice.compute_type, inter, intra, shortlist,
            )  # fmt: skip
        return self._ct2[key]

    def settings(self, **overrides: Any) -> DecodeConfig:
        """The decode settings with keyword overrides (None values are ignored)."""
        changes = {k: v for k, v in overrides.items() if v is not None}
        return dataclasses.replace(self.decode_cfg, **changes)

    def _ids(self, texts: list[str], side: str) -> list[list[int]]:
        return self.tokenizer.encode([self.tokenizer.normalize(t) for t in texts], side=side)

    def encode(self, sentences: list[str], cfg: DecodeConfig, first_line: int = 1):
        """Source ids of each sentence, checked (or truncated) against ``max_positions``."""
        ids = self._ids(sentences, "src")
        return fit_to_model(ids, self.max_positions, cfg.too_long, first_line, "input")

    def translate_nbest(
        self,
        sentences: list[str],
        first_line: int = 1,
        prefix: list[str] | None = None,
        **overrides: Any,
    ) -> list[list[tuple[str, float]]]:
        """``decode.nbest`` (translation, score) pairs per sentence, best first.

        Empty (or all-space) sentences give ``[("", 0.0)]`` without decoding. ``prefix``: one
        target text per sentence that its translations must start with ("" for none).
        """
        cfg = self.settings(**overrides)
        keep = [i for i, s in enumerate(sentences) if self.tokenizer.normalize(s)]
        out: list[list[tuple[str, float]]] = [[("", 0.0)] for _ in sentences]
        if not keep:
            return out
        every = self.encode(sentences, cfg, first_line)  # errors name the caller's lines
        ids = [every[i] for i in keep]
        indices = [first_line - 1 + i for i in keep]  # sampling seeds follow the line number
        forced = None if prefix is None else self._ids([prefix[i] for i in keep], "tgt")
        ct2 = self.engine(cfg, bool(forced and any(forced)))
        if ct2 is not None:
            results: list[list[Hypothesis]] = ct2.translate_nbest(ids, cfg, forced)
        else:
            results = translate_nbest(self.model, ids, cfg, self.device, prefix=forced,
                                      indices=indices)  # fmt: skip
        for i, hyps in zip(keep, results):
            texts = self.tokenizer.decode([h.tokens for h in hyps], side="tgt")
            out[i] = [(text, h.score) for text, h in zip(texts, hyps)]
        return out

    def translate(
        self,
        sentences: list[str],
        first_line: int = 1,
        prefix: list[str] | None = None,
        **overrides: Any,
    ) -> list[str]:
        """The best translation of each sentence, in input order ("" for an empty one).

        ``**overrides`` (any DecodeConfig field: ``beam_size``, 1 for greedy, ``alpha``, ...)
        default to the Translator's decode settings. ``first_line`` is the line number of
        ``sentences[0]`` in error messages (a sentence longer than ``max_positions`` is a
        ValueError unless ``too_long=truncate``) and, with ``sample=True``, seeds each
        sentence's draw with ``seed``. ``prefix``: one target text per sentence that its
        translation must start with ("" for none).
        """
        nbest = self.translate_nbest(sentences, first_line, prefix, nbest=1, **overrides)
        return [hyps[0][0] for hyps in nbest]

    def attention(self, sentence: str, **overrides: Any) -> tuple[list[str], list[str], Any]:
        """Translate one sentence and return its encoder-decoder attention: ``(src_pieces (S),
        tgt_pieces (T), matrix (T, S))`` (see mt.decode.alignment.attention_map)."""
        cfg = self.settings(**overrides)
        self.encode([sentence], cfg)  # the too_long check
        return attention_map(self.single_model, self.tokenizer, sentence, cfg, self.device)

    def _pairs(self, sentences: list[str], translations: list[str]):
        """Source and target ids of sentence pairs, cut to the model's ``max_positions``."""
        src, tgt = self._ids(sentences, "src"), self._ids(translations, "tgt")
        limit = self.max_positions
        return fit_to_model(src, limit), fit_to_model(tgt, limit, what="target")

    def alignments(
        self, sentences: list[str], translations: list[str], layer: int = -1
    ) -> list[str]:
        """Word alignments of sentence pairs, one Pharaoh line (``i-j ...``) each, from decoder
        layer ``layer``'s cross-attention averaged over heads."""
        src, tgt = self._pairs(sentences, translations)
        return alignments(self.single_model, self.tokenizer, src, tgt, self.device, layer)

    def score(self, sentences: list[str], translations: list[str]) -> list[tuple[float, int]]:
        """Per pair, ``(log p(translation + EOS | source), tokens scored)``: the sum of the
        teacher-forced log-probabilities of its pieces and the final EOS."""
        src, tgt = self._pairs(sentences, translations)
        ct2 = self.engine(self.decode_cfg)
        if ct2 is not None:
            per_token = ct2.score(src, tgt, self.decode_cfg)
        else:
            per_token = score_ids(self.model, src, tgt, self.device, self.decode_cfg.batch_size)
        return [(sum(lp), len(lp)) for lp in per_token]


def chunks(lines: Iterable[str], size: int) -> Iterator[list[str]]:
    """Successive lists of at most ``size`` lines (without their newline)."""
    lines = iter(lines)
    while chunk := [line.rstrip("\r\n") for line in itertools.islice(lines, size)]:
        yield chunk


def translate_stream(
    translator: Translator,
    src: TextIO,
    dst: TextIO,
    cfg: DecodeConfig,
    interactive: bool = False,
    prefixes: Iterator[str] | None = None,
    alignment: TextIO | None = None,
    alignment_layer: int = -1,
) -> int:
    """Translate ``src`` line by line into ``dst`` in chunks of ``CHUNK_LINES`` (one line
    with ``interactive``: a terminal answered as it types); returns the number of lines.
    ``prefixes``: one forced target start per input line; ``alignment``: where to write a
    Pharaoh line per input line (of its best translation; ``alignment_layer``: see
    Translator.alignments)."""
    n, start = 0, time.perf_counter()
    size = 1 if interactive else max(CHUNK_LINES, cfg.batch_size)
    for chunk in chunks(src, size):  # reading a line waits for that line only
        prefix = None
        if prefixes is not None:
            prefix = [line.rstrip("\r\n") for line in itertools.islice(prefixes, len(chunk))]
            if len(prefix) < len(chunk):
                raise ValueError(
                    f"the prefix file has fewer lines ({n + len(prefix)}) than the input"
                )
        if cfg.nbest > 1:
            nbest = translator.translate_nbest(chunk, first_line=n + 1, prefix=prefix)
            for k, hyps in enumerate(nbest):
                dst.writelines(f"{n + k} ||| {text} ||| {score:.4f}\n" for text, score in hyps)
            best = [hyps[0][0] for hyps in nbest]
        else:
            best = translator.translate(chunk, first_line=n + 1, prefix=prefix)
            dst.writelines(t + "\n" for t in best)
        dst.flush()
        if alignment is not None:
            alignment.writelines(
                a + "\n" for a in translator.alignments(chunk, best, alignment_layer)
            )
            alignment.flush()
        n += len(chunk)
        level = logging.DEBUG if interactive else logging.INFO  # a terminal shows the answers
        log.log(level, "%d lines translated (%.1f lines/s)", n, n / (time.perf_counter() - start))
    return n


def load_translator(
    cfg: Config, node: str, exporter: Any = None, prefix: bool = False
) -> Translator:
    """The Translator of ``mt-<node>`` (translate, serve, score) from ``<node>.checkpoint``
    (default: the run's best.pt) on ``train.device``, with ``decode.shortlist=train`` resolved
    to its lexicon and the engine's settings checked (and a conversion made) before any input
    is read; an unusable checkpoint or engine setting exits with a one-line error."""
    args = getattr(cfg, node)
    path = args.checkpoint or Path(cfg.run_dir) / "checkpoints/best.pt"
    if cfg.train.threads > 0:
        torch.set_num_threads(cfg.train.threads)
    device = resolve_device(cfg.train.device)
    try:
        translator = Translator.from_checkpoint(path, device, cfg.decode, args, node, exporter)
        translator.decode_cfg = resolve_shortlist(cfg, translator.tokenizer).decode
        translator.engine(translator.decode_cfg, prefix)
    except (CheckpointError, engines.EngineError) as err:
        raise SystemExit(f"mt-{node}: {err}") from None
    return translator


def translate_main(cfg: Config, exporter: Any = None) -> None:
    """``mt-translate``: stdin or ``input=`` to stdout or ``output=`` with ``checkpoint=``
    (``exporter``: see Translator).

    Exits with a one-line error (no traceback) for an unusable checkpoint, a missing input file
    or a line too long for the model.
    """
    args = cfg.translate
    translator = load_translator(cfg, "translate", exporter, bool(args.prefix))
    tag = target_tag(translator.tokenizer.target_langs(), args.target_lang)
    name = args.input or "stdin"
    try:
        with contextlib.ExitStack() as stack:
            raw = stack.enter_context(open(args.input, "rb")) if args.input else sys.stdin.buffer
            out = args.output
            dst = stack.enter_context(atomic_text_output(out)) if out else sys.stdout
            interactive = args.interactive if args.interactive is not None else _is_tty(raw)
            prefixes = alignment = None
            if args.prefix:
                prefixes = read_lines(stack.enter_context(open(args.prefix, "rb")), args.prefix)
            if args.alignment:
                alignment = stack.enter_context(atomic_text_output(args.alignment))
            first: list[str] = []
            lines = read_lines(raw, name)
            if tag:  # as mt-prepare wrote the sources of data.directions
                lines = (f"{tag} {line}" if line.strip() else line for line in lines)
            lines = _remember_first(lines, first, translator)
            n = translate_stream(
                translator, lines, dst, translator.decode_cfg, interactive, prefixes, alignment,
                args.alignment_layer,
            )  # fmt: skip
            if args.attention:
                _draw_attention(translator, first, args.attention)
    except TextError as err:  # names the file and line itself
        raise SystemExit(f"mt-translate: {err}") from None
    except (OSError, ValueError) as err:
        raise SystemExit(f"mt-translate: {name}: {err}") from None
    log.info("%d lines translated to %s", n, args.output or "stdout")


def target_tag(langs: list[str], lang: str | None) -> str | None:
    """The token ``translate.target_lang`` puts before each source line, for a model that
    writes ``langs`` (``Tokenizer.target_langs``; None for a one-direction model). A language
    it does not write, or none chosen for a model of many, is a one-line exit."""
    if lang is None and not langs:
        return None
    if lang is None:
        raise SystemExit(f"mt-translate: the model writes {', '.join(langs)}: choose one with "
                         "translate.target_lang=LANG")  # fmt: skip
    if lang not in langs:
        has = ", ".join(langs) if langs else "one language (trained without data.directions)"
        raise SystemExit(f"mt-translate: translate.target_lang={lang}: the model has no such "
                         f"language; it writes {has}")  # fmt: skip
    return lang_tag(lang)


def _is_tty(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def _remember_first(lines: Iterable[str], first: list[str], translator) -> Iterator[str]:
    """Pass lines through, keeping the first non-empty one in ``first`` (for the heatmap)."""
    for line in lines:
        if not first and translator.tokenizer.normalize(line):
            first.append(line)
        yield line


def _draw_attention(translator: Translator, first: list[str], path: str) -> None:
    """Heatmap of the first non-empty input sentence's encoder-decoder attention."""
    if not first:
        log.warning("attention=: the input has no non-empty line; nothing drawn")
        return
    plot_attention(*translator.attention(first[0]), path)
    log.info("attention of the first sentence drawn in %s", path)
