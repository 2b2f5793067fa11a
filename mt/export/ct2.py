"""Export to CTranslate2 through its own specification and converter API.

An mt model maps onto ``ctranslate2.specs.TransformerSpec`` without any permutation: the spec
stores the positional table explicitly (mt's interleaved sin/cos table is written as it is), the
self-attention takes one fused Q/K/V projection and the encoder-decoder attention a Q and a fused
K/V projection, as mt has them. Settings made to match mt: post-LN (``pre_norm=False``, no final
LayerNorm), ReLU, embeddings scaled by sqrt(d_model), decoding starts with ``<s>`` (BOS),
the source gets ``</s>`` appended (``add_source_eos``), as mt appends EOS to every source.

The output directory holds CTranslate2's ``model.bin``, its vocabulary and config, and mt's
SentencePiece model as ``spm.model`` (tokenize with it, pass pieces to ``translate_batch``).
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from mt.export.hf import check_exportable, sentencepiece_pieces
from mt.model.transformer import sinusoidal_positions
from mt.schema import ModelConfig
from mt.vocab import BOS, EOS, UNK


def ct2_spec(state: dict[str, torch.Tensor], cfg: ModelConfig, pieces: list[str]):
    """A filled ``TransformerSpec`` for mt's weights; ``pieces`` is the vocabulary (id order).
    A setting CTranslate2's Transformer spec cannot express raises ``ExportError``."""
    import ctranslate2

    check_exportable(cfg, True, "ctranslate2")
    specs = ctranslate2.specs
    V = len(pieces)
    n_dec = cfg.N_dec or cfg.N
    spec = specs.TransformerSpec.from_config(
        (cfg.N, n_dec), cfg.h, pre_norm=False, activation=specs.Activation.RELU
    )

    def arr(t: torch.Tensor) -> np.ndarray:
        return t.detach().float().cpu().contiguous().numpy()

    def linear(dst, src: str) -> None:
        dst.weight, dst.bias = arr(state[f"{src}.weight"]), arr(state[f"{src}.bias"])

    def norm(dst, src: str) -> None:
        dst.gamma, dst.beta = arr(state[f"{src}.weight"]), arr(state[f"{src}.bias"])

    pe = arr(sinusoidal_positions(cfg.max_positions, cfg.d_model))  # mt's interleaved table
    tgt = arr(state["embed"][:V])
    spec.encoder.embeddings[0].weight = tgt if cfg.share_embeddings else arr(state["src_embed"][:V])
    spec.decoder.embeddings.weight = tgt
    spec.decoder.projection.weight = tgt  # tied; CTranslate2 stores one copy
    for side, stack in (("encoder", spec.encoder), ("decoder", spec.decoder)):
        stack.scale_embeddings = True
        stack.position_encodings.encodings = pe
        for i, layer in enumerate(stack.layer):
            src = f"{side}.{i}"
            linear(layer.self_attention.linear[0], f"{src}.self_attn.qkv")
            linear(layer.self_attention.linear[1], f"{src}.self_attn.out")
            norm(layer.self_attention.layer_norm, f"{src}.norms.0")
            if side == "decoder":
                for k, part in enumerate(("q", "kv", "out")):
                    linear(layer.attention.linear[k], f"{src}.cross_attn.{part}")
                norm(layer.attention.layer_norm, f"{src}.norms.1")
            linear(layer.ffn.linear_0, f"{src}.ffn.w1")
            linear(layer.ffn.linear_1, f"{src}.ffn.w2")
            norm(layer.ffn.layer_norm, f"{src}.norms.{1 + (side == 'decoder')}")
    spec.register_source_vocabulary(pieces)
    spec.register_target_vocabulary(pieces)
    spec.config.unk_token = pieces[UNK]
    spec.config.bos_token = pieces[BOS]
    spec.config.eos_token = pieces[EOS]
    spec.config.decoder_start_token = pieces[BOS]
    spec.config.add_source_eos = True
    return spec


def export_ct2(
    ckpt: dict,
    cfg: ModelConfig,
    sp_blobs: list[bytes],
    out: Path,
    vmap: Callable[[list[str]], str] | None = None,
    quantization: str | None = None,
) -> Path:
    """Write a CTranslate2 model directory (float32 weights) plus ``spm.model``; with ``vmap``
    (the pieces -> the text of a vocabulary map: ``mt.decode.shortlist.vocabulary_map``) also
    CTranslate2's ``vmap.txt``, used by ``translate_batch(..., use_vmap=True)``;
    ``quantization`` (a CTranslate2 compute type) stores the weights in that type instead.
    Returns ``out``.
    """
    import ctranslate2

    check_exportable(cfg, len(sp_blobs) == 1, "ctranslate2")
    pieces = sentencepiece_pieces(sp_blobs[0], int(ckpt["vocab_size"]))
    spec = ct2_spec(ckpt["model"], cfg, pieces)

    class _MtConverter(ctranslate2.converters.Converter):
        def _load(self):
            return spec

    with tempfile.TemporaryDirectory() as tmp:
        vmap_path = None
        if vmap is not None:
            vmap_path = Path(tmp) / "vmap.txt"
            vmap_path.write_text(vmap(pieces), encoding="utf-8")
        _MtConverter().convert(str(out), vmap=None if vmap_path is None else str(vmap_path),
                               quantization=quantization, force=True)  # fmt: skip
    (Path(out) / "spm.model").write_bytes(sp_blobs[0])
    return Path(out)
