"""The CPU decoder step (mt.fast.step) against the model's own decode, step by step."""

from __future__ import annotations

import pytest
import torch

import mt.fast.decoding
import mt.fast.native as native
import mt.fast.step
from mt.data.batches import make_src
from mt.decode.search import generate, greedy_search, max_lengths
from mt.decode.shortlist import Shortlist
from mt.decode.strategies import Beam, Greedy, Sampling
from mt.fast.decoding import DecodingModel, for_decoding
from mt.fast.onednn import onednn_available
from mt.fast.step import FusedStep, applies, decoder_step
from mt.model.transformer import EncoderOut, build_model
from mt.schema import ModelConfig
from mt.vocab import BOS, EOS


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


def int8_kernel_or_skip(monkeypatch) -> str:
    """The int8 kernel of mt's that runs here (vnni, else avx2), set for ``Int8Linear``; skip
    where neither does (``tests/test_search.py`` tests the kernels themselves)."""
    for kernel in ("vnni", "avx2"):
        if native.int8_linear(kernel) is not None:
            monkeypatch.setenv("MT_INT8_KERNEL", kernel)
            return kernel
    pytest.skip(f"no int8 kernel of mt's here: {native.unavailable_reason() or 'no AVX2'}")


def grown_model(norm: str, max_positions: int = 12) -> torch.nn.Module:
    torch.manual_seed(5)
    cfg = ModelConfig(N=2, d_model=32, d_ff=64, h=4, dropout=0.1, norm=norm,
                      max_positions=max_positions)  # fmt: skip
    model = build_model(cfg, vocab_size=45).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


KINDS = ["linear", "int8", "f32"] + (["onednn"] if onednn_available() else [])


def decoding_copy(model, kind: str, monkeypatch):
    """``for_decoding``'s copy of ``model`` whose products are of ``kind``: int8 (mt's kernels
    where they run, else fbgemm's), torch's float32 (``nn.Linear``, where the others measured
    slower), oneDNN's float32 or mt's (``f32``)."""
    if kind == "int8":
        return for_decoding(model, "int8", "fp32")
    if kind == "f32":
        if native.f32_linear() is None:
            pytest.skip(f"no float32 kernel here: {native.unavailable_reason() or 'no AVX2'}")
        return for_decoding(model, "none", "fp32", "mt")
    if kind == "linear":
        monkeypatch.setattr(mt.fast.decoding, "fp32_products", lambda *a, **k: "torch")
        monkeypatch.setattr(mt.fast.decoding, "onednn_projects", lambda *a, **k: False)
        return for_decoding(model, "none", "fp32", None)
    return for_decoding(model, "none", "fp32", True)


def assert_steps_agree(fast, other, steps: int) -> None:
    """``fast`` and ``other`` (decoding models) give the same logits, to 1e-4, at each of
    ``steps`` steps of three sentences' random tokens."""
    src = sources([6, 2, 4])
    tokens = torch.randint(4, 45, (3, steps), generator=torch.Generator().manual_seed(4))
    with torch.inference_mode():
        a_enc, a_cache = fast.encode(src), fast.new_cache()
        b_enc, b_cache = other.encode(src), other.new_cache()
        for t in range(steps):
            step_in = tokens[:, t : t + 1]
            got = fast.decode(step_in, a_enc, a_cache)
            expected = other.decode(step_in, b_enc, b_cache)
            assert got.shape == expected.shape == (3, 1, 45)
            torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kind", KINDS)
def test_every_decoding_copy_takes_the_step_and_agrees_with_its_own_modules(kind, monkeypatch):
    model = small_model("post")
    fast = decoding_copy(model, kind, monkeypatch)
    assert fast.step and fast.module is not model
    plain = DecodingModel(fast.module, fast.head, fast.cache_dtype, step=False)
    calls = []
    real = mt.fast.step.decoder_step
    monkeypatch.setattr(mt.fast.decoding, "decoder_step", lambda *a: calls.append(1) or real(*a))
    fused = FusedStep.__call__  # where it runs the copy's products: the step in one call
    monkeypatch.setattr(FusedStep, "__call__", lambda *a: calls.append(1) or fused(*a))
    assert_steps_agree(fast, plain, 5)
    assert len(calls) == 5  # every step, the first included


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("norm", ["post", "pre"])
@pytest.mark.parametrize("G", [1, 3])
@pytest.mark.parametrize("padded", [True, False])
def test_the_fused_step_computes_what_the_layers_compute(kind, norm, G, padded, monkeypatch):
    """``FusedStep`` (every layer in one C++ call) against the same copy stepped layer by layer
    (``decoder_step`` with mt's attention kernel), for each kind of product: the same outputs
    to float rounding at every step, 20 steps (the caches grow past their first 16
    positions), the same caches."""
    if native.decoder_step() is None:
        pytest.skip(f"no kernels here: {native.unavailable_reason()}")
    if kind == "int8":
        int8_kernel_or_skip(monkeypatch)
    copy = decoding_copy(grown_model(norm, max_positions=24), kind, monkeypatch)
    fused, kernel = copy.fused, native.short_attention()
    assert fused is not None and fused.products.startswith(kind)
    assert fused.pre_norm == (norm == "pre")
    module = copy.module
    src = sources([7, 3, 5] if padded else [5, 5, 5])
    tokens = torch.randint(4, 45, (3 * G, 20), generator=torch.Generator().manual_seed(G))
    tokens[:, 0] = BOS
    with torch.inference_mode():
        enc = module.encode(src)
        if not padded:
            enc = EncoderOut(enc.memory, None)
        ours, ref = copy.new_cache(), copy.new_cache()
        for t in range(tokens.size(1)):
            step_in = tokens[:, t : t + 1]
            expected = decoder_step(module, step_in, enc.memory, enc.src_mask, ref, kernel)
            got = fused(module, step_in, enc.memory, enc.src_mask, ours)
            assert got.shape == expected.shape == (3 * G, 32)
            torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
            assert ours.length == ref.length == t + 1
    for a, b in zip(ours.layers, ref.layers):
        assert a.self_attn.k.size(2) == 32  # grown from 16 as append grows it
        torch.testing.assert_close(a.self_attn.filled(), b.self_attn.filled(), atol=1e-4,
                                   rtol=1e-4)  # fmt: skip
        assert torch.equal(a.cross_attn.k, b.cross_attn.k)


@pytest.mark.parametrize("kind", KINDS)
def test_decoding_copies_take_the_fused_step_where_it_runs_their_products(kind, monkeypatch):
    """``for_decoding`` steps through ``FusedStep`` for int8 copies on mt's kernels and
    float32 copies on oneDNN's or torch's products, its decode giving the layer-by-layer
    copy's logits; int8 on fbgemm's products, or with mt's kernels off, layer by layer."""
    if native.decoder_step() is None:
        pytest.skip(f"no kernels here: {native.unavailable_reason()}")
    if kind == "int8":
        int8_kernel_or_skip(monkeypatch)
    model = grown_model("post")
    fast = decoding_copy(model, kind, monkeypatch)
    assert fast.fused is not None
    layered = DecodingModel(fast.module, fast.head, fast.cache_dtype, step=True,
                            kernel=fast.kernel)  # fmt: skip
    assert_steps_agree(fast, layered, 6)
    if kind == "int8":
        kernel = int8_kernel_or_skip(monkeypatch)
        assert fast.fused.products == f"int8-{kernel}"
        monkeypatch.setenv("MT_INT8_KERNEL", "fbgemm")
        assert for_decoding(grown_model("post"), "int8", "fp32").fused is None
        monkeypatch.setenv("MT_INT8_KERNEL", kernel)
    assert for_decoding(grown_model("post"), "int8", "fp32", native=False).fused is None


def test_the_fused_step_names_what_does_not_fit(monkeypatch):
    """The operator's checks: a wrong number of parameters, a cache without room for the new
    position, an unknown kind of product, each said with what was given; and a step beyond the
    model's positions, as the layer-by-layer step names it."""
    if native.decoder_step() is None:
        pytest.skip(f"no kernels here: {native.unavailable_reason()}")
    copy = decoding_copy(grown_model("post"), "linear", monkeypatch)
    fused = copy.fused
    x = torch.randn(2, 32)
    cache = [torch.zeros(2, 4, 3, 8) for _ in range(2)]
    cross = [torch.zeros(2, 4, 5, 8) for _ in range(2)]

    def call(params, past, products="linear"):
        fused.op(x, params, fused.widths, cache, cache, past, cross, cross, None, 4, False,
                 1e-5, products)  # fmt: skip

    with pytest.raises(RuntimeError, match="2 layers need 60 parameters"):
        call(fused.params[:-1], 0)
    with pytest.raises(RuntimeError, match="no room for position 3"):
        call(fused.params, 3)
    with pytest.raises(RuntimeError, match="products int4 are not"):
        call(fused.params, 0, "int4")
    module, src = copy.module, sources([3])  # max_positions 12: the model's limit, named
    with torch.inference_mode():
        enc, state = module.encode(src), copy.new_cache()
        for _ in range(12):
            fused(module, torch.full((1, 1), 5), enc.memory, enc.src_mask, state)
        with pytest.raises(ValueError, match="exceeds model.max_positions=12"):
            fused(module, torch.full((1, 1), 5), enc.memory, enc.src_mask, state)


def test_decoding_copies_keep_the_memory_decoding_frees(monkeypatch):
    """``for_decoding`` keeps freed memory in the process (glibc: no page faults for the next
    batch's caches) wherever it builds a copy, and leaves the allocator alone where the model as
    written decodes."""
    calls = []
    monkeypatch.setattr(mt.fast.decoding, "hold_freed_memory", lambda: calls.append(1) or True)
    model = small_model("post")
    assert for_decoding(model, "none", "fp32", False).module is model  # as written
    assert not calls
    for_decoding(model, "int8", "fp32")
    assert calls


class Stepwise(DecodingModel):
    """A decoding copy that searches step by step from Python (each step still the fused one):
    what the whole searches in one call are checked against."""

    def greedy_search(self, *args):
        return None

    def beam_search(self, *args):
        return None


def stepwise(copy: DecodingModel) -> Stepwise:
    return Stepwise(copy.module, copy.head, copy.cache_dtype, step=True, kernel=copy.kernel,
                    fused=copy.fused)  # fmt: skip


def eos_prone_model(norm: str) -> torch.nn.Module:
    """``grown_model`` whose EOS logits swing widely (its embedding row x 4), so that a greedy
    search of random weights ends some sentences with EOS before their length limits."""
    model = grown_model(norm, max_positions=24)
    with torch.no_grad():
        model.embed[EOS].mul_(4.0)
    return model


def a_shortlist(n: int, seed: int = 0) -> Shortlist:
    """A shortlist of 45-piece models' pieces for n sentences: the special ones and 26 others,
    each sentence allowed about two thirds of them (the special ones always)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.cat([torch.arange(4), 4 + torch.randperm(41, generator=g)[:26].sort().values])
    allowed = torch.rand(n, len(ids), generator=g) < 0.67
    allowed[:, :4] = True
    return Shortlist(ids, allowed)


def assert_within(hyps: list, shortlist: Shortlist | None) -> None:
    """Each sentence's hypotheses use only the pieces its row of ``shortlist`` allows."""
    if shortlist is None:
        return
    for i, h in enumerate(hyps):
        own = set(shortlist.ids[torch.isfinite(shortlist.bias[i])].tolist())
        for x in h if isinstance(h, list) else [h]:
            assert set(x.tokens) <= own


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("norm", ["post", "pre"])
def test_the_whole_greedy_search_in_one_call_finds_what_the_steps_find(kind, norm, monkeypatch):
    """``mt::greedy_search`` (``FusedStep.greedy``) against ``generate``'s loop over the same
    copy's steps: the same tokens, scores and log-probabilities, bit for bit (the products see
    the same rows in the same order), for sentences ending at EOS and at their length limits
    in one batch, with min_len and a length penalty, over the whole vocabulary and over a
    shortlist (each sentence its own pieces; the shortlist left as it was)."""
    if native.greedy_search() is None:
        pytest.skip(f"no kernels here: {native.unavailable_reason()}")
    if kind == "int8":
        int8_kernel_or_skip(monkeypatch)
    copy = decoding_copy(eos_prone_model(norm), kind, monkeypatch)
    assert copy.fused is not None and copy.fused.head is not None
    calls = []
    whole = FusedStep.greedy
    monkeypatch.setattr(FusedStep, "greedy", lambda *a: calls.append(1) or whole(*a))
    src = sources([7, 3, 5, 1, 6, 2, 4, 8, 5, 3])
    shortlist = a_shortlist(len(src))
    bias = shortlist.bias.clone()
    ends = set()
    # min_len 18: the caches grow past their first 16 positions
    for min_len, b, alpha in [(0, 2, 0.0), (2, 6, 1.0), (0, 14, 0.6), (18, 14, 0.0)]:
        for sl in (None, shortlist):
            got = greedy_search(copy, src, 1.0, b, min_len, alpha, shortlist=sl)
            expected = greedy_search(stepwise(copy), src, 1.0, b, min_len, alpha, shortlist=sl)
            assert got == expected
            assert_within(got, sl)
            limits = max_lengths(src, 1.0, b, copy)
            ends |= {len(h.tokens) < limit for h, limit in zip(got, limits)}
            assert all(len(h.tokens) >= min(min_len, limit) for h, limit in zip(got, limits))
    assert ends == {True, False}  # both kinds of end were searched
    assert len(calls) == 8
    assert torch.equal(shortlist.bias, bias)  # the operator moved a copy of its rows


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("norm", ["post", "pre"])
@pytest.mark.parametrize("K", [2, 4])
def test_the_whole_beam_search_in_one_call_finds_what_the_steps_find(kind, norm, K, monkeypatch):
    """``mt::beam_search`` (``FusedStep.beam``) against ``generate``'s loop with ``Beam(K)``
    over the same copy's steps and ``mt::top_tokens``: the same n-best lists, tokens, scores
    and log-probabilities bit for bit, for sentences ending with K finished hypotheses, settled
    early or not, at their length limits, with min_len and length penalties, over the whole
    vocabulary and over a shortlist."""
    if native.beam_search() is None:
        pytest.skip(f"no kernels here: {native.unavailable_reason()}")
    if kind == "int8":
        int8_kernel_or_skip(monkeypatch)
    copy = decoding_copy(eos_prone_model(norm), kind, monkeypatch)
    calls = []
    whole = FusedStep.beam
    monkeypatch.setattr(FusedStep, "beam", lambda *a: calls.append(1) or whole(*a))
    src = sources([7, 3, 5, 1, 6, 2, 4, 8, 5, 3])
    ends, settings = set(), [(0, 0.0, 2, 0.0, K, True), (2, 1.0, 6, 1.0, K, True),
                             (0, 1.0, 14, 0.6, 1, False), (1, 1.0, 14, 1.5, 2, True),
                             (18, 1.0, 14, 0.0, 1, True)]  # fmt: skip (18: caches grow past 16)
    shortlist = a_shortlist(len(src), seed=K)
    for min_len, a, b, alpha, nbest, settle in settings:
        for sl in (None, shortlist):
            args = (a, b, nbest, min_len, alpha, None, settle, sl)
            got = generate(copy, src, Beam(K), *args)
            expected = generate(stepwise(copy), src, Beam(K), *args)
            assert got == expected
            assert_within(got, sl)
            assert all(1 <= len(h) <= nbest for h in got)
            limits = max_lengths(src, a, b, copy)
            ends |= {len(x.tokens) < limit for h, limit in zip(got, limits) for x in h}
    assert ends == {True, False}  # ended with EOS, and at the length limit
    assert len(calls) == 2 * len(settings)


@pytest.mark.parametrize("K", [1, 3])
def test_the_whole_searches_drop_what_the_loop_drops(K, monkeypatch):
    """A sentence whose scores stop being finite (NaN logits) ends without a hypothesis, in
    one call as in the loop."""
    if native.beam_search() is None:
        pytest.skip(f"no kernels here: {native.unavailable_reason()}")
    model = eos_prone_model("post")
    with torch.no_grad():
        model.embed[7] = float("nan")  # its logit NaN in every row
    copy = decoding_copy(model, "linear", monkeypatch)
    src = sources([4, 2, 5])
    strategy = Greedy() if K == 1 else Beam(K)
    assert generate(copy, src, strategy) == generate(stepwise(copy), src, strategy)
    assert generate(copy, src, strategy) == [[], [], []]


def test_the_whole_searches_run_only_where_they_compute_the_same(monkeypatch):
    """``generate`` takes the one call for greedy and beam search without a prefix, with or
    without a shortlist; prefixes and sampling step from Python; a copy whose head is not a
    product the call runs (int8 on fbgemm) has no fused step to take it from."""
    if native.greedy_search() is None:
        pytest.skip(f"no kernels here: {native.unavailable_reason()}")
    copy = decoding_copy(eos_prone_model("post"), "linear", monkeypatch)
    calls = []
    for name in ("greedy", "beam"):
        whole = getattr(FusedStep, name)
        monkeypatch.setattr(FusedStep, name,
                            lambda *a, name=name, f=whole: calls.append(name) or f(*a))  # fmt: skip
    src = sources([4, 2, 5])
    generate(copy, src, Greedy())
    generate(copy, src, Beam(2))
    assert calls == ["greedy", "beam"]
    for strategy in (Greedy(), Beam(2)):
        generate(copy, src, strategy, prefix=[[5], [], [6, 7]])
        generate(copy, src, strategy, prefix=[[5], [], []], shortlist=Shortlist(torch.arange(45)))
    generate(copy, src, Sampling([0, 1, 2]))
    assert calls == ["greedy", "beam"]
    for strategy in (Greedy(), Beam(2)):
        generate(copy, src, strategy, shortlist=Shortlist(torch.arange(45)))
    assert calls == ["greedy", "beam", "greedy", "beam"]
    assert FusedStep.build(copy.module, object()).head is None  # not a product it runs
    pre = decoding_copy(grown_model("pre"), "linear", monkeypatch).module
    assert FusedStep.build(pre).head is not None
    pre.decoder_norm = torch.nn.LayerNorm(32, eps=1e-3)  # not the layers' eps: steps only
    fused = FusedStep.build(pre)
    assert fused is not None and fused.head is None
    monkeypatch.setenv("MT_INT8_KERNEL", "fbgemm")
    assert for_decoding(grown_model("post"), "int8", "fp32").fused is None


def test_the_whole_greedy_search_names_what_does_not_fit(monkeypatch):
    """The operator's checks: length limits beyond the positions encoded, a head of the wrong
    number of tensors, encoder keys/values not one row a sentence."""
    if native.greedy_search() is None:
        pytest.skip(f"no kernels here: {native.unavailable_reason()}")
    copy = decoding_copy(grown_model("post"), "linear", monkeypatch)
    fused, module = copy.fused, copy.module
    weights, width, kind = fused.head
    cross = [torch.zeros(2, 4, 5, 8) for _ in range(2)]

    def call(limits, head=weights, k=cross):
        native.greedy_search()(module.embed.detach(), module.pe, 1.0, fused.params, fused.widths, k,
                        k, None, 4, False, 1e-5, "linear", [], head, width, kind, 45, limits,
                        0, 0.0, BOS, EOS, 5)  # fmt: skip

    with pytest.raises(RuntimeError, match="length limit 13 beyond the 12 positions"):
        call([3, 13])
    with pytest.raises(RuntimeError, match="the head is 4 tensors"):
        call([3, 3], head=weights[:3])
    with pytest.raises(RuntimeError, match=r"must be \(3, H, S, d\)"):
        call([3, 3, 3])
    beam = native.beam_search()
    with pytest.raises(RuntimeError, match="nbest 3 must be between 1 and K 2"):
        beam(module.embed.detach(), module.pe, 1.0, fused.params, fused.widths, cross, cross,
             None, 4, False, 1e-5, "linear", [], weights, width, kind, 45, [3, 3], 2, 3, 0.0,
             True, 0, BOS, EOS, 5)  # fmt: skip
