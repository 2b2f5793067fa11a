"""The Transformer: paper sizes, tied embeddings, causality, padding invariance, incremental
decoding, positional encodings and attention against independent computations."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from mt.fast.attention import CPUTrainingAttention
from mt.model.attention import ScaledDotProduct, SelfAttention
from mt.model.transformer import build_model
from mt.schema import ModelConfig
from mt.vocab import BOS, EOS, PAD

V = 50  # not a multiple of 8: exercises the padded vocabulary


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny shapes: threads only add synchronisation cost on a shared machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tiny(**overrides) -> ModelConfig:
    kw = dict(N=2, d_model=32, d_ff=64, h=4, dropout=0.0, max_positions=64)
    kw.update(overrides)
    return ModelConfig(**kw)


def make(seed: int = 0, **overrides):
    torch.manual_seed(seed)
    return build_model(tiny(**overrides), V).eval()


def rand_tokens(B: int, L: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(4, V, (B, L), generator=g)


def reorder(enc, cache, index: torch.Tensor):
    """Rows ``index`` of the encoder output and of the cache, kept row-aligned."""
    return enc.select(index), cache.select(index, index)


@pytest.mark.parametrize(
    "preset, paper",
    [(dict(), 65e6), (dict(d_model=1024, d_ff=4096, h=16, dropout=0.3), 213e6)],
    ids=["base", "big"],
)
def test_parameter_count_matches_paper(preset, paper):
    with torch.device("meta"):  # construct only: no memory, no init cost
        model = build_model(ModelConfig(**preset), 37000)
    count = sum(p.numel() for p in model.parameters())
    assert abs(count - paper) / paper < 0.04, count


class _Recorder(TorchFunctionMode):
    """Records the data_ptr of every embedding table and projection matrix used."""

    def __init__(self, rows: int):
        super().__init__()
        self.rows, self.embedding, self.projection = rows, [], []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.embedding:
            self.embedding.append(args[1].data_ptr())
        if func is F.linear and args[1].shape[0] == self.rows:
            self.projection.append(args[1].data_ptr())
        return func(*args, **kwargs)


def test_one_shared_embedding_tensor():
    model = make()
    Vp = model.padded_vocab
    assert Vp % 8 == 0 and Vp >= V
    tables = [p for p in model.parameters() if p.shape == (Vp, 32)]
    assert len(tables) == 1
    with _Recorder(Vp) as rec:
        model(rand_tokens(2, 5, 1), rand_tokens(2, 4, 2))
    assert len(rec.embedding) == 2 and len(rec.projection) == 1
    assert set(rec.embedding + rec.projection) == {tables[0].data_ptr()}


def test_separate_embeddings_keep_output_tied_to_target():
    model = make(share_embeddings=False)
    Vp = model.padded_vocab
    tables = [p for p in model.parameters() if p.shape == (Vp, 32)]
    assert len(tables) == 2
    with _Recorder(Vp) as rec:
        logits = model(rand_tokens(2, 5, 1), rand_tokens(2, 4, 2))
    src_ptr, tgt_ptr = rec.embedding  # encode runs before decode
    assert src_ptr != tgt_ptr
    assert rec.projection == [tgt_ptr]
    assert logits.shape == (2, 4, V)
    assert torch.isfinite(logits).all()


def test_logits_have_exactly_vocab_columns():
    model = make()
    logits = model(rand_tokens(2, 5, 1), rand_tokens(2, 4, 2))
    assert logits.shape == (2, 4, V)
    probs = logits.softmax(-1)
    assert torch.allclose(probs.sum(-1), torch.ones(2, 4), atol=1e-5)
    # The visible columns are exactly the first V rows of the tied matrix times the features.
    h = model.features(rand_tokens(2, 5, 1), rand_tokens(2, 4, 2))
    expected = h @ model.embed.detach()[:V].T
    assert torch.allclose(logits, expected, atol=1e-5)


def test_positional_encoding_matches_formula():
    model = make(d_model=32)
    D = 32
    for pos in (0, 1, 7, 63):
        for i in (0, 1, 5, 15):
            angle = pos / 10000 ** (2 * i / D)
            assert model.pe[pos, 2 * i].item() == pytest.approx(math.sin(angle), abs=1e-6)
            assert model.pe[pos, 2 * i + 1].item() == pytest.approx(math.cos(angle), abs=1e-6)
    assert "pe" not in model.state_dict()  # computed, not stored


def test_embeddings_scaled_by_sqrt_d_model():
    model = make()
    captured = {}
    model.encoder[0].register_forward_pre_hook(lambda m, args: captured.update(x=args[0]))
    src = rand_tokens(1, 4, 3)
    model.encode(src)
    expected = model.embed.detach()[src[0]] * math.sqrt(32) + model.pe[:4]
    assert torch.allclose(captured["x"][0], expected, atol=1e-5)


def test_causality():
    model = make()
    src, tgt = rand_tokens(2, 6, 1), rand_tokens(2, 7, 2)
    base = model(src, tgt)
    for t in (0, 3, 5):
        changed = tgt.clone()
        changed[:, t + 1 :] = rand_tokens(2, 7 - t - 1, 10 + t)
        out = model(src, changed)
        assert torch.allclose(out[:, : t + 1], base[:, : t + 1], atol=1e-5)
        assert not torch.allclose(out[:, t + 1 :], base[:, t + 1 :], atol=1e-3)


def test_real_positions_project_only_the_real_target_positions():
    """forward(..., batch.real) (indices found by collate on the host) returns exactly the rows
    of the full logits at the non-pad target positions, and the full logits agree with the
    model finding the padding itself."""
    from mt.data.batches import collate

    model = make()
    pairs = [(np.arange(4, 4 + n), np.arange(5, 5 + m)) for n, m in [(5, 2), (2, 4), (3, 1)]]
    batch = collate(pairs)
    full = model(batch.src, batch.tgt_in)  # (B, T, V), padding found from the ids
    kept = model(batch.src, batch.tgt_in, batch.real)
    keep = batch.tgt_out != PAD
    assert kept.shape == (batch.ntokens, V) == (int(keep.sum()), V)
    torch.testing.assert_close(kept, full[keep])
    same = collate([(np.arange(4, 7), np.arange(5, 8))] * 2)  # no padding: every position
    assert same.real == (None, None)
    flat = model(same.src, same.tgt_in, same.real)
    torch.testing.assert_close(flat, model(same.src, same.tgt_in).reshape(-1, V))


@pytest.mark.parametrize("norm", ["post", "pre"])
def test_padded_batch_gradient_is_the_sum_of_the_sentences_alone(norm):
    """The FFN runs on the real positions only (packed); padding must still change nothing:
    the gradient of a padded batch's loss equals the sum over its sentences decoded alone."""
    model = make(norm=norm).train()  # dropout 0: deterministic
    srcs = [rand_tokens(1, 5, 1), rand_tokens(1, 8, 2)]
    tgts = [rand_tokens(1, 3, 3), rand_tokens(1, 6, 4)]
    w = torch.randn(2, 6, V, generator=torch.Generator().manual_seed(5))

    def grads(src, tgt, weight):
        model.zero_grad()
        (model(src, tgt) * weight).sum().backward()
        return [p.grad.clone() for p in model.parameters()]

    alone = [grads(s, t, w[i : i + 1, : t.size(1)]) for i, (s, t) in enumerate(zip(srcs, tgts))]
    src = torch.cat([torch.cat([srcs[0], torch.full((1, 3), PAD)], 1), srcs[1]])
    tgt = torch.cat([torch.cat([tgts[0], torch.full((1, 3), PAD)], 1), tgts[1]])
    weight = w.clone()
    weight[0, 3:] = 0  # padded positions carry no loss
    batch = grads(src, tgt, weight)
    for g, a, b in zip(batch, *alone):
        torch.testing.assert_close(g, a + b, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("norm", ["post", "pre"])
def test_padding_invariance(norm):
    model = make(norm=norm)
    src, tgt = rand_tokens(1, 5, 1), rand_tokens(1, 4, 2)
    base = model(src, tgt)
    pad = torch.full((1, 3), PAD)
    src_padded = model(torch.cat([src, pad], 1), tgt)
    assert torch.allclose(src_padded, base, atol=1e-5)
    tgt_padded = model(src, torch.cat([tgt, pad], 1))
    assert torch.allclose(tgt_padded[:, :4], base, atol=1e-5)
    # In a batch with a longer sentence, the short one's logits are those it has alone.
    other_src, other_tgt = rand_tokens(1, 8, 3), rand_tokens(1, 6, 4)
    batch = model(
        torch.cat([torch.cat([src, pad], 1), other_src]),
        torch.cat([torch.cat([tgt, pad[:, :2]], 1), other_tgt]),
    )
    assert torch.allclose(batch[0, :4], base[0], atol=1e-5)
    assert torch.allclose(batch[1], model(other_src, other_tgt)[0], atol=1e-5)


def test_padding_changes_nothing_only_when_masked():
    """Sanity check that the invariance test can fail: a real token instead of PAD does."""
    model = make()
    src, tgt = rand_tokens(1, 5, 1), rand_tokens(1, 4, 2)
    other = model(torch.cat([src, torch.full((1, 1), 7)], 1), tgt)
    assert not torch.allclose(other, model(src, tgt), atol=1e-4)


@pytest.mark.parametrize("norm", ["post", "pre"])
def test_incremental_decoding_equals_full_prefix(norm):
    model = make(norm=norm)
    src = torch.cat([rand_tokens(3, 6, 1), torch.full((3, 1), EOS)], 1)
    src[2, 4:] = PAD
    tgt = torch.cat([torch.full((3, 1), BOS), rand_tokens(3, 7, 2)], 1)  # (3, 8)
    full, full_attn = model.decode(tgt, model.encode(src), need_attn=True)
    enc, cache = model.encode(src), model.new_cache()
    steps, attns = [], []
    for t in range(8):
        logits, attn = model.decode(tgt[:, t : t + 1], enc, cache, need_attn=True)
        steps.append(logits)
        attns.append(attn)
    assert torch.allclose(torch.cat(steps, 1), full, atol=1e-5)
    assert torch.allclose(torch.cat(attns, 1), full_attn, atol=1e-5)
    # Several new tokens at once after a cached prefix.
    enc, cache = model.encode(src), model.new_cache()
    first = model.decode(tgt[:, :3], enc, cache)
    rest = model.decode(tgt[:, 3:], enc, cache)
    assert torch.allclose(torch.cat([first, rest], 1), full, atol=1e-5)


def test_incremental_decoding_after_reorder():
    model = make()
    src = rand_tokens(3, 6, 1)
    tgt = torch.cat([torch.full((3, 1), BOS), rand_tokens(3, 5, 2)], 1)  # (3, 6)
    enc, cache = model.encode(src), model.new_cache()
    for t in range(3):
        model.decode(tgt[:, t : t + 1], enc, cache)
    index = torch.tensor([2, 0, 0, 1])
    enc, cache = reorder(enc, cache, index)
    new_tgt = tgt[index]
    new_tgt[1, 3:] = rand_tokens(1, 3, 9)  # rows 1 and 2 share a prefix, then diverge
    steps = [model.decode(new_tgt[:, t : t + 1], enc, cache) for t in range(3, 6)]
    full = model(src[index], new_tgt)
    assert torch.allclose(torch.cat(steps, 1), full[:, 3:], atol=1e-5)


def test_need_attn_is_a_distribution_over_real_source_tokens():
    model = make()
    src = rand_tokens(2, 6, 1)
    src[1, 3:] = PAD
    tgt = rand_tokens(2, 4, 2)
    enc = model.encode(src)
    logits, attn = model.decode(tgt, enc, need_attn=True)
    assert attn.shape == (2, 4, 6)
    assert torch.allclose(attn.sum(-1), torch.ones(2, 4), atol=1e-5)
    assert (attn[1, :, 3:] == 0).all()
    assert torch.allclose(logits, model.decode(tgt, enc), atol=1e-5)  # explicit path == SDPA


@pytest.mark.parametrize("core", ["sdpa", "cpu_training"])
def test_sdpa_equals_plain_softmax_attention(core):
    """The model's core (SDPA) and mt.fast's training core (written out) give the formula."""
    attention = {
        "sdpa": ScaledDotProduct(),
        "cpu_training": CPUTrainingAttention(),
    }[core]
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 5, 8, generator=g) for _ in range(3))
    k, v = torch.randn(2, 3, 6, 8, generator=g), torch.randn(2, 3, 6, 8, generator=g)
    mask = torch.ones(2, 1, 1, 6, dtype=torch.bool)
    mask[1, ..., 4:] = False
    scores = q @ k.transpose(-2, -1) / math.sqrt(8)
    scores = scores.masked_fill(~mask, float("-inf"))
    expected = torch.softmax(scores, -1) @ v
    for need_weights in (False, True):
        with torch.no_grad():  # the explicit short-query path is for inference
            out, _ = attention(q, k, v, mask=mask, need_weights=need_weights)
        assert torch.allclose(out, expected, atol=1e-5)
    # Causal path.
    qc, kc, vc = q, torch.randn(2, 3, 5, 8, generator=g), torch.randn(2, 3, 5, 8, generator=g)
    causal = torch.ones(5, 5).tril().bool()
    s = (qc @ kc.transpose(-2, -1) / math.sqrt(8)).masked_fill(~causal, float("-inf"))
    with torch.no_grad():
        out, _ = attention(qc, kc, vc, is_causal=True)
    assert torch.allclose(out, torch.softmax(s, -1) @ vc, atol=1e-5)


def test_multi_head_self_attention_written_out():
    torch.manual_seed(0)
    D, H = 16, 4
    mha = SelfAttention(D, H, attention_dropout=0.0).eval()
    x = torch.randn(2, 5, D)
    Wq, Wk, Wv = mha.qkv.weight.detach().split(D)
    bq, bk, bv = mha.qkv.bias.detach().split(D)
    heads = []
    for i in range(H):
        sl = slice(i * D // H, (i + 1) * D // H)
        q = x @ Wq[sl].T + bq[sl]
        k = x @ Wk[sl].T + bk[sl]
        v = x @ Wv[sl].T + bv[sl]
        heads.append(torch.softmax(q @ k.transpose(1, 2) / math.sqrt(D // H), -1) @ v)
    expected = torch.cat(heads, -1) @ mha.out.weight.detach().T + mha.out.bias.detach()
    assert torch.allclose(mha(x), expected, atol=1e-5)


def test_xavier_uniform_initialisation():
    model = make(d_model=32, d_ff=64)
    bound_dd = math.sqrt(6 / (32 + 32))
    qkv = model.encoder[0].self_attn.qkv.weight
    assert qkv.abs().max() <= bound_dd
    assert qkv.abs().max() > 0.9 * bound_dd  # uses the range: each D x D block separately
    w1 = model.encoder[0].ffn.w1.weight
    assert w1.abs().max() <= math.sqrt(6 / (32 + 64))
    assert model.encoder[0].ffn.w1.bias.abs().max() == 0
    assert model.embed[PAD].abs().max() == 0


@pytest.mark.parametrize("norm", ["post", "pre"])
def test_both_norms_train_on_a_copy_task(norm):
    torch.manual_seed(0)
    model = build_model(tiny(norm=norm, dropout=0.1), V).train()
    src = torch.cat([rand_tokens(8, 6, 1), torch.full((8, 1), EOS)], 1)
    tgt_in = torch.cat([torch.full((8, 1), BOS), src[:, :-1]], 1)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(25):
        loss = F.cross_entropy(model(src, tgt_in).reshape(-1, V), src.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]
    if norm == "pre":
        assert isinstance(model.encoder_norm, torch.nn.LayerNorm)
        assert isinstance(model.decoder_norm, torch.nn.LayerNorm)


@pytest.mark.parametrize("overrides", [dict(dropout=0.0), dict(dropout=0.0, attention_dropout=0.0)])
def test_zero_dropout_is_deterministic_in_train_mode(overrides):
    model = make(**overrides).train()
    src, tgt = rand_tokens(2, 5, 1), rand_tokens(2, 4, 2)
    assert torch.equal(model(src, tgt), model(src, tgt))


@pytest.mark.parametrize("overrides", [dict(dropout=0.3), dict(dropout=0.0, attention_dropout=0.5)])
def test_dropout_is_active_in_train_mode_only(overrides):
    model = make(**overrides).train()
    src, tgt = rand_tokens(2, 5, 1), rand_tokens(2, 4, 2)
    assert not torch.allclose(model(src, tgt), model(src, tgt))
    model.eval()
    assert torch.equal(model(src, tgt), model(src, tgt))


def test_too_long_input_is_an_error():
    model = make(max_positions=8)
    with pytest.raises(ValueError, match="max_positions"):
        model.encode(rand_tokens(1, 9, 1))
    enc, cache = model.encode(rand_tokens(1, 4, 1)), model.new_cache()
    model.decode(rand_tokens(1, 8, 2), enc, cache)
    with pytest.raises(ValueError, match="max_positions"):
        model.decode(rand_tokens(1, 1, 3), enc, cache)


def test_build_model_from_checkpoint_dict():
    cfg = tiny(N_dec=1)
    model = build_model(cfg.__dict__.copy(), V)
    assert len(model.encoder) == 2 and len(model.decoder) == 1
    other = build_model(cfg, V)
    other.load_state_dict(model.state_dict())


def test_incremental_decoding_past_cache_capacity():
    """The self-attention cache starts with 16 positions and grows: 20 steps cross the limit."""
    model = make()
    src = rand_tokens(2, 5, 1)
    tgt = torch.cat([torch.full((2, 1), BOS), rand_tokens(2, 19, 2)], 1)  # (2, 20)
    enc, cache = model.encode(src), model.new_cache()
    with torch.inference_mode():
        steps = [model.decode(tgt[:, t : t + 1], enc, cache) for t in range(18)]
        index = torch.tensor([1, 0, 1])  # a reorder after the growth, then two more steps
        enc, cache = reorder(enc, cache, index)
        steps = [s[index] for s in steps]
        steps += [model.decode(tgt[index, t : t + 1], enc, cache) for t in range(18, 20)]
        full = model(src[index], tgt[index])
    assert torch.allclose(torch.cat(steps, 1), full, atol=1e-5)


def test_shared_encoder_rows_equal_full_reorder():
    """K decoder rows per encoder row (cache.select) give what expanded rows give (reorder)."""
    model = make()
    K = 3
    src = torch.cat([rand_tokens(2, 6, 1), torch.full((2, 1), EOS)], 1)
    src[1, 3:] = PAD
    tgt = torch.cat([torch.full((6, 1), BOS), rand_tokens(6, 6, 2)], 1)  # (2*K, 7)
    expand = torch.arange(2).repeat_interleave(K)
    with torch.inference_mode():
        enc_g, cache_g = model.encode(src), model.new_cache()  # 2 encoder rows for 6 decoder rows
        enc_f, cache_f = reorder(model.encode(src), model.new_cache(), expand)
        for t in range(3):
            a = model.decode(tgt[:, t : t + 1], enc_g, cache_g)
            b = model.decode(tgt[:, t : t + 1], enc_f, cache_f)
            assert torch.allclose(a, b, atol=1e-5)
        beams = torch.tensor([2, 2, 0, 4, 3, 3])  # reorder within each sentence
        cache_g = cache_g.select(beams)  # the encoder rows stay
        enc_f, cache_f = reorder(enc_f, cache_f, beams)
        a, attn_a = model.decode(tgt[:, 3:4], enc_g, cache_g, need_attn=True)
        b, attn_b = model.decode(tgt[:, 3:4], enc_f, cache_f, need_attn=True)
        assert torch.allclose(a, b, atol=1e-5) and torch.allclose(attn_a, attn_b, atol=1e-6)
        # drop sentence 0 and reorder the beams of sentence 1
        rows, sents = torch.tensor([5, 3, 3]), torch.tensor([1])
        enc_g, cache_g = enc_g.select(sents), cache_g.select(rows, sents)
        enc_f, cache_f = reorder(enc_f, cache_f, rows)
        a = model.decode(tgt[rows, 4:5], enc_g, cache_g)
        b = model.decode(tgt[rows, 4:5], enc_f, cache_f)
        assert enc_g.memory.size(0) == 1 and torch.allclose(a, b, atol=1e-5)
        # both equal the full teacher-forced decoder on the rows' histories
        history = torch.cat([tgt[beams][rows][:, :3], tgt[rows, 3:5]], 1)
        full = model(src[[1, 1, 1]], history)[:, -1:]
    assert torch.allclose(a, full, atol=1e-5)
