"""Back-translation, ``mt-backtranslate``: monolingual target-side text in, a synthetic parallel
corpus out (Sennrich et al. 2016; Edunov et al. 2018; the commands: docs/data.md).

A reverse model (trained target -> source) translates monolingual text of the target language;
each translation becomes a synthetic source paired with the real sentence it came from, written
as ``<output>/<name>.<src_lang>`` and ``<output>/<name>.<tgt_lang>`` (a text corpus like any
other) plus ``<name>.json`` saying how it was made, for the forward model to mix in at a weight
(``data.splits.train=[train,{name:...,weight:0.5}]``).

The synthetic sources come from ``decode.*``: ``decode=sample`` draws them (unrestricted
sampling, the best of Edunov et al.'s methods at scale); ``noise=true`` adds their noise to a
beam's output (:func:`add_noise`). ``tag=<BT>`` starts each synthetic source with a tag (Caswell
et al. 2019); give the forward run ``tokenizer.user_symbols=[<BT>]`` so that it is one piece.

The configuration's ``data`` is the forward task's (``src_lang`` -> ``tgt_lang``); the input
must be in ``tgt_lang``. A file named ``*.<src_lang>``, or whose words match the source side
of the task's valid set far better than its target side, is refused with one line.
"""

from __future__ import annotations

import itertools
import logging
import re
import time
import unicodedata
from collections import Counter
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np
import torch

from mt.data.corpus import DataError, open_corpus, read_lines, split_names
from mt.data.tokenizer import Tokenizer
from mt.decode.driver import translate_ids
from mt.decode.translate import CHUNK_LINES, Translator, chunks
from mt.distributed import resolve_device
from mt.files import atomic_text_output, write_json
from mt.schema import Config

log = logging.getLogger(__name__)

PROFILE_WORDS = 200  # the most frequent words of each side that tell the languages apart
SAMPLE_LINES = 2000  # lines of an input file that the language check reads
_WORD = re.compile(r"\w+", re.UNICODE)


def add_noise(
    words: list[str], rng: np.random.Generator, drop: float = 0.1, blank: float = 0.1,
    shuffle: float = 3.0, filler: str = "<blank>",
) -> list[str]:  # fmt: skip
    """Edunov et al. (2018)'s noise on a synthetic source: a shuffle in which no word moves
    ``shuffle`` or more positions (positions + U(0, shuffle), sorted), then each word deleted
    with probability ``drop`` (one is always kept) and replaced by ``filler`` with ``blank``."""
    if not words:
        return []
    order = np.argsort(np.arange(len(words)) + rng.uniform(0, shuffle, len(words)), kind="stable")
    words = [words[i] for i in order]
    keep = rng.random(len(words)) >= drop
    if not keep.any():
        keep[rng.integers(len(words))] = True
    blanks = rng.random(len(words)) < blank
    return [filler if b else w for w, k, b in zip(words, keep, blanks) if k]


def printable(text: str) -> str:
    """``text`` without control characters (a sampled byte piece can be a NUL or a bell), tabs
    as spaces: a synthetic source is read back as a text corpus."""
    if text.isprintable():
        return text
    return "".join(" " if c == "\t" else c for c in text
                   if c == "\t" or unicodedata.category(c) != "Cc")  # fmt: skip


def _words(line: str) -> list[str]:
    return [w.lower() for w in _WORD.findall(line) if not w.isdigit()]


def language_profiles(pairs: Iterable[tuple[str, str]]) -> tuple[set[str], set[str]]:
    """The frequent words of each side that the other side does not share: ``(source words,
    target words)``, from parallel text (the task's valid set)."""
    counts = (Counter(), Counter())
    for src, tgt in pairs:
        counts[0].update(_words(src))
        counts[1].update(_words(tgt))
    tops = [{w for w, _ in c.most_common(PROFILE_WORDS)} for c in counts]
    return tops[0] - tops[1], tops[1] - tops[0]


def side_shares(lines: Iterable[str], profiles: tuple[set[str], set[str]]) -> tuple[float, float]:
    """The shares of the words of ``lines`` among each side's profile words."""
    hits, total = [0, 0], 0
    for line in lines:
        words = _words(line)
        total += len(words)
        for side in (0, 1):
            hits[side] += sum(w in profiles[side] for w in words)
    return hits[0] / max(total, 1), hits[1] / max(total, 1)


def check_language(path: Path, cfg: Config, profiles: tuple[set[str], set[str]]) -> None:
    """Refuse a monolingual file that is not in the target language (one line naming it)."""
    src, tgt = cfg.data.src_lang, cfg.data.tgt_lang
    need = (
        f"back-translation needs text in the target language ({tgt}: the reverse model "
        f"translates {tgt} -> {src})"
    )
    if path.suffix == f".{src}" and src != tgt:
        raise DataError(f"{path}: named as the source language ({src}); {need}")
    sample = [line for _, line in zip(range(SAMPLE_LINES), read_lines(path)) if line.strip()]
    if not sample:
        raise DataError(f"{path}: no text (only empty lines); {need}")
    s, t = side_shares(sample, profiles)
    if s > 0.05 and s > 2 * t:
        raise DataError(
            f"{path}: reads as {src}, the source language ({100 * s:.0f}% of its words are "
            f"frequent {src} words of the valid set, {100 * t:.0f}% {tgt} words); {need}"
        )


def mono_lines(paths: list[Path], limit: int = 0) -> Iterator[str]:
    """The non-empty lines of the monolingual files, in order, at most ``limit`` (0: all)."""
    lines = (line for path in paths for line in read_lines(path) if Tokenizer.normalize(line))
    return itertools.islice(lines, limit or None)


def backtranslate(cfg: Config) -> dict:
    """Write the synthetic corpus of ``cfg.backtranslate`` (see the module docstring); returns
    what ``<name>.json`` records. DataError / ValueError: a missing setting or file, an input
    in the wrong language."""
    bt, data = cfg.backtranslate, cfg.data
    for key in ("checkpoint", "input", "output"):
        if not getattr(bt, key):
            raise ValueError(f"backtranslate.{key} is required (mt-backtranslate {key}=...)")
    inputs = [Path(p) for p in split_names(bt.input)]
    for path in inputs:
        if not path.is_file():
            raise DataError(f"backtranslate.input: {path} is not a file")
    if bt.check_language:
        profiles = language_profiles(open_corpus(data).pairs("valid"))
        for path in inputs:
            check_language(path, cfg, profiles)
    device = resolve_device(cfg.train.device)
    if cfg.train.threads > 0:
        torch.set_num_threads(cfg.train.threads)
    translator = Translator.from_checkpoint(bt.checkpoint, device, cfg.decode)
    out = Path(bt.output)
    src_path, tgt_path = out / f"{bt.name}.{data.src_lang}", out / f"{bt.name}.{data.tgt_lang}"
    longest = translator.max_positions - 1
    counts = {"read": 0, "too_long": 0, "empty_translation": 0, "pairs": 0}
    search = translator.settings(nbest=1)
    start = time.perf_counter()
    with atomic_text_output(src_path) as fs, atomic_text_output(tgt_path) as ft:
        for chunk in chunks(mono_lines(inputs, bt.max_lines), CHUNK_LINES):
            first = counts["read"]
            counts["read"] += len(chunk)
            ids = translator.tokenizer.encode([Tokenizer.normalize(x) for x in chunk], "src")
            fits = [i for i, x in enumerate(ids) if len(x) <= longest]
            counts["too_long"] += len(chunk) - len(fits)
            # the line number seeds each sentence's draw: the same corpus however it is cut
            indices = [first + i for i in fits]
            out_ids = translate_ids(
                translator.model, [ids[i] for i in fits], search, translator.device, indices=indices
            )
            for i, synthetic in zip(fits, translator.tokenizer.decode(out_ids)):
                synthetic = printable(synthetic)
                if not synthetic.strip():
                    counts["empty_translation"] += 1
                    continue
                if bt.noise:
                    rng = np.random.default_rng([cfg.decode.seed, first + i])
                    synthetic = " ".join(add_noise(synthetic.split(), rng, filler=bt.filler))
                if bt.tag:
                    synthetic = f"{bt.tag} {synthetic}"
                fs.write(synthetic + "\n")
                ft.write(chunk[i] + "\n")
                counts["pairs"] += 1
            rate = counts["read"] / (time.perf_counter() - start)
            log.info("%d lines back-translated (%.1f lines/s)", counts["read"], rate)
    d = cfg.decode
    method = f"beam {d.beam_size}"
    if d.sample:
        method = f"sampling (temperature {d.temperature}, top-k {d.top_k}, top-p {d.top_p})"
    method += " + noise" if bt.noise else ""
    record = {
        "corpus": str(out / bt.name), "source": str(src_path), "target": str(tgt_path),
        "languages": [data.src_lang, data.tgt_lang], "inputs": [str(p) for p in inputs],
        "reverse_checkpoint": str(bt.checkpoint), "method": method, "tag": bt.tag,
        "noise": bt.noise, "seed": d.seed, "counts": counts,
        "seconds": round(time.perf_counter() - start, 1),
    }  # fmt: skip
    write_json(out / f"{bt.name}.json", record)
    log.info(
        "synthetic corpus %s: %d pairs from %d lines (%s; %d too long, %d empty translations)%s",
        out / bt.name, counts["pairs"], counts["read"], method, counts["too_long"],
        counts["empty_translation"],
        f"; train with tokenizer.user_symbols=[{bt.tag}] so the tag is one piece" if bt.tag
        else "",
    )  # fmt: skip
    return record


def backtranslate_main(cfg: Config) -> None:
    """``mt-backtranslate``: the synthetic corpus, and the command line that trains with it."""
    record = backtranslate(cfg)
    log.info(
        "mix it in: data.splits.train=[...,{name:%s,weight:W}]", Path(record["corpus"]).resolve()
    )
