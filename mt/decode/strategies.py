"""Search strategies: which candidates survive a step of search (``mt.decode.search.generate``).

A strategy has ``K`` (hypotheses kept per sentence) and ``step(scores, lprobs) -> Step``: given
the summed log-probabilities (n, K) of the live hypotheses of n sentences and the
log-probabilities (n, K or 1, V) of their next tokens, it says which hypotheses finish (with
EOS) and which K continue, from which parent, with which token and score. It knows nothing of
the model, its cache or the rows that hold the hypotheses (``mt.decode.rows``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mt.vocab import EOS

NEG_INF = float("-inf")


@dataclass
class Step:
    """What a strategy decides at one step, for n sentences of K hypotheses each: ``done``
    (i, k, logprob) per finished hypothesis (sentence i's hypothesis k + EOS), and for the
    continuing ones (n, K) their parent hypothesis ``beam``, new ``token`` and summed
    log-probability ``score`` (-inf: no hypothesis)."""

    done: list[tuple[int, int, float]]
    beam: torch.Tensor
    token: torch.Tensor
    score: torch.Tensor


class Beam:
    """Beam search: the K best continuations of each sentence (GNMT scoring).

    ``score(y_1..y_t) = score(y_1..y_{t-1}) + log p(y_t | y_<t, x)`` for every hypothesis and
    every token; the 2K best candidates are ranked; those ending in EOS finish when they rank
    within the top K, and the K best of the others continue.
    """

    def __init__(self, K: int) -> None:
        self.K = K

    def step(self, scores: torch.Tensor, lprobs: torch.Tensor) -> Step:
        """scores (n, K) of the live hypotheses; lprobs (n, K or 1, V) of their next tokens
        (one row per sentence at the first step, when its K hypotheses are the same)."""
        n, K, V = scores.size(0), self.K, lprobs.size(-1)
        if lprobs.size(1) == K:  # in place: the log-probabilities are not needed after
            cand = lprobs.add_(scores[:, :, None]).view(n, K * V)
        else:  # the first step: one row per sentence, broadcast to its K (equal) hypotheses
            cand = (scores[:, :, None] + lprobs).view(n, K * V)
        top_score, top_index = row_topk(cand, min(2 * K, K * V))  # (n, 2K), best first
        top_beam, top_tok = top_index // V, top_index % V
        is_eos = top_tok == EOS
        ranked_in_k = torch.arange(top_score.size(1), device=top_score.device) < K
        finished = is_eos & ranked_in_k & torch.isfinite(top_score)
        done = [
            (i, int(top_beam[i, j]), float(top_score[i, j])) for i, j in finished.nonzero().tolist()
        ]
        # The K best candidates not ending in EOS: rank order, EOS ones moved last (stable).
        keep = torch.argsort(is_eos.to(torch.int8), dim=1, stable=True)[:, :K]  # (n, K)
        beam, token, score = (t.gather(1, keep) for t in (top_beam, top_tok, top_score))
        return Step(done, beam, token, score)


class Greedy:
    """The most probable token of each sentence (beam search with K = 1)."""

    K = 1

    def step(self, scores: torch.Tensor, lprobs: torch.Tensor) -> Step:
        """scores (n, 1); lprobs (n, 1, V)."""
        return _one_token_step(scores, *row_max(lprobs[:, 0]))  # best (n,), its token (n,)


BLOCK = 64  # row_topk's block: 64 floats, one cache line's worth four times over


def row_topk(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``x.topk(k, dim=1)`` of a 2-D tensor (values best first, their indices).

    On a CPU, for rows long against ``k``, through the maxima of blocks of :data:`BLOCK`
    columns: every one of a row's k largest values lies in one of the k blocks with the largest
    maxima (a value outside them is below k block maxima, each a different element), so the
    row's top k are the top k of those k blocks' elements. That is one vectorised pass over the
    row (``amax``) and a top-k over k x 64 candidates, where torch's CPU top-k walks every
    element, several times slower at a beam step's rows (docs/performance.md). The
    values are torch's exactly; among equal values the index may differ (torch's is unspecified
    too).
    """
    n, m = x.shape
    blocks = m // BLOCK
    if x.device.type != "cpu" or blocks < 4 * k or k * BLOCK > m // 4:
        return x.topk(k, dim=1)
    x = x.contiguous()
    body = x[:, : blocks * BLOCK].view(n, blocks, BLOCK)
    best = body.amax(dim=2).topk(k, dim=1).indices  # (n, k) the blocks to search
    cols = (best[:, :, None] * BLOCK + torch.arange(BLOCK)).view(n, k * BLOCK)
    if blocks * BLOCK < m:  # the tail columns after the last whole block: always candidates
        cols = torch.cat([cols, torch.arange(blocks * BLOCK, m).expand(n, -1)], dim=1)
    value, where = x.gather(1, cols).topk(k, dim=1)
    return value, cols.gather(1, where)


def row_max(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x.max(dim=-1)`` of a 2-D tensor: each row's largest value and the index of its first
    occurrence (of the first NaN, where there is one, as torch's).

    On a CPU through NumPy's ``argmax``: torch's reduction with indices runs element by element
    there, an order of magnitude slower than NumPy's vectorised one at a greedy step's rows,
    and otherwise a greedy step's largest cost after its products (docs/performance.md).
    """
    if x.device.type != "cpu" or x.dtype not in (torch.float32, torch.float64):
        return x.max(dim=-1)
    index = torch.from_numpy(x.contiguous().numpy().argmax(axis=-1))
    return x.gather(-1, index[:, None]).squeeze(-1), index


class Sampling:
    """A token drawn from each sentence's distribution, for sampled back-translation.

    ``p(v) ∝ exp(log p(v) / temperature)`` restricted to the ``top_k`` most probable tokens
    (0: all) and to the smallest set of most probable tokens whose probability reaches ``top_p``
    (1: all). Each sentence draws from its own generator (``seeds``), so a sentence's sample does
    not depend on the batch it is in. Temperature 0 is greedy search. The reported log-prob is
    the model's (before temperature and truncation).
    """

    K = 1

    def __init__(
        self, seeds: list[int], temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0
    ) -> None:
        if temperature < 0 or top_k < 0 or not 0 < top_p <= 1:
            raise ValueError(
                f"decode.temperature >= 0, decode.top_k >= 0 and 0 < decode.top_p <= 1 are "
                f"needed, got {temperature}, {top_k}, {top_p}"
            )
        self.generators = [torch.Generator().manual_seed(s) for s in seeds]
        self.temperature, self.top_k, self.top_p = temperature, top_k, top_p
        self.sents: list[int] = []  # set by generate: the sentence of each live row

    def distribution(self, lprobs: torch.Tensor) -> torch.Tensor:
        """(n, V) model log-probs -> (n, V) sampling probabilities."""
        logits = lprobs / self.temperature
        if self.top_k:  # exactly k tokens (ties broken by topk)
            best = logits.topk(min(self.top_k, logits.size(-1)), dim=-1).indices
            kept = torch.zeros_like(logits, dtype=torch.bool).scatter(-1, best, True)
            logits = logits.masked_fill(~kept, NEG_INF)
        probs = logits.softmax(dim=-1)
        if self.top_p < 1:
            sorted_p, order = probs.sort(dim=-1, descending=True)
            before = sorted_p.cumsum(dim=-1) - sorted_p  # mass of the more probable tokens
            sorted_p = sorted_p.masked_fill(before >= self.top_p, 0.0)
            probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
            probs = probs / probs.sum(dim=-1, keepdim=True)
        return probs

    def step(self, scores: torch.Tensor, lprobs: torch.Tensor) -> Step:
        """scores (n, 1); lprobs (n, 1, V)."""
        if self.temperature == 0:
            return Greedy().step(scores, lprobs)
        lp = lprobs[:, 0]
        probs = self.distribution(lp.float()).cpu()
        u = torch.cat([torch.rand(1, generator=self.generators[s]) for s in self.sents])
        cdf = probs.cumsum(dim=-1)
        token = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None]).squeeze(1)
        token = token.clamp(max=probs.size(-1) - 1)
        # Guard against rounding at the top of the cdf: never a zero-probability token.
        zero = probs.gather(1, token[:, None]).squeeze(1) == 0
        if bool(zero.any()):
            token[zero] = probs[zero].argmax(dim=-1)
        token = token.to(lp.device)
        return _one_token_step(scores, lp.gather(1, token[:, None]).squeeze(1), token)


def _one_token_step(scores: torch.Tensor, lprob: torch.Tensor, token: torch.Tensor) -> Step:
    """The Step of a one-hypothesis strategy: token (n,) with its log-prob (n,)."""
    score = scores[:, 0] + lprob
    ended = token == EOS
    done = [(i, 0, float(score[i])) for i in ended.nonzero().squeeze(1).tolist()]
    zero = torch.zeros_like(token)
    return Step(done, zero[:, None], token[:, None], score.masked_fill(ended, NEG_INF)[:, None])
