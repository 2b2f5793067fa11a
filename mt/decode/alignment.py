"""Where the model looks: encoder-decoder attention of translated sentences, as heat maps and
as word alignments.

The attention of a sentence pair is the cross-attention of one decoder layer (the last by
default), averaged over heads, with the output teacher-forced: row t is the distribution over
source positions when the model predicts output token t.

A word alignment links each target word to the source word its pieces attend to most, in the
Pharaoh format ``i-j`` (source word i, target word j, both from 0; words are the
SentencePiece words, i.e. pieces from one starting with "▁" to the next).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mt.data.batches import make_src
from mt.decode.driver import fit_to_model, translate_ids
from mt.files import atomic_path
from mt.schema import DecodeConfig
from mt.vocab import BOS


@torch.inference_mode()
def cross_attention(
    model: torch.nn.Module, src_ids: list[int], out_ids: list[int], device="cpu", layer: int = -1
) -> torch.Tensor:
    """Decoder layer ``layer``'s cross-attention averaged over heads, ``BOS + out_ids``
    teacher-forced (``model.decode(..., need_attn=True)``): (T, S) weights on the CPU, rows
    predicting ``out_ids + [EOS]`` (ids without BOS/EOS), columns ``src_ids + [EOS]``."""
    src = make_src([list(src_ids)]).to(device)  # (1, S)
    tgt_in = torch.tensor([[BOS, *out_ids]], dtype=torch.long, device=device)  # (1, T)
    _, attn = model.decode(tgt_in, model.encode(src), None, need_attn=True, attn_layer=layer)
    return attn[0].float().cpu()  # (T, S)


def attention_map(
    model: torch.nn.Module, tokenizer, sentence: str, decode_cfg: DecodeConfig, device="cpu"
) -> tuple[list[str], list[str], Any]:
    """Translate one raw ``sentence`` (cut to the model's ``max_positions``) and return its
    attention, for heatmaps: ``(src_pieces (S), tgt_pieces (T), matrix (T, S))``, the
    SentencePiece pieces plus ``</s>`` on both sides and the last decoder layer's
    cross-attention (:func:`cross_attention`), one row per generated piece."""
    (src_ids,) = tokenizer.encode([tokenizer.normalize(sentence)], side="src")
    (src_ids,) = fit_to_model([src_ids], model.max_positions, "truncate")
    (out_ids,) = translate_ids(model, [src_ids], replace(decode_cfg, nbest=1), device)
    matrix = cross_attention(model, src_ids, out_ids, device)
    src_sp, tgt_sp = tokenizer.model("src"), tokenizer.model("tgt")
    src_pieces = [src_sp.id_to_piece(i) for i in src_ids] + ["</s>"]
    tgt_pieces = [tgt_sp.id_to_piece(i) for i in out_ids] + ["</s>"]
    return src_pieces, tgt_pieces, matrix.numpy()


def word_index(pieces: list[str]) -> list[int]:
    """The word (from 0) each SentencePiece piece belongs to: a piece starting with "▁" starts
    a new word (the first piece always belongs to word 0)."""
    out, word = [], -1
    for piece in pieces:
        if piece.startswith("\u2581") or word < 0:
            word += 1
        out.append(word)
    return out


def align(
    matrix: torch.Tensor, src_words: list[int], tgt_words: list[int]
) -> list[tuple[int, int]]:
    """Sorted unique (source word, target word) pairs from a (T, S) attention ``matrix`` over
    pieces (T = len(tgt_words) + 1, S = len(src_words) + 1; the words of the pieces: see
    :func:`word_index`). Each target piece (the rows but the last, EOS) links to the source
    piece it attends to most among the real source pieces (the columns but the last, EOS); the
    links of pieces become links of their words."""
    if not src_words or not tgt_words:
        return []
    best = matrix[: len(tgt_words), : len(src_words)].argmax(dim=1).tolist()  # (T-1,)
    return sorted({(src_words[s], tgt_words[t]) for t, s in enumerate(best)})


def pharaoh(pairs: list[tuple[int, int]]) -> str:
    """``i-j`` pairs separated by spaces (the Pharaoh / fast_align format)."""
    return " ".join(f"{i}-{j}" for i, j in pairs)


def alignments(
    model: torch.nn.Module,
    tokenizer,
    src_ids: list[list[int]],
    out_ids: list[list[int]],
    device="cpu",
    layer: int = -1,
) -> list[str]:
    """Pharaoh alignment lines of translated sentences (source ids without EOS, output ids
    without BOS/EOS), from decoder layer ``layer``'s cross-attention averaged over heads."""
    src_sp, tgt_sp = tokenizer.model("src"), tokenizer.model("tgt")
    lines = []
    for src, out in zip(src_ids, out_ids):
        if not src or not out:
            lines.append("")
            continue
        matrix = cross_attention(model, src, out, device, layer)
        src_words = word_index([src_sp.id_to_piece(i) for i in src])
        tgt_words = word_index([tgt_sp.id_to_piece(i) for i in out])
        lines.append(pharaoh(align(matrix, src_words, tgt_words)))
    return lines


def pyplot():
    """matplotlib's pyplot on the non-interactive Agg backend (imported on first use)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_attention(
    src_tokens: Sequence[str], tgt_tokens: Sequence[str], matrix: Any, path: str | Path
) -> Path:
    """Draw encoder-decoder attention as a heatmap (the picture known from the paper) into the
    PNG file ``path``: the (T, S) ``matrix`` (numpy or torch; ValueError if it is not that
    shape) with the S ``src_tokens`` as columns and the T ``tgt_tokens`` as rows."""
    if hasattr(matrix, "detach"):  # a torch tensor, without importing torch here
        matrix = matrix.detach().float().cpu().numpy()
    weights = np.asarray(matrix, dtype=np.float64)
    T, S = expected = (len(tgt_tokens), len(src_tokens))
    if weights.shape != expected:
        raise ValueError(f"attention matrix is {weights.shape}, tokens give (T, S) = {expected}")
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(min(2.0 + 0.35 * S, 30), min(1.5 + 0.35 * T, 30)))
    image = ax.imshow(weights, cmap="viridis", aspect="auto", vmin=0.0, interpolation="nearest")
    ax.set_xticks(range(S), list(src_tokens), rotation=90, fontsize=8)
    ax.set_yticks(range(T), list(tgt_tokens), fontsize=8)
    ax.set(xlabel="source", ylabel="output")
    ax.xaxis.set_ticks_position("top")
    ax.xaxis.set_label_position("top")
    fig.colorbar(image, ax=ax, fraction=0.046, pad=0.04)
    fig.tight_layout()
    path = Path(path)
    atomic_path(path, lambda f: fig.savefig(f, dpi=100, format="png"))
    plt.close(fig)
    return path
