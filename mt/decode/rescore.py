"""``mt-score``: the model's log-probability of given translations, for filtering and reranking.

``mt-score checkpoint=PATH src=FILE tgt=FILE [output=FILE]`` writes one line per sentence pair,
``<log-prob>\t<tokens>\t<log-prob per token>``, where the log-prob is
``log p(target pieces + EOS | source)`` summed over the target's SentencePiece pieces and its
EOS (``tokens`` of them), teacher-forced; it is what beam search reports as a hypothesis'
``logprob``. The log ends with the totals. ``checkpoint=[a.pt,b.pt]`` scores with an ensemble.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import sys
from typing import Any

from mt.decode.translate import CHUNK_LINES, chunks, load_translator
from mt.files import atomic_text_output, read_lines
from mt.schema import Config

log = logging.getLogger(__name__)


def score_main(cfg: Config, exporter: Any = None) -> dict[str, float]:
    """Score ``args.tgt`` given ``args.src``; returns the totals (``exporter``: see
    mt.decode.translate.Translator). A missing setting or file, an unusable checkpoint or files
    with different numbers of lines exit with a one-line error."""
    args = cfg.score
    if not args.src or not args.tgt:
        raise SystemExit("mt-score: set src=FILE and tgt=FILE (one sentence per line each)")
    translator = load_translator(cfg, "score", exporter)
    total, tokens, n = 0.0, 0, 0
    try:
        with contextlib.ExitStack() as stack:
            src = read_lines(stack.enter_context(open(args.src, "rb")), args.src)
            tgt = read_lines(stack.enter_context(open(args.tgt, "rb")), args.tgt)
            out = args.output
            dst = stack.enter_context(atomic_text_output(out)) if out else sys.stdout
            pairs = itertools.zip_longest(src, tgt)
            for chunk in chunks((f"{s}\t{t}" for s, t in _checked(pairs, cfg)), CHUNK_LINES):
                sources, targets = zip(*(line.split("\t", 1) for line in chunk))
                for logprob, count in translator.score(list(sources), list(targets)):
                    dst.write(f"{logprob:.4f}\t{count}\t{logprob / count:.4f}\n")
                    total, tokens, n = total + logprob, tokens + count, n + 1
                dst.flush()
    except (OSError, ValueError) as err:  # a TextError names the file and line itself
        raise SystemExit(f"mt-score: {err}") from None
    result = {"sentences": n, "logprob": total, "tokens": tokens,
              "logprob_per_token": total / max(tokens, 1)}  # fmt: skip
    log.info("%d pairs: total log-prob %.2f over %d tokens (%.4f per token)",
             n, total, tokens, result["logprob_per_token"])  # fmt: skip
    return result


def _checked(pairs, cfg: Config):
    """(source, target) lines without newlines or tabs; an error when one file is shorter."""
    args = cfg.score
    for n, (s, t) in enumerate(pairs, start=1):
        if s is None or t is None:
            shorter = args.src if s is None else args.tgt
            raise ValueError(f"{shorter} ends at line {n - 1}, the other file goes on")
        yield s.rstrip("\r\n").replace("\t", " "), t.rstrip("\r\n").replace("\t", " ")
