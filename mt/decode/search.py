"""Search over a trained Transformer: greedy, beam and sampling, batched over sentences.

The loop (:func:`generate`) runs the encoder once, then the decoder one token per step for all
sentences and beams of a batch in one call, using only :class:`IncrementalDecoder` (so stub
models with hand-set probabilities can test it); a *strategy* (``mt.decode.strategies``) decides
which candidates survive a step, and ``mt.decode.rows.Rows`` keeps the hypotheses' tokens,
scores and model state rows. It is the readable reference that every other engine is held to,
and the path on a GPU.

Conventions (the paper's, made exact):

* Length penalty: ``lp(Y) = |Y| ** alpha`` where ``|Y|`` counts the output tokens *including*
  the final EOS when the hypothesis has one. A hypothesis' score is ``sum(log p(y_t)) / lp(Y)``,
  the sum including the EOS log-probability. This is CTranslate2's normalisation (its
  ``length_penalty``, hypotheses counted with their EOS, no coverage penalty), which fairseq
  and transformers compute too, so every engine ranks hypotheses alike (GNMT's
  ``((5 + |Y|) / 6) ** alpha`` is computed by none of them).
* Maximum length: ``max_len = int(a * src_len + b)`` where ``src_len`` is the number of source
  tokens *without* the EOS appended to every source (and without padding), capped at the model's
  ``max_positions``. Every hypothesis has ``|Y| <= max_len``: a hypothesis that reaches
  ``max_len`` tokens without EOS is finalised as it is (no EOS, no EOS log-probability).
* A candidate ending in EOS becomes a finished hypothesis only when it ranks within the top
  ``beam_size`` candidates of its step; the ``beam_size`` best candidates not ending in EOS
  continue. A sentence's search ends when ``beam_size`` hypotheses are finished (so beam 1 is
  exactly greedy search) or at its maximum length, where its unfinished beams are finalised.
  It ends sooner, with the same n-best list, once no live hypothesis can enter it: scores only
  fall as tokens are added (log-probabilities are <= 0), so a live hypothesis of summed
  log-probability ``L`` can finish with at most ``L / lp(max_len)``; when the ``nbest``-th
  finished score is at least that bound for every live hypothesis, the sentence is settled
  (without a length penalty: when the best live hypothesis scores below the n-best, the stop
  CTranslate2 makes when its best hypothesis is finished).
* PAD and BOS are never generated; ``min_len`` forbids EOS until that many tokens are out
  (benchmarks use it to force the output length); a ``prefix`` forces the first tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from mt.decode.rows import Rows
from mt.decode.shortlist import Shortlist
from mt.decode.strategies import NEG_INF, Beam, Greedy, Sampling
from mt.schema import DecodeConfig
from mt.vocab import BOS, EOS, PAD


class IncrementalDecoder(Protocol):
    """What search needs of a model (``mt.model.transformer.Transformer``,
    ``mt.decode.ensemble.Ensemble`` and the tests' stub models provide it).

    ``encode(src)`` returns the encoder state, whose ``select(sents)`` keeps some sentences;
    ``new_cache()`` an empty decoder state with ``select(rows, sents)`` and ``copy_rows(dst,
    src)`` (see ``mt.model.kv_cache.DecoderCache``); ``decode(tgt_in, enc, cache)`` the logits
    (B, T, V) of T new tokens per row, where the B rows may hold G consecutive rows per
    encoder row (the K beams of a sentence share its encoder state). With a shortlist
    (``mt.decode.shortlist``) search calls ``decode(tgt_in, enc, cache, vocab=shortlist)`` and
    takes (B, T, C) logits over its C columns.
    """

    max_positions: int | None

    def encode(self, src: torch.Tensor) -> Any: ...

    def new_cache(self) -> Any: ...

    def decode(self, tgt_in: torch.Tensor, enc: Any, cache: Any) -> torch.Tensor: ...


@dataclass
class Hypothesis:
    """One output of the search: ``tokens`` without BOS and EOS, ``score`` its summed token
    log-probabilities (``logprob``, EOS included when generated) over the length penalty."""

    tokens: list[int]
    score: float
    logprob: float = 0.0


def length_penalty(length: int, alpha: float) -> float:
    """The length penalty ``length ** alpha`` (``length`` counts EOS when present), as
    CTranslate2 divides a finished hypothesis' log-probability (see the module docstring)."""
    return float(length) ** alpha


def max_length(src_len: int, a: float, b: float, cap: int | None) -> int:
    """The maximum output length ``int(a * src_len + b)`` of a source of ``src_len`` ids
    (without EOS), at least 1, at most ``cap`` (the model's ``max_positions``; None: none)."""
    return max(1, min(cap or 1 << 30, int(a * src_len + b)))


def max_lengths(src: torch.Tensor, a: float, b: float, model: IncrementalDecoder) -> list[int]:
    """:func:`max_length` of each sentence of ``src`` (B, S) (rows ``ids + EOS``, PAD-padded)."""
    src_len = ((src != PAD).sum(dim=1) - 1).clamp(min=0).tolist()
    return [max_length(n, a, b, model.max_positions) for n in src_len]


def _hyp(tokens: torch.Tensor, logprob: float, length: int, alpha: float) -> Hypothesis:
    """A hypothesis from a token row ``BOS y_1 .. y_t`` (BOS dropped)."""
    return Hypothesis(tokens[1:].tolist(), logprob / length_penalty(length, alpha), logprob)


# ---- the loop ------------------------------------------------------------------------------


def _next_lprobs(
    model: IncrementalDecoder,
    rows: Rows,
    step: int,
    min_len: int,
    prefix: torch.Tensor | None,
    shortlist: Shortlist | None = None,
) -> torch.Tensor:
    """Log-probabilities (n, width, V) of the next token of each model row.

    PAD and BOS are forbidden, EOS before ``min_len``; where ``prefix`` (B, P) holds a token
    (>= 0) for this step, every other token is forbidden. With a ``shortlist`` the last
    dimension is its columns (C), and ``prefix`` holds columns.
    """
    if shortlist is None:
        logits = model.decode(rows.last, rows.enc, rows.cache)
    else:  # (N, 1, C) over the shortlist's columns
        logits = model.decode(rows.last, rows.enc, rows.cache, vocab=shortlist)
        logits = shortlist.restrict(logits, rows.sents, rows.width)
    lprobs = F.log_softmax(logits[:, -1].float(), dim=-1)  # (N, V)
    lprobs[:, PAD] = NEG_INF
    lprobs[:, BOS] = NEG_INF
    if step < min_len:
        lprobs[:, EOS] = NEG_INF
    if prefix is not None and step < prefix.size(1):
        sents = torch.tensor(rows.sents, device=prefix.device).repeat_interleave(rows.width)
        forced = prefix[sents, step].to(lprobs.device)  # (N,)
        rows_forced = (forced >= 0).nonzero().squeeze(1)
        if rows_forced.numel():
            tok = forced[rows_forced]
            kept = lprobs[rows_forced, tok]
            lprobs[rows_forced] = NEG_INF
            lprobs[rows_forced, tok] = kept
    return lprobs.view(len(rows.sents), rows.width, -1)


def prefix_tensor(prefixes: list[list[int]] | None, device: Any = "cpu") -> torch.Tensor | None:
    """(B, P) forced tokens per sentence, -1 where the search is free; None without prefixes."""
    if not prefixes or not any(prefixes):
        return None
    rows = [torch.tensor(p, dtype=torch.long) for p in prefixes]
    return torch.nn.utils.rnn.pad_sequence(rows, batch_first=True, padding_value=-1).to(device)


@torch.inference_mode()
def generate(
    model: IncrementalDecoder,
    src: torch.Tensor,
    strategy: Beam | Greedy | Sampling,
    max_len_a: float = 1.0,
    max_len_b: float = 50,
    nbest: int = 1,
    min_len: int = 0,
    alpha: float = 0.0,
    prefix: list[list[int]] | None = None,
    settle: bool = True,
    shortlist: Shortlist | None = None,
) -> list[list[Hypothesis]]:
    """Search a batch of sentences with ``strategy``.

    Args:
        model: see :class:`IncrementalDecoder` (in eval mode: dropout is the caller's choice).
        src: (B, S) source ids (``ids + EOS``, PAD-padded).
        strategy: which candidates survive each step; ``strategy.K`` hypotheses per sentence.
        max_len_a, max_len_b, alpha, min_len: see the module docstring.
        nbest: hypotheses returned per sentence (at most K), best first, in input order.
        prefix: per sentence, output tokens forced at the start (the rest is searched).
        settle: end a sentence once no live hypothesis can enter its n-best list (the same
            result, fewer steps; see the module docstring). False: only at ``K`` finished
            hypotheses or the maximum length (fairseq's stop).
        shortlist: search only this batch's candidate pieces (``mt.decode.shortlist``; the
            model's ``decode`` takes it as ``vocab``); None: the whole vocabulary.
    """
    K = strategy.K
    if not 1 <= nbest <= K:
        raise ValueError(f"nbest must be between 1 and beam_size={K}, got {nbest}")
    limits = max_lengths(src, max_len_a, max_len_b, model)
    forced = prefix_tensor(prefix, src.device)
    if forced is not None and shortlist is not None:
        forced = shortlist.columns(forced)
    rows = Rows(model, src, K)
    finished: list[list[Hypothesis]] = [[] for _ in range(src.size(0))]
    step = 0
    while rows.sents:
        at_max = {i for i, s in enumerate(rows.sents) if limits[s] <= step}
        if at_max:  # unfinished hypotheses are finalised as they are, without EOS
            flat = rows.scores.tolist()
            for i in at_max:
                for k, logprob in enumerate(flat[i]):
                    if logprob > NEG_INF:
                        finished[rows.sents[i]].append(_hyp(rows.hyp(i, k), logprob, step, alpha))
            rows.drop([i for i in range(len(rows.sents)) if i not in at_max])
            if not rows.sents:
                break
        if isinstance(strategy, Sampling):
            strategy.sents = rows.sents
        lprobs = _next_lprobs(model, rows, step, min_len, forced, shortlist)
        chosen = strategy.step(rows.scores, lprobs)
        step += 1
        for i, k, logprob in chosen.done:
            finished[rows.sents[i]].append(_hyp(rows.hyp(i, k), logprob, step, alpha))
        ended = {i for i, s in enumerate(rows.sents) if len(finished[s]) >= K}
        if settle and K > 1:
            ended |= _settled(rows.sents, finished, chosen.score, ended, limits, nbest, alpha)
        alive = torch.isfinite(chosen.score).any(dim=1)  # all beams dead: nothing more to find
        ended |= {i for i, a in enumerate(alive.tolist()) if not a}
        token = chosen.token if shortlist is None else shortlist.ids[chosen.token]
        rows.advance(chosen.beam, token, chosen.score)
        if ended:
            rows.drop([i for i in range(len(rows.sents)) if i not in ended])
    return [sorted(hyps, key=lambda h: -h.score)[:nbest] for hyps in finished]


def _settled(
    sents: list[int],
    finished: list[list[Hypothesis]],
    live: torch.Tensor,
    ended: set[int],
    limits: list[int],
    nbest: int,
    alpha: float,
) -> set[int]:
    """The live sentences (indices into ``sents``) whose n-best list no live hypothesis can
    enter: its ``nbest``-th finished score >= the best ``L / lp(max_len)`` of the live
    hypotheses (``live``: (n, K) summed log-probabilities, -inf: none)."""
    waiting = [i for i, s in enumerate(sents) if i not in ended and len(finished[s]) >= nbest]
    if not waiting:
        return set()
    best = live.max(dim=1).values.tolist()
    out = set()
    for i in waiting:
        s = sents[i]
        bound = best[i] / length_penalty(limits[s], alpha)  # lp >= 1 and L <= 0: the best case
        if sorted((h.score for h in finished[s]), reverse=True)[nbest - 1] >= bound:
            out.add(i)
    return out


def greedy_search(
    model: IncrementalDecoder,
    src: torch.Tensor,
    max_len_a: float = 1.0,
    max_len_b: float = 50,
    min_len: int = 0,
    alpha: float = 0.0,
    prefix: list[list[int]] | None = None,
    shortlist: Shortlist | None = None,
) -> list[Hypothesis]:
    """The most probable token at each step: one hypothesis per sentence (see :func:`generate`;
    ``alpha`` only scales the reported score)."""
    hyps = generate(model, src, Greedy(), max_len_a, max_len_b, 1, min_len, alpha, prefix,
                    shortlist=shortlist)  # fmt: skip
    return [h[0] for h in hyps]


def beam_search(
    model: IncrementalDecoder,
    src: torch.Tensor,
    beam_size: int = 4,
    alpha: float = 0.6,
    max_len_a: float = 1.0,
    max_len_b: float = 50,
    nbest: int = 1,
    min_len: int = 0,
    prefix: list[list[int]] | None = None,
    shortlist: Shortlist | None = None,
) -> list[list[Hypothesis]]:
    """Beam search of a batch, all beams of all sentences in one decoder call per step: up to
    ``nbest`` hypotheses per sentence, best first (see :func:`generate`)."""
    return generate(model, src, Beam(beam_size), max_len_a, max_len_b, nbest, min_len, alpha,
                    prefix, shortlist=shortlist)  # fmt: skip


def sample(
    model: IncrementalDecoder,
    src: torch.Tensor,
    seeds: list[int],
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    max_len_a: float = 1.0,
    max_len_b: float = 50,
    min_len: int = 0,
    alpha: float = 0.0,
    prefix: list[list[int]] | None = None,
    shortlist: Shortlist | None = None,
) -> list[Hypothesis]:
    """One sampled translation per sentence (see :class:`Sampling`); ``seeds``: one per
    sentence of ``src``; ``shortlist``: see :func:`generate`."""
    strategy = Sampling(seeds, temperature, top_k, top_p)
    hyps = generate(model, src, strategy, max_len_a, max_len_b, 1, min_len, alpha, prefix,
                    shortlist=shortlist)  # fmt: skip
    return [h[0] for h in hyps]


def search(
    model: IncrementalDecoder,
    src: torch.Tensor,
    cfg: DecodeConfig,
    min_len: int = 0,
    prefix: list[list[int]] | None = None,
    seeds: list[int] | None = None,
    shortlist: Shortlist | None = None,
) -> list[list[Hypothesis]]:
    """The search ``cfg`` asks for (sampling, greedy when ``beam_size == 1``, else beam);
    n-best lists either way. ``seeds``: per sentence, for sampling; ``shortlist``: the batch's
    candidate pieces (see :func:`generate`)."""
    a, b = cfg.max_len_a, cfg.max_len_b
    if cfg.sample:
        seeds = seeds if seeds is not None else list(range(src.size(0)))
        strategy = Sampling(seeds, cfg.temperature, cfg.top_k, cfg.top_p)
        return generate(model, src, strategy, a, b, 1, min_len, cfg.alpha, prefix,
                        shortlist=shortlist)  # fmt: skip
    if cfg.beam_size <= 1:
        hyps = greedy_search(model, src, a, b, min_len, cfg.alpha, prefix, shortlist)
        return [[h] for h in hyps]
    nbest = min(cfg.nbest, cfg.beam_size)
    return beam_search(model, src, cfg.beam_size, cfg.alpha, a, b, nbest, min_len, prefix,
                       shortlist)  # fmt: skip
