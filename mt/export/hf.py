"""Export to Hugging Face ``transformers``: a Marian-style encoder-decoder computing mt's function.

``MarianMTModel`` has the paper's architecture (post-LN, ReLU FFN, embeddings scaled by
sqrt(d_model), sinusoidal positions from 0, no final LayerNorm, a tied output projection), but
three conventions differ from mt, and each is made exact rather than near:

* **Positional table layout.** mt interleaves ``PE[:, 2i] = sin``, ``PE[:, 2i+1] = cos``; Marian
  puts all the sines first, then all the cosines, and recomputes that table when it loads (the
  stored table is ignored). Both use the same frequencies, so Marian's table is mt's with its
  columns permuted: ``PE_hf = PE_mt[:, perm]``, ``perm = [0, 2, 4, ..., 1, 3, 5, ...]``. The
  exporter permutes the hidden (d_model) dimension of *every* weight the same way: embedding
  columns, the inputs of Q/K/V/FFN-in, the outputs (and biases) of W^O/FFN-out, LayerNorm
  gains and biases. LayerNorm, ReLU and attention are equivariant under such a permutation, and
  the logits ``h E^T`` are unchanged by it, so the exported model computes mt's logits.
* **Special ids and start token.** mt fixes pad=0, unk=1, bos=2, eos=3 and starts decoding with
  BOS; Marian's defaults start with PAD. The config sets ``decoder_start_token_id = 2``, and the
  generation config forbids PAD and BOS (mt's search never produces them).
* **Vocabulary padding.** mt pads its embedding rows to a multiple of ``vocab_multiple``; only
  the ``vocab_size`` real rows are exported (the padded ones never receive probability in mt).

The tokenizer is a ``MarianTokenizer``: mt's joint SentencePiece model as both ``source.spm``
and ``target.spm`` and a ``vocab.json`` mapping every piece to its SentencePiece id, so
``AutoTokenizer`` gives mt's ids (source pieces + EOS).

Shape letters: V vocabulary, D d_model.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from mt.schema import ModelConfig, attention_dropout
from mt.vocab import BOS, EOS, PAD, UNK

log = logging.getLogger(__name__)


class ExportError(ValueError):
    """A checkpoint that cannot be exported: names the setting the target has no equivalent for."""


def hidden_permutation(d_model: int) -> torch.Tensor:
    """``perm`` with ``PE_marian[:, c] = PE_mt[:, perm[c]]``: even columns, then odd ones.

    Example:
        >>> hidden_permutation(6).tolist()
        [0, 2, 4, 1, 3, 5]
    """
    return torch.cat([torch.arange(0, d_model, 2), torch.arange(1, d_model, 2)])


def check_exportable(cfg: ModelConfig, joint_tokenizer: bool, target: str) -> None:
    """Refuse settings that the target format cannot express: an ExportError names the setting
    (e.g. ``model.norm=pre``)."""
    if cfg.norm != "post":
        raise ExportError(
            f"model.norm={cfg.norm}: the {target} export supports the paper's post-LN "
            f"Transformer only (a Marian model has no pre-LN layers and final LayerNorms)"
        )
    if cfg.d_model % 2:
        raise ExportError(f"model.d_model={cfg.d_model}: the sinusoidal table needs an even size")
    if not joint_tokenizer:
        raise ExportError(
            "tokenizer.joint=false: this exporter writes one joint SentencePiece vocabulary; "
            "separate source/target vocabularies are not supported"
        )


def marian_config(cfg: ModelConfig, vocab_size: int):
    """The ``MarianConfig`` of an mt model: same shape, mt's special ids and start token."""
    from transformers import MarianConfig

    attn_p = attention_dropout(cfg)
    return MarianConfig(
        vocab_size=vocab_size, decoder_vocab_size=vocab_size, d_model=cfg.d_model,
        encoder_layers=cfg.N, decoder_layers=cfg.N_dec or cfg.N,
        encoder_attention_heads=cfg.h, decoder_attention_heads=cfg.h,
        encoder_ffn_dim=cfg.d_ff, decoder_ffn_dim=cfg.d_ff,
        activation_function="relu", dropout=cfg.dropout, attention_dropout=attn_p,
        activation_dropout=0.0, max_position_embeddings=cfg.max_positions, scale_embedding=True,
        share_encoder_decoder_embeddings=cfg.share_embeddings, tie_word_embeddings=True,
        pad_token_id=PAD, bos_token_id=BOS, eos_token_id=EOS, decoder_start_token_id=BOS,
        forced_eos_token_id=None, architectures=["MarianMTModel"],
    )  # fmt: skip


def marian_state_dict(state: dict[str, torch.Tensor], cfg: ModelConfig, vocab_size: int):
    """mt's ``Transformer.state_dict()`` renamed and permuted for ``MarianMTModel`` (see the
    module docstring): float32 tensors, the ``vocab_size`` real vocabulary rows only."""
    p = hidden_permutation(cfg.d_model)
    out: dict[str, torch.Tensor] = {}

    def cols(w: torch.Tensor) -> torch.Tensor:  # the input side is the residual stream
        return w[:, p].contiguous()

    def rows(w: torch.Tensor) -> torch.Tensor:  # the output side is the residual stream
        return w[p].contiguous()

    def attn(dst: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, src: str) -> None:
        for name, w in (("q_proj", q), ("k_proj", k), ("v_proj", v)):
            out[f"{dst}.{name}.weight"] = cols(w[0])
            out[f"{dst}.{name}.bias"] = w[1].clone()
        out[f"{dst}.out_proj.weight"] = rows(state[f"{src}.out.weight"])
        out[f"{dst}.out_proj.bias"] = rows(state[f"{src}.out.bias"])

    def norm(dst: str, src: str) -> None:
        out[f"{dst}.weight"] = rows(state[f"{src}.weight"])
        out[f"{dst}.bias"] = rows(state[f"{src}.bias"])

    def ffn(dst: str, src: str) -> None:
        out[f"{dst}.fc1.weight"] = cols(state[f"{src}.w1.weight"])
        out[f"{dst}.fc1.bias"] = state[f"{src}.w1.bias"].clone()
        out[f"{dst}.fc2.weight"] = rows(state[f"{src}.w2.weight"])
        out[f"{dst}.fc2.bias"] = rows(state[f"{src}.w2.bias"])

    def split(prefix: str, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return list(zip(state[f"{prefix}.weight"].chunk(n), state[f"{prefix}.bias"].chunk(n)))

    for side, layers in (("encoder", cfg.N), ("decoder", cfg.N_dec or cfg.N)):
        for i in range(layers):
            src, dst = f"{side}.{i}", f"model.{side}.layers.{i}"
            attn(f"{dst}.self_attn", *split(f"{src}.self_attn.qkv", 3), f"{src}.self_attn")
            norm(f"{dst}.self_attn_layer_norm", f"{src}.norms.0")
            if side == "decoder":
                q = (state[f"{src}.cross_attn.q.weight"], state[f"{src}.cross_attn.q.bias"])
                kv = split(f"{src}.cross_attn.kv", 2)
                attn(f"{dst}.encoder_attn", q, *kv, f"{src}.cross_attn")
                norm(f"{dst}.encoder_attn_layer_norm", f"{src}.norms.1")
            ffn(dst, f"{src}.ffn")
            norm(f"{dst}.final_layer_norm", f"{src}.norms.{1 + (side == 'decoder')}")
    tgt = cols(state["embed"][:vocab_size])  # (V, D)
    if cfg.share_embeddings:
        out["model.shared.weight"] = tgt
        out["model.encoder.embed_tokens.weight"] = tgt
    else:
        out["model.encoder.embed_tokens.weight"] = cols(state["src_embed"][:vocab_size])
    out["model.decoder.embed_tokens.weight"] = tgt
    out["lm_head.weight"] = tgt
    out["final_logits_bias"] = torch.zeros(1, vocab_size)
    return {k: v.float() for k, v in out.items()}


def build_marian(state: dict[str, torch.Tensor], cfg: ModelConfig, vocab_size: int):
    """A ``MarianMTModel`` (eval mode) holding mt's weights; an ExportError when a weight of
    the Marian model was left unset, or one of mt's had no place."""
    from transformers import GenerationConfig, MarianMTModel

    check_exportable(cfg, True, "hf")
    model = MarianMTModel(marian_config(cfg, vocab_size)).eval()
    weights = marian_state_dict(state, cfg, vocab_size)
    missing, unexpected = model.load_state_dict(weights, strict=False)
    # The positional tables are recomputed by Marian (checked in the tests against mt's).
    missing = [k for k in missing if not k.endswith("embed_positions.weight")]
    if missing or unexpected:
        raise ExportError(f"weights do not map onto MarianMTModel: missing {missing}, "
                          f"unexpected {unexpected}")  # fmt: skip
    model.generation_config = GenerationConfig(
        decoder_start_token_id=BOS,
        bos_token_id=BOS,
        eos_token_id=EOS,
        pad_token_id=PAD,
        suppress_tokens=[PAD, BOS],  # mt's search never generates these
        early_stopping=True,  # mt's rule: stop when num_beams hypotheses have finished
        num_beams=4,
        # The output cap as mt states it (new tokens, the start token not counted), and only
        # that: a max_length beside it makes transformers warn on every generate that passes
        # max_new_tokens.
        max_new_tokens=min(cfg.max_positions, 512) - 1,
    )
    return model


def sentencepiece_pieces(sp_blob: bytes, vocab_size: int) -> list[str]:
    """The joint SentencePiece model's pieces in id order; refused unless it has the model's
    ``vocab_size`` pieces."""
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_proto=sp_blob)
    if sp.vocab_size() != vocab_size:
        raise ExportError(f"the SentencePiece model has {sp.vocab_size()} pieces, the model "
                          f"{vocab_size}")  # fmt: skip
    return [sp.id_to_piece(i) for i in range(vocab_size)]


def write_tokenizer(sp_blob: bytes, vocab_size: int, out: Path) -> None:
    """``source.spm`` = ``target.spm`` = the joint model, ``vocab.json`` = piece -> SentencePiece
    id, and ``tokenizer_config.json`` naming ``MarianTokenizer``."""
    pieces = sentencepiece_pieces(sp_blob, vocab_size)
    for name in ("source.spm", "target.spm"):
        (out / name).write_bytes(sp_blob)
    vocab = {piece: i for i, piece in enumerate(pieces)}
    (out / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    config = {
        "tokenizer_class": "MarianTokenizer",
        "unk_token": pieces[UNK],
        "eos_token": pieces[EOS],
        "pad_token": pieces[PAD],
        "model_max_length": 1024,
        "separate_vocabs": False,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    specials = {pieces[i]: i for i in (PAD, UNK, BOS, EOS)}
    log.info("tokenizer written: %d pieces, specials %s", vocab_size, specials)


def export_hf(ckpt: dict, cfg: ModelConfig, sp_blobs: list[bytes], out: Path) -> Path:
    """Write a ``transformers`` directory (config, safetensors weights, generation config,
    tokenizer) for a loaded mt checkpoint dict; returns ``out``."""
    check_exportable(cfg, len(sp_blobs) == 1, "hf")
    vocab_size = int(ckpt["vocab_size"])
    model = build_marian(ckpt["model"], cfg, vocab_size)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    write_tokenizer(sp_blobs[0], vocab_size, out)
    return out
