"""A vocabulary shortlist for decoding: each batch is projected onto the target pieces its
sources can plausibly become, not onto the whole vocabulary (Marian's lexical shortlist,
CTranslate2's vocabulary map).

The lexicon is IBM Model 1's translation table ``p(t | s)`` over pieces, estimated by EM on the
encoded training pairs (a NULL source for target pieces with no counterpart; uniform start),
:func:`build_lexicon`. For a batch, the candidate target pieces (:meth:`Lexicon.shortlist`) are
the union of

* the special pieces (pad, unk, bos, eos: their ids stay their columns, so search masks pad and
  bos and finds eos where it always does),
* the ``frequent`` most frequent target pieces of the training data,
* for every source piece of the sentence, its ``k`` most probable translations,
* the sentence's source pieces themselves (one joint vocabulary: names and numbers are copied),
* the tokens a prefix forces.

Search then runs over the batch's union of those columns only: the projection multiplies by
their rows of the tied embedding (gathered once per batch), and the softmax, the best token and
beam search's top-k see ``C`` values a row instead of ``V``. Each sentence is held to its own
list (the others' pieces at -inf), so its translation does not depend on its batch (Marian and
CTranslate2 let a batch share its union). The distribution is the model's renormalised over
the sentence's list, which is the full model's with every other logit at -inf (the tests'
independent check); tokens are mapped back to vocabulary ids before they enter the hypotheses.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from mt.data.store import runs
from mt.files import atomic_path
from mt.vocab import BOS, EOS, PAD, UNK

log = logging.getLogger(__name__)

FORMAT = 1
SPECIAL = torch.tensor([PAD, UNK, BOS, EOS])
assert SPECIAL.tolist() == [0, 1, 2, 3]  # columns 0-3 are ids 0-3


@dataclass
class Lexicon:
    """The most probable translations of each source piece and the target pieces by frequency:
    source piece ``s``'s translations are ``targets[offsets[s]:offsets[s + 1]]`` (int64, most
    probable first) with ``probs`` ``p(t | s)`` (float32); ``frequent`` the target pieces, most
    frequent in the training targets first; ``meta`` how it was made (pairs used, EM
    iterations, languages, tokenizer digest)."""

    offsets: torch.Tensor
    targets: torch.Tensor
    probs: torch.Tensor
    frequent: torch.Tensor
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def vocab_size(self) -> int:
        return self.offsets.numel() - 1

    def save(self, path: str | Path) -> None:
        """Write atomically (``torch.load(weights_only=True)`` reads it back)."""
        state = {"format": FORMAT, **vars(self)}
        atomic_path(path, lambda f: torch.save(state, f))

    @classmethod
    def load(cls, path: str | Path) -> Lexicon:
        """Read a file written by :meth:`save` (ValueError naming it if it is not one)."""
        try:
            state = torch.load(Path(path), map_location="cpu", weights_only=True)
        except (OSError, RuntimeError, EOFError) as err:
            raise ValueError(f"decode.shortlist={path}: not a readable lexicon ({err})") from None
        if not isinstance(state, dict) or state.get("format") != FORMAT:
            raise ValueError(
                f"decode.shortlist={path}: not a lexicon file of format {FORMAT} (make one with "
                "decode.shortlist=train, or mt.decode.shortlist.build_lexicon)"
            )
        return cls(state["offsets"], state["targets"], state["probs"], state["frequent"],
                   state["meta"])  # fmt: skip

    def shortlist(
        self,
        src: torch.Tensor,
        k: int,
        frequent: int,
        prefix: torch.Tensor | None = None,
    ) -> Shortlist:
        """The candidate target pieces of one batch ``src`` (B, S) (see the module docstring):
        the union of its sentences' lists, and which of them each sentence may use; ``k``
        translations per source piece, ``frequent`` pieces for all, ``prefix`` (B, P) forced
        target ids (-1: free) or None."""
        offsets, targets = self.offsets.numpy(), self.targets.numpy()
        rows = src.cpu().numpy().astype(np.int64)
        B, V, first = len(rows), self.vocab_size, len(SPECIAL)
        # (sentence, source piece) of every source token (padding and EOS dropped), then the
        # k best translations of each: a repeated piece only sets the same entries again
        sent = np.repeat(np.arange(B, dtype=np.int64), rows.shape[1])
        piece = rows.ravel()
        sent, piece = sent[piece >= first], piece[piece >= first]
        starts = offsets[piece]
        counts = np.minimum(offsets[piece + 1] - starts, k)
        own_sent = [sent, np.repeat(sent, counts)]  # its pieces (copied), their translations
        own_tok = [piece, targets[runs(starts, counts)]]
        if prefix is not None:
            forced = prefix.cpu().numpy().astype(np.int64)
            b, j = np.nonzero(forced >= first)
            own_sent.append(b)
            own_tok.append(forced[b, j])
        sent, tok = np.concatenate(own_sent), np.concatenate(own_tok)
        common = self.frequent.numpy()[:frequent]
        common = common[common >= first]
        # dense over the vocabulary: no sorting (a batch's lists hold ~10^4 entries)
        used = np.zeros(V, dtype=bool)
        used[tok] = True
        used[common] = True
        used[:first] = False
        union = np.flatnonzero(used)
        column = np.zeros(V, dtype=np.int64)
        column[union] = np.arange(first, first + len(union))
        ids = torch.cat([SPECIAL, torch.from_numpy(union)])
        allowed = None
        if B > 1:
            allowed = np.zeros((B, len(ids)), dtype=bool)
            allowed[:, :first] = True
            allowed[:, column[common]] = True
            allowed[sent, column[tok]] = True
            allowed = None if allowed.all() else torch.from_numpy(allowed).to(src.device)
        return Shortlist(ids.to(src.device), allowed)


class Shortlist:
    """One batch's candidate target pieces (see the module docstring): column ``c`` of its
    logits is vocabulary id ``ids[c]`` (C,), the special ids 0-3 first, then increasing ids;
    ``allowed`` (B, C) bool: the pieces each sentence keeps (None: all)."""

    def __init__(self, ids: torch.Tensor, allowed: torch.Tensor | None = None) -> None:
        self.ids = ids
        # (B, C): 0 where a sentence may use a piece, -inf elsewhere
        self.bias = None if allowed is None else torch.where(allowed, 0.0, float("-inf"))
        self._rows: dict[tuple, torch.Tensor] = {}  # project's rows, by weight
        self._bias_rows: tuple[tuple[int, ...], torch.Tensor] | None = None  # bias_rows' last

    def __len__(self) -> int:
        return self.ids.numel()

    def project(self, h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """Logits (..., C) of decoder outputs ``h`` (..., D) over this batch's pieces: their
        rows of the tied output ``weight`` (V', D) are gathered once per batch."""
        key = (weight.data_ptr(), weight.dtype)
        if key not in self._rows:
            self._rows[key] = weight.index_select(0, self.ids).contiguous()
        rows = self._rows[key]
        return F.linear(h.to(rows.dtype), rows)

    def restrict(self, logits: torch.Tensor, sents: list[int], width: int) -> torch.Tensor:
        """``logits`` (n * width, T, C) of the rows of sentences ``sents`` (``width`` rows
        each) with the pieces outside each sentence's own list at -inf."""
        bias = self.bias_rows(sents)
        if bias is None:
            return logits
        n, C = bias.shape
        out = logits.float().view(n, width, -1, C) + bias[:, None, None, :]
        return out.view(logits.shape)

    def bias_rows(self, sents: list[int]) -> torch.Tensor | None:
        """(n, C) 0 where each of sentences ``sents`` may use a piece, -inf elsewhere; None
        when every sentence may use them all. The rows are gathered again only when ``sents``
        changes (a sentence ended), not at every step; read-only (shared between calls)."""
        if self.bias is None:
            return None
        key = tuple(sents)
        if self._bias_rows is None or self._bias_rows[0] != key:
            if key == tuple(range(self.bias.size(0))):
                rows = self.bias  # every sentence still searched, in order
            else:
                rows = self.bias[torch.tensor(sents, device=self.bias.device)]
            self._bias_rows = (key, rows)
        return self._bias_rows[1]

    def columns(self, tokens: torch.Tensor) -> torch.Tensor:
        """The columns of vocabulary ids ``tokens`` (each in the shortlist; -1 stays -1)."""
        col = torch.searchsorted(self.ids[len(SPECIAL) :], tokens.clamp(min=0)) + len(SPECIAL)
        col = torch.where(tokens < len(SPECIAL), tokens, col)
        return torch.where(tokens < 0, tokens, col)


def build_lexicon(
    src: Any,
    tgt: Any,
    vocab_size: int,
    iterations: int = 5,
    keep: int = 100,
    max_products: int = 20_000_000,
    meta: dict[str, Any] | None = None,
) -> Lexicon:
    """IBM Model 1 ``p(t | s)`` by ``iterations`` of EM from the uniform table, over the pairs'
    ``src`` and ``tgt`` ids (``mt.data.store.TokenArray``); the ``keep`` best per source piece.
    ``max_products``: at most this many (source, target) token pairs per iteration (memory:
    ~60 bytes each); beyond, a fixed random sample of the pairs is used. ``meta`` is recorded
    in the lexicon (languages, tokenizer digest)."""
    V, n = int(vocab_size), len(src)
    s_len, t_len = np.asarray(src.lengths), np.asarray(tgt.lengths)
    cost = (s_len + 1) * t_len
    if int(cost.sum()) > max_products:
        order = np.random.default_rng(0).permutation(n)
        used = np.sort(order[: int(np.searchsorted(np.cumsum(cost[order]), max_products))])
    else:
        used = np.arange(n)
    s_ids, s_len = src.gather(used)
    t_ids, t_len = tgt.gather(used)
    # One row per (target token, source token or NULL) of the same pair.
    sent = np.repeat(np.arange(len(used)), t_len)  # the pair of each target token
    fan = s_len[sent] + 1  # its candidate sources: the pair's source tokens and NULL
    token = np.repeat(np.arange(len(t_ids)), fan)  # (P,) the target token of each product
    offset = runs(np.zeros(len(fan), dtype=np.int64), fan)  # 0 .. S: S is NULL
    src_start = np.cumsum(s_len) - s_len
    null = offset == np.repeat(fan - 1, fan)
    pos = np.minimum(np.repeat(src_start[sent], fan) + offset, max(len(s_ids) - 1, 0))
    s = np.where(null, V, s_ids[pos] if len(s_ids) else V)
    keys, inverse = np.unique(s * V + np.repeat(t_ids, fan), return_inverse=True)
    inverse = inverse.ravel()
    u_src, u_tgt = keys // V, keys % V
    prob = np.full(len(keys), 1.0 / V)
    for _ in range(iterations):
        p = prob[inverse]
        post = p / np.bincount(token, weights=p, minlength=len(t_ids))[token]
        counts = np.bincount(inverse, weights=post, minlength=len(keys))
        prob = counts / np.bincount(u_src, weights=counts, minlength=V + 1)[u_src]
    real = u_src < V  # the NULL source's table is not kept
    u_src, u_tgt, prob = u_src[real], u_tgt[real], prob[real]
    order = np.lexsort((-prob, u_src))  # by source, most probable first
    u_src, u_tgt, prob = u_src[order], u_tgt[order], prob[order]
    first = np.searchsorted(u_src, u_src)  # each entry's source's first entry
    kept = (np.arange(len(u_src)) - first) < keep
    u_src, u_tgt, prob = u_src[kept], u_tgt[kept], prob[kept]
    offsets = np.concatenate([[0], np.cumsum(np.bincount(u_src, minlength=V))])
    freq = np.bincount(t_ids, minlength=V)
    frequent = np.argsort(-freq, kind="stable")[: int((freq > 0).sum())]
    info = {"pairs": int(len(used)), "of_pairs": int(n), "iterations": int(iterations),
            "keep": int(keep), **(meta or {})}  # fmt: skip
    return Lexicon(
        torch.from_numpy(offsets.astype(np.int64)),
        torch.from_numpy(u_tgt.astype(np.int64)),
        torch.from_numpy(prob.astype(np.float32)),
        torch.from_numpy(frequent.astype(np.int64)),
        info,
    )


@lru_cache(maxsize=4)
def _load(path: str, mtime_ns: int) -> Lexicon:
    return Lexicon.load(path)


def load_lexicon(path: str | Path, vocab_size: int | None = None) -> Lexicon:
    """The lexicon at ``path`` (read once per file version), checked against the model's
    vocabulary size (ValueError naming ``decode.shortlist``)."""
    p = Path(path)
    if str(path) == "train":
        raise ValueError(
            "decode.shortlist=train names the prepared training data, which only mt-evaluate, "
            "mt-translate and mt-serve look up; elsewhere give a lexicon file"
        )
    if not p.is_file():
        raise ValueError(f"decode.shortlist={path}: no such file")
    lexicon = _load(str(p.resolve()), p.stat().st_mtime_ns)
    if vocab_size is not None and lexicon.vocab_size != int(vocab_size):
        raise ValueError(
            f"decode.shortlist={path}: made for a vocabulary of {lexicon.vocab_size} pieces, "
            f"the model has {vocab_size}"
        )
    return lexicon


def check_settings(k: int, frequent: int) -> None:
    """Raises ValueError naming the setting when ``decode.shortlist_k`` or
    ``decode.shortlist_frequent`` is out of range."""
    if k < 1:
        raise ValueError(f"decode.shortlist_k must be >= 1, got {k}")
    if frequent < 0:
        raise ValueError(f"decode.shortlist_frequent must be >= 0, got {frequent}")


def lexicon_of(prepared: Any, src_lang: str, tgt_lang: str) -> Path:
    """The lexicon of a prepared-data directory's training split (``lexicon.pt`` beside it),
    built on first use (seconds for Multi30k) and reused after."""
    path = Path(prepared.dir) / "lexicon.pt"
    digest = prepared.tokenizer.sha256()
    if path.is_file():
        meta = load_lexicon(path).meta
        if meta.get("tokenizer") == digest and meta.get("direction") == [src_lang, tgt_lang]:
            return path
    split = prepared.split("train")
    log.info("building the shortlist lexicon of %s (%d pairs, IBM model 1)", prepared.dir,
             len(split))  # fmt: skip
    meta = {"tokenizer": digest, "direction": [src_lang, tgt_lang]}
    build_lexicon(split.src, split.tgt, prepared.vocab_size, meta=meta).save(path)
    return path


def vocabulary_map(lexicon: Lexicon, pieces: list[str], k: int, frequent: int) -> str:
    """The lexicon as CTranslate2's vocabulary map (``use_vmap=True``): a line per source
    piece, ``<piece>\\t<candidates>``, its ``k`` most probable translations and itself; first
    a line with an empty source, the ``frequent`` most frequent target pieces (always
    candidates). CTranslate2 gives a batch the union of its sentences' candidates."""
    check_settings(k, frequent)
    if len(pieces) != lexicon.vocab_size:
        raise ValueError(f"{len(pieces)} pieces for a lexicon of {lexicon.vocab_size}")
    first = len(SPECIAL)
    common = [pieces[t] for t in lexicon.frequent[:frequent].tolist() if t >= first]
    lines = ["\t" + " ".join(common)]
    offsets, targets = lexicon.offsets.tolist(), lexicon.targets.tolist()
    for s in range(first, lexicon.vocab_size):
        best = [t for t in targets[offsets[s] : min(offsets[s] + k, offsets[s + 1])] if t >= first]
        lines.append(pieces[s] + "\t" + " ".join(pieces[t] for t in dict.fromkeys([s, *best])))
    return "\n".join(lines) + "\n"


def resolve_shortlist(cfg: Any, tokenizer: Any, prepared: Any = None) -> Any:
    """``cfg`` (an ``mt.schema.Config``) with ``decode.shortlist=train`` replaced by the path of
    the lexicon of its prepared training data (``prepared``, or prepared here if need be; built
    on first use). ValueError: ``tokenizer`` (the checkpoint's) is not the prepared data's,
    whose ids the lexicon would hold."""
    if cfg.decode.shortlist != "train":
        return cfg
    if prepared is None:
        from mt.data.build import prepare

        prepared = prepare(cfg)
    if tokenizer.sha256() != prepared.tokenizer.sha256():
        raise ValueError(
            "decode.shortlist=train: the checkpoint's tokenizer is not the prepared data's "
            f"({prepared.dir}); give a lexicon file made with its own"
        )
    path = lexicon_of(prepared, cfg.data.src_lang, cfg.data.tgt_lang)
    lexicon = load_lexicon(path)
    log.info("shortlist: %s (%d entries for %d pieces, from %s pairs)", path,
             lexicon.targets.numel(), lexicon.vocab_size, lexicon.meta.get("pairs"))  # fmt: skip
    decode = dataclasses.replace(cfg.decode, shortlist=str(path))
    return dataclasses.replace(cfg, decode=decode)
