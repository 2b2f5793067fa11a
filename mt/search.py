"""Greedy and beam search over a trained Transformer, batched over sentences and beams.

Both searches run the encoder once and then the decoder one token at a time with its key/value
cache (``model.decode(new_tokens, enc, cache)``); ``model.reorder(enc, cache, index)`` makes the
cache follow the surviving beams and drops the rows of sentences whose search has ended. They use
nothing else of the model, so stub models with hand-set probabilities can test them. Models may
also offer ``reorder_beams`` (the K beams of a sentence share one encoder row) and
``copy_beams`` (in place: at a step where no sentence ends, each new hypothesis takes a row of
its sentence so that only the rows of beams left without children are overwritten).

Conventions (the paper's, made exact):

* Length penalty (GNMT): ``lp(Y) = ((5 + |Y|) / 6) ** alpha`` where ``|Y|`` counts the output
  tokens *including* the final EOS when the hypothesis has one. A hypothesis' score is
  ``sum(log p(y_t)) / lp(Y)``, the sum including the EOS log-probability.
* Maximum length: ``max_len = int(a * src_len + b)`` where ``src_len`` is the number of source
  tokens *without* the EOS appended to every source (and without padding), capped at the model's
  ``max_positions``. Every hypothesis has ``|Y| <= max_len``: a hypothesis that reaches
  ``max_len`` tokens without EOS is finalised as it is (no EOS, no EOS log-probability).
* A candidate ending in EOS becomes a finished hypothesis only when it ranks within the top
  ``beam_size`` candidates of its step; the ``beam_size`` best candidates not ending in EOS
  continue. A sentence's search ends when ``beam_size`` hypotheses are finished (so beam 1 is
  exactly greedy search) or at its maximum length, where its unfinished beams are finalised.
* PAD and BOS are never generated; ``min_len`` forbids EOS until that many tokens are out
  (benchmarks use it to force the output length).
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F

from mt.schema import DecodeConfig
from mt.vocab import BOS, EOS, PAD

log = logging.getLogger(__name__)

NEG_INF = float("-inf")


@dataclass
class Hypothesis:
    """One output of the search.

    Attributes:
        tokens: output ids without BOS and EOS.
        score: sum of token log-probabilities divided by the length penalty.
        logprob: the plain sum of token log-probabilities (EOS included when generated).
    """

    tokens: list[int]
    score: float
    logprob: float = 0.0


def length_penalty(length: int, alpha: float) -> float:
    """GNMT length penalty ``((5 + length) / 6) ** alpha`` (``length`` counts EOS when present)."""
    return ((5.0 + length) / 6.0) ** alpha


def max_positions(model: torch.nn.Module) -> int | None:
    """The longest sequence the model's positional encoding covers, when it says so."""
    for owner in (model, getattr(model, "cfg", None), getattr(model, "config", None)):
        value = getattr(owner, "max_positions", None)
        if isinstance(value, int):
            return value
    return None


def max_lengths(src: torch.Tensor, a: float, b: float, model: torch.nn.Module) -> list[int]:
    """Per-sentence maximum output length ``int(a * src_len + b)``, ``src_len`` without EOS.

    Args:
        src: (B, S) source ids, each row ``ids + EOS`` right-padded with PAD.
        a, b: the coefficients (``decode.max_len_a``, ``decode.max_len_b``).
        model: used only for its ``max_positions`` cap.

    Returns:
        B lengths, each at least 1 and at most the model's ``max_positions``.
    """
    src_len = ((src != PAD).sum(dim=1) - 1).clamp(min=0).tolist()
    cap = max_positions(model) or 1 << 30
    return [max(1, min(cap, int(a * n + b))) for n in src_len]


def _next_lprobs(model, last, enc, cache, step: int, min_len: int) -> torch.Tensor:
    """Log-probabilities (N, V) after the tokens ``last`` (N, 1), PAD/BOS (early EOS) forbidden."""
    logits = model.decode(last, enc, cache)  # (N, 1, V)
    lprobs = F.log_softmax(logits[:, -1].float(), dim=-1)  # (N, V)
    lprobs[:, PAD] = NEG_INF
    lprobs[:, BOS] = NEG_INF
    if step < min_len:
        lprobs[:, EOS] = NEG_INF
    return lprobs


def _hyp(tokens: torch.Tensor, logprob: float, length: int, alpha: float) -> Hypothesis:
    """A hypothesis from a token row ``BOS y_1 .. y_t`` (BOS dropped)."""
    return Hypothesis(tokens[1:].tolist(), logprob / length_penalty(length, alpha), logprob)


@torch.inference_mode()
def greedy_search(
    model: torch.nn.Module,
    src: torch.Tensor,
    max_len_a: float = 1.0,
    max_len_b: float = 50,
    min_len: int = 0,
    alpha: float = 0.0,
) -> list[Hypothesis]:
    """Greedy decoding of a batch: the most probable token at each step.

    Args:
        model: has ``encode``, ``decode`` (incremental, with a cache dict) and ``reorder``.
        src: (B, S) source ids (``ids + EOS``, PAD-padded).
        max_len_a, max_len_b: maximum output length ``int(a * src_len + b)``.
        min_len: EOS is forbidden until this many tokens are out.
        alpha: length penalty exponent for the reported score (0: plain log-probability).

    Returns:
        One hypothesis per sentence, in input order.
    """
    model.eval()
    limits = max_lengths(src, max_len_a, max_len_b, model)
    enc, cache = model.encode(src), {}
    rows = list(range(src.size(0)))  # sentence of each live row
    tokens = torch.full((len(rows), 1), BOS, dtype=torch.long, device=src.device)  # (N, t+1)
    cum = torch.zeros(len(rows), device=src.device)
    out: list[Hypothesis | None] = [None] * len(rows)
    step = 0
    while rows:
        # Sentences at their maximum length are finalised without EOS.
        keep = [i for i, s in enumerate(rows) if limits[s] > step]
        if len(keep) < len(rows):
            logprob = cum.tolist()
            for i, s in enumerate(rows):
                if limits[s] <= step:
                    out[s] = _hyp(tokens[i], logprob[i], step, alpha)
            rows, tokens, cum, enc, cache = _select(model, keep, rows, tokens, cum, enc, cache)
            if not rows:
                break
        lprobs = _next_lprobs(model, tokens[:, -1:], enc, cache, step, min_len)
        best, next_tok = lprobs.max(dim=-1)  # (N,), (N,)
        cum = cum + best
        tokens = torch.cat([tokens, next_tok[:, None]], dim=1)
        step += 1
        ended = (next_tok == EOS).tolist()
        if any(ended):
            logprob = cum.tolist()
            for i, s in enumerate(rows):
                if ended[i]:
                    out[s] = _hyp(tokens[i, :-1], logprob[i], step, alpha)
            keep = [i for i, e in enumerate(ended) if not e]
            rows, tokens, cum, enc, cache = _select(model, keep, rows, tokens, cum, enc, cache)
    return out  # type: ignore[return-value]


def _select(model, keep: list[int], rows, tokens, cum, enc, cache):
    """Keep only the rows ``keep`` of the greedy state (and of the model's cache)."""
    index = torch.tensor(keep, dtype=torch.long, device=tokens.device)
    rows = [rows[i] for i in keep]
    if rows:
        enc, cache = model.reorder(enc, cache, index)
    return rows, tokens[index], cum[index], enc, cache


@torch.inference_mode()
def beam_search(
    model: torch.nn.Module,
    src: torch.Tensor,
    beam_size: int = 4,
    alpha: float = 0.6,
    max_len_a: float = 1.0,
    max_len_b: float = 50,
    nbest: int = 1,
    min_len: int = 0,
) -> list[list[Hypothesis]]:
    """Beam search of a batch of sentences, all beams of all sentences in one decoder call.

    Args:
        model: has ``encode``, ``decode`` (incremental, with a cache dict) and ``reorder``.
        src: (B, S) source ids (``ids + EOS``, PAD-padded).
        beam_size: K, hypotheses kept per sentence.
        alpha: length penalty exponent (GNMT form; see the module docstring).
        max_len_a, max_len_b: maximum output length ``int(a * src_len + b)``.
        nbest: hypotheses returned per sentence (at most ``beam_size``).
        min_len: EOS is forbidden until this many tokens are out.

    Returns:
        For each sentence (input order), up to ``nbest`` hypotheses, best first.
    """
    if not 1 <= nbest <= beam_size:
        raise ValueError(f"nbest must be between 1 and beam_size={beam_size}, got {nbest}")
    model.eval()
    K, device = beam_size, src.device
    limits = max_lengths(src, max_len_a, max_len_b, model)
    enc, cache = model.encode(src), {}
    grouped = hasattr(model, "reorder_beams")  # K decoder rows may share one encoder row
    sents = list(range(src.size(0)))  # sentence of each live group of K rows
    scores = torch.full((len(sents), K), NEG_INF, device=device)  # (n, K) summed log-probs
    scores[:, 0] = 0.0  # all beams start equal: keep one so the first step has no duplicates
    tokens = torch.full((len(sents) * K, 1), BOS, dtype=torch.long, device=device)  # (n*K, t+1)
    # The model's state holds `width` rows per sentence: 1 at the first step (the K beams are
    # identical then, so one row each is decoded and broadcast), K after.
    width, last = 1, tokens[: len(sents)]  # last: (n*width, 1) decoder input
    finished: list[list[Hypothesis]] = [[] for _ in sents]
    out: list[list[Hypothesis]] = [[] for _ in sents]
    step = 0
    while sents:
        at_max = [i for i, s in enumerate(sents) if limits[s] <= step]
        if at_max:
            flat = scores.tolist()
            for i in at_max:
                for k in range(K):
                    if flat[i][k] > NEG_INF:
                        hyp = _hyp(tokens[i * K + k], flat[i][k], step, alpha)
                        finished[sents[i]].append(hyp)
            keep = [i for i in range(len(sents)) if limits[sents[i]] > step]
            scores, tokens = scores[keep], tokens[_group_rows(keep, K, device)]
            sents = _finish(sents, at_max, finished, out, nbest)
            if not sents:
                break
            keep_t = torch.tensor(keep, dtype=torch.long, device=device)
            state_rows = _group_rows(keep, width, device)
            enc, cache = _reorder(model, grouped, enc, cache, state_rows, keep_t)
            last = last[state_rows]
        n = len(sents)
        lprobs = _next_lprobs(model, last, enc, cache, step, min_len)  # (n*width, V)
        V = lprobs.size(-1)
        if width == K:  # candidate scores written over the log-probabilities (no copy)
            cand = lprobs.add_(scores.view(n * K, 1)).view(n, K * V)
        else:  # width 1: the one decoded row of each sentence broadcast to its K beams
            cand = (scores.view(n, K, 1) + lprobs.view(n, 1, V)).view(n, K * V)
        top_scores, top_index = cand.topk(min(2 * K, K * V), dim=1)  # (n, 2K), best first
        top_beam, top_tok = top_index // V, top_index % V
        is_eos = top_tok == EOS
        # Finished: EOS candidates ranked within the top K of this step.
        ranks = torch.arange(top_index.size(1), device=device)
        done_mask = is_eos & (ranks < K) & torch.isfinite(top_scores)
        # Continuing: the K best candidates that do not end in EOS (ranks order them).
        key = torch.where(is_eos, ranks + top_index.size(1), ranks)  # (n, 2K)
        sel = key.topk(K, dim=1, largest=False).indices  # (n, K) ascending rank
        new_scores = top_scores.gather(1, sel)
        beam = top_beam.gather(1, sel)  # (n, K)
        base = torch.arange(n, device=device)[:, None]
        new_tok = top_tok.gather(1, sel)
        step += 1
        ended: set[int] = set()
        if bool(done_mask.any()):
            for i, j in done_mask.nonzero().tolist():
                row = i * K + int(top_beam[i, j])
                logprob = float(top_scores[i, j])
                finished[sents[i]].append(_hyp(tokens[row], logprob, step, alpha))
            ended = {i for i in range(n) if len(finished[sents[i]]) >= K}
        # A sentence whose beams are all dead (-inf) can finish nothing more.
        alive = torch.isfinite(new_scores).any(dim=1)
        if not bool(alive.all()):
            ended |= {i for i, a in enumerate(alive.tolist()) if not a}
        if not ended and width == K:  # the common step: beams move within their sentences
            # Each new hypothesis takes a row of its sentence: the first child of a beam
            # stays in its parent's row, the others take the rows of beams left without
            # children, so only those rows' caches are copied (beam order is immaterial).
            order = _rows_for(beam).argsort(dim=1)  # (n, K): the hypothesis placed in row k
            beam, last = beam.gather(1, order), new_tok.gather(1, order).view(-1, 1)
            parent = (base * K + beam).view(-1)  # (n*K,) rows of `tokens` and of the state
            tokens = torch.cat([tokens[parent], last], dim=1)
            scores = new_scores.gather(1, order)
            moved = (beam != torch.arange(K, device=device)).view(-1).nonzero().squeeze(1)
            if moved.numel():
                enc, cache = _copy_rows(model, grouped, enc, cache, moved, parent[moved], n * K)
            continue
        origin = base * K + beam  # (n, K) rows of `tokens`
        state_origin = origin if width == K else base.expand(n, K)  # rows of the state
        width = K
        if not ended:  # the first step: the one row of each sentence becomes its K beams
            tokens = torch.cat([tokens[origin.view(-1)], new_tok.view(-1, 1)], dim=1)
            scores, last = new_scores, new_tok.view(-1, 1)
            enc, cache = _reorder(model, grouped, enc, cache, state_origin.reshape(-1), None)
            continue
        keep = [i for i in range(n) if i not in ended]
        keep_t = torch.tensor(keep, dtype=torch.long, device=device)
        tokens = torch.cat([tokens[origin[keep_t].view(-1)], new_tok[keep_t].view(-1, 1)], dim=1)
        scores, last = new_scores[keep_t], new_tok[keep_t].view(-1, 1)
        sents = _finish(sents, sorted(ended), finished, out, nbest)
        if sents:
            rows = state_origin[keep_t].reshape(-1)
            enc, cache = _reorder(model, grouped, enc, cache, rows, keep_t)
    return out


def _reorder(model, grouped: bool, enc, cache, rows: torch.Tensor, sents: torch.Tensor | None):
    """Follow the surviving beams: decoder rows ``rows``; encoder rows ``sents`` (None: same).

    Models with ``reorder_beams`` keep one encoder row per sentence; others (the contract's
    ``reorder`` only) keep the encoder output row-aligned with the decoder rows.
    """
    if grouped:
        return model.reorder_beams(enc, cache, rows, sents)
    return model.reorder(enc, cache, rows)


def _rows_for(beam: torch.Tensor) -> torch.Tensor:
    """The row (within its sentence) each new hypothesis takes, copying the fewest caches.

    Args:
        beam: (n, K) the parent beam (row) of each new hypothesis.

    Returns:
        (n, K) a permutation of 0..K-1 per sentence: a parent's first child takes the parent's
        row; the other children take, in order, the rows whose beams have no child.
    """
    n, K = beam.shape
    rows = torch.arange(K, device=beam.device)
    same = beam[:, :, None] == beam[:, None, :]  # (n, K, K): hypotheses j, j' share a parent
    earlier = torch.ones(K, K, dtype=torch.bool, device=beam.device).tril(-1)  # j' < j
    first = ~(same & earlier).any(dim=2)  # (n, K): no earlier sibling
    childless = ~(beam[:, :, None] == rows).any(dim=1)  # (n, K): row k has no child
    free = torch.argsort((~childless).to(torch.int8), dim=1, stable=True)  # childless first
    rank = ((~first).cumsum(dim=1) - 1).clamp(min=0)  # among the later siblings
    return torch.where(first, beam, free.gather(1, rank))


def _copy_rows(model, grouped: bool, enc, cache, dst: torch.Tensor, src: torch.Tensor, rows: int):
    """Decoder-state rows ``dst`` take the contents of rows ``src`` (disjoint); the others of
    the ``rows`` rows stay. Models with ``copy_beams`` do it in place; others (the contract's
    ``reorder`` only) reorder by the equivalent full index."""
    if hasattr(model, "copy_beams"):
        return enc, model.copy_beams(cache, dst, src)
    index = torch.arange(rows, device=dst.device)
    index[dst] = src
    return _reorder(model, grouped, enc, cache, index, None)


def _group_rows(groups: list[int], K: int, device) -> torch.Tensor:
    """Flat row indices of the given beam groups (each group is K consecutive rows)."""
    g = torch.tensor(groups, dtype=torch.long, device=device)
    return (g[:, None] * K + torch.arange(K, device=device)).view(-1)


def _finish(sents, ended, finished, out, nbest: int) -> list[int]:
    """Store the n-best of each ended sentence; return the sentences still searching."""
    ended_set = set(ended)
    for i in ended_set:
        s = sents[i]
        out[s] = sorted(finished[s], key=lambda h: -h.score)[:nbest]
        finished[s] = []
    return [s for i, s in enumerate(sents) if i not in ended_set]


def search(
    model: torch.nn.Module, src: torch.Tensor, cfg: DecodeConfig, min_len: int = 0
) -> list[list[Hypothesis]]:
    """Greedy search when ``cfg.beam_size == 1``, else beam search; n-best lists either way."""
    if cfg.beam_size <= 1:
        hyps = greedy_search(model, src, cfg.max_len_a, cfg.max_len_b, min_len, cfg.alpha)
        return [[h] for h in hyps]
    return beam_search(
        model, src, cfg.beam_size, cfg.alpha, cfg.max_len_a, cfg.max_len_b,
        min(cfg.nbest, cfg.beam_size), min_len,
    )  # fmt: skip


def make_batches(lengths: list[int], batch_size: int, max_tokens: int = 0) -> list[list[int]]:
    """Group sentence indices, longest first, by sentence count and padded source tokens.

    Args:
        lengths: source lengths (without EOS).
        batch_size: at most this many sentences per batch.
        max_tokens: at most this many padded source tokens (EOS included) per batch (0: off).

    Returns:
        Lists of indices into ``lengths``; every index appears exactly once.
    """
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    batches: list[list[int]] = []
    current: list[int] = []
    for i in order:
        width = lengths[current[0]] + 1 if current else lengths[i] + 1
        too_many = len(current) >= max(1, batch_size)
        too_big = max_tokens > 0 and (len(current) + 1) * width > max_tokens
        if current and (too_many or too_big):
            batches.append(current)
            current = []
        current.append(i)
    if current:
        batches.append(current)
    return batches


def autocast(device: torch.device | str, precision: str):
    """An autocast context for ``decode.precision`` (fp32: none; bf16: bfloat16 autocast)."""
    if precision == "fp32":
        return contextlib.nullcontext()
    if precision == "bf16":
        return torch.autocast(device_type=torch.device(device).type, dtype=torch.bfloat16)
    raise ValueError(f"decode.precision must be fp32 or bf16, got {precision!r}")


def translate_nbest(
    model: torch.nn.Module,
    src_ids: list[list[int]],
    decode_cfg: DecodeConfig,
    device: torch.device | str = "cpu",
    min_len: int = 0,
) -> list[list[Hypothesis]]:
    """Search many sentences in length-sorted batches; n-best lists in input order.

    Args:
        model: the Transformer (already on ``device``).
        src_ids: source ids per sentence, without EOS (``make_src`` appends it); sources
            longer than the model's ``max_positions`` are truncated with a warning.
        decode_cfg: beam size, alpha, lengths, batch size / max tokens, and the kernels
            (precision, quantize, onednn: see mt.inference).
        device: where the batches go.
        min_len: EOS is forbidden until this many tokens are out.

    Returns:
        ``decode_cfg.nbest`` (at most ``beam_size``) hypotheses per sentence, best first.
    """
    from mt.batching import make_src

    limit = max_positions(model)
    if count_truncated(src_ids, limit):  # callers with a policy (mt-translate) check first
        log.warning("%d sources longer than max_positions=%s truncated",
                    count_truncated(src_ids, limit), limit)  # fmt: skip
        src_ids = clip_to_length(src_ids, limit, "truncate")
    from mt.inference import for_decoding, needs_autocast

    settings = (decode_cfg.quantize, decode_cfg.precision, decode_cfg.onednn)
    precision = decode_cfg.precision if needs_autocast(model, *settings) else "fp32"
    model = for_decoding(model, *settings)
    lengths = [len(ids) for ids in src_ids]
    out: list[list[Hypothesis]] = [[] for _ in src_ids]
    for batch in make_batches(lengths, decode_cfg.batch_size, decode_cfg.max_tokens):
        src = make_src([list(src_ids[i]) for i in batch]).to(device)
        with autocast(device, precision):
            results = search(model, src, decode_cfg, min_len)
        for i, hyps in zip(batch, results):
            out[i] = hyps
    return out


def translate_ids(
    model: torch.nn.Module,
    src_ids: list[list[int]],
    decode_cfg: DecodeConfig,
    device: torch.device | str = "cpu",
    min_len: int = 0,
) -> list[list[int]]:
    """The best output ids (no BOS/EOS) for each source, in input order (see translate_nbest)."""
    return [h[0].tokens for h in translate_nbest(model, src_ids, decode_cfg, device, min_len)]


@torch.inference_mode()
def cross_attention(
    model: torch.nn.Module, src_ids: list[int], out_ids: list[int], device="cpu"
) -> torch.Tensor:
    """Encoder-decoder attention of one sentence pair, for heatmaps.

    Teacher-forces ``BOS + out_ids`` and returns the last decoder layer's cross-attention
    averaged over heads (``model.decode(..., need_attn=True)``).

    Args:
        src_ids: source ids without EOS (S - 1 of them).
        out_ids: output ids without BOS/EOS (T - 1 of them).

    Returns:
        (T, S) weights on the CPU: rows predict ``out_ids + [EOS]``, columns are
        ``src_ids + [EOS]``.
    """
    from mt.batching import make_src

    model.eval()
    src = make_src([list(src_ids)]).to(device)  # (1, S)
    tgt_in = torch.tensor([[BOS, *out_ids]], dtype=torch.long, device=device)  # (1, T)
    _, attn = model.decode(tgt_in, model.encode(src), None, need_attn=True)
    return attn[0].float().cpu()  # (T, S)


def attention_map(
    model: torch.nn.Module, tokenizer, sentence: str, decode_cfg: DecodeConfig, device="cpu"
) -> tuple[list[str], list[str], Any]:
    """Translate one sentence and return its attention, for heatmaps.

    Args:
        tokenizer: an mt.tokenizer.Tokenizer (``encode``, ``normalize``, ``model(side)``).
        sentence: raw source text (cut to the model's ``max_positions``).
        decode_cfg: the search settings.

    Returns:
        ``(src_pieces (S), tgt_pieces (T), matrix (T, S))``: SentencePiece pieces plus ``</s>``
        on both sides; the last decoder layer's cross-attention averaged over heads (see
        :func:`cross_attention`), one row per generated piece.
    """
    (src_ids,) = tokenizer.encode([tokenizer.normalize(sentence)], side="src")
    limit = max_positions(model)
    src_ids = src_ids[: limit - 1] if limit else src_ids
    (out_ids,) = translate_ids(model, [src_ids], replace(decode_cfg, nbest=1), device)
    matrix = cross_attention(model, src_ids, out_ids, device)
    src_sp, tgt_sp = tokenizer.model("src"), tokenizer.model("tgt")
    src_pieces = [src_sp.id_to_piece(i) for i in src_ids] + ["</s>"]
    tgt_pieces = [tgt_sp.id_to_piece(i) for i in out_ids] + ["</s>"]
    return src_pieces, tgt_pieces, matrix.numpy()


def clip_to_length(
    src_ids: list[list[int]], limit: int | None, policy: str = "error", first_line: int = 1
) -> list[list[int]]:
    """Check sources against the model's length limit (``ids + EOS <= limit``).

    Args:
        src_ids: source ids without EOS.
        limit: ``model.max_positions`` (None: no limit).
        policy: ``error`` raises, ``truncate`` cuts the ids to ``limit - 1``.
        first_line: line number of ``src_ids[0]``, for the error message.

    Returns:
        The (possibly truncated) ids.

    Raises:
        ValueError: naming the first line that is too long, when ``policy == "error"``.
    """
    if limit is None:
        return src_ids
    if policy not in ("error", "truncate"):
        raise ValueError(f"decode.too_long must be error or truncate, got {policy!r}")
    out = []
    for n, ids in enumerate(src_ids):
        if len(ids) + 1 > limit:
            if policy == "error":
                raise ValueError(
                    f"line {first_line + n} has {len(ids)} tokens, more than the model's "
                    f"max_positions - 1 = {limit - 1}; set decode.too_long=truncate to cut it"
                )
            ids = ids[: limit - 1]
        out.append(ids)
    return out


def count_truncated(src_ids: list[list[int]], limit: int | None) -> int:
    """How many sources exceed the model's length limit (for warnings)."""
    return 0 if limit is None else sum(len(ids) + 1 > limit for ids in src_ids)


__all__ = [
    "Hypothesis",
    "attention_map",
    "beam_search",
    "cross_attention",
    "greedy_search",
    "length_penalty",
    "make_batches",
    "max_lengths",
    "translate_ids",
    "translate_nbest",
]
