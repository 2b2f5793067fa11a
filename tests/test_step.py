"""The CPU decoder step (mt.fast.step) against the model's own decode, step by step."""

from __future__ import annotations

import pytest
import torch

import mt.fast.decoding
import mt.fast.native as native
import mt.fast.step
from mt.data.batches import make_src
from mt.fast.decoding import DecodingModel, for_decoding
from mt.fast.onednn import onednn_available
from mt.fast.step import applies, decoder_step
from mt.model.transformer import EncoderOut, build_model
from mt.schema import ModelConfig
from mt.vocab import BOS


def small_model(norm: str) -> torch.nn.Module:
    torch.manual_seed(3)
    cfg = ModelConfig(N=2, d_model=32, d_ff=64, h=4, dropout=0.3, norm=norm, max_positions=12)
    model = build_model(cfg, vocab_size=45).eval()  # dropout set, and off in eval mode
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))  # LayerNorm gains and biases away from 1 and 0
    return model


def sources(lengths: list[int]) -> torch.Tensor:
    g = torch.Generator().manual_seed(sum(lengths))
    return make_src([torch.randint(4, 45, (n,), generator=g).tolist() for n in lengths])


@pytest.mark.parametrize("norm", ["post", "pre"])
@pytest.mark.parametrize("G", [1, 3])  # rows per sentence: greedy, beams
@pytest.mark.parametrize("padded", [True, False])
@pytest.mark.parametrize("attend", ["torch", "kernel"])  # mt.fast.native's, where it builds
def test_the_step_computes_what_the_model_decodes(norm, G, padded, attend):
    kernel = native.short_attention() if attend == "kernel" else None
    if attend == "kernel" and kernel is None:
        pytest.skip(f"no kernel here: {native.unavailable_reason()}")  # test_native says why
    model = small_model(norm)
    src = sources([7, 3, 5] if padded else [5, 5, 5])
    g = torch.Generator().manual_seed(G)
    tokens = torch.randint(4, 45, (3 * G, 6), generator=g)
    tokens[:, 0] = BOS
    with torch.inference_mode():
        enc = model.encode(src)
        if not padded:  # a batch without padding: no mask at all
            assert bool(enc.src_mask.all())
            enc = EncoderOut(enc.memory, None)
        ours, ref = model.new_cache(), model.new_cache()
        for t in range(tokens.size(1)):
            step_in = tokens[:, t : t + 1]
            expected = model.decode(step_in, enc, ref)[:, 0]  # (B, V)
            # the first step too, making the encoder-decoder keys/values as the model does
            assert applies(step_in, ours, model)
            got = decoder_step(model, step_in, enc.memory, enc.src_mask, ours, kernel)
            got = model.project(got)
            torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
            assert ours.length == ref.length == t + 1
    # the caches hold the same keys and values
    for a, b in zip(ours.layers, ref.layers):
        torch.testing.assert_close(a.self_attn.filled(), b.self_attn.filled())
        assert torch.equal(a.cross_attn.k, b.cross_attn.k)
        assert torch.equal(a.cross_attn.v, b.cross_attn.v)


def test_the_step_applies_only_where_it_computes_the_same():
    model = small_model("post")
    src = sources([4, 2])
    tok = torch.full((2, 1), BOS)
    with torch.inference_mode():
        enc, cache = model.encode(src), model.new_cache()
        assert not applies(tok, None, model)  # no cache: the whole prefix
        assert applies(tok, cache, model)  # the first step: the step makes the keys/values
        model.decode(tok, enc, cache)
        assert applies(tok, cache, model)
        assert not applies(torch.cat([tok, tok], 1), cache, model)  # two new tokens
        with torch.autocast("cpu", torch.bfloat16):
            assert not applies(tok, cache, model)  # the model's own path casts
    model.train()
    with torch.inference_mode():
        assert not applies(tok, cache, model)  # dropout would be on
    model.eval()
    with torch.enable_grad():
        assert not applies(tok, cache, model)


def test_the_step_names_the_model_limit():
    model = small_model("post")  # max_positions 12
    src = sources([3])
    with torch.inference_mode():
        enc, cache = model.encode(src), model.new_cache()
        for _ in range(12):
            model.decode(torch.full((1, 1), 5), enc, cache)
        with pytest.raises(ValueError, match="exceeds model.max_positions=12"):
            decoder_step(model, torch.full((1, 1), 5), enc.memory, enc.src_mask, cache)


KINDS = ["torch", "int8"] + (["onednn"] if onednn_available() else [])


@pytest.mark.parametrize("kind", KINDS)
def test_every_decoding_copy_takes_the_step_and_agrees_with_its_own_modules(kind, monkeypatch):
    model = small_model("post")
    if kind == "torch":  # auto oneDNN, measured slower here
        monkeypatch.setattr(mt.fast.decoding, "onednn_decodes", lambda *a, **k: False)
        monkeypatch.setattr(mt.fast.decoding, "onednn_projects", lambda *a, **k: False)
    quantize, onednn = ("int8", True) if kind == "int8" else ("none", kind == "onednn" or None)
    fast = for_decoding(model, quantize, "fp32", onednn)
    assert fast.step and fast.module is not model
    plain = DecodingModel(fast.module, fast.head, fast.cache_dtype, step=False)
    calls = []
    real = mt.fast.step.decoder_step
    monkeypatch.setattr(mt.fast.decoding, "decoder_step", lambda *a: calls.append(1) or real(*a))
    src = sources([6, 2, 4])
    tokens = torch.randint(4, 45, (3, 5), generator=torch.Generator().manual_seed(4))
    with torch.inference_mode():
        a_enc, a_cache = fast.encode(src), fast.new_cache()
        b_enc, b_cache = plain.encode(src), plain.new_cache()
        for t in range(tokens.size(1)):
            step_in = tokens[:, t : t + 1]
            got = fast.decode(step_in, a_enc, a_cache)
            expected = plain.decode(step_in, b_enc, b_cache)
            assert got.shape == expected.shape == (3, 1, 45)
            torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    assert len(calls) == tokens.size(1)  # every step, the first included
