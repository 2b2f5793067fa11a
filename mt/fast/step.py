"""One incremental decoder step for a CPU: the work of ``Transformer.decode`` for one new token
per row against filled caches, through the model's own pieces with less around them.

:func:`decoder_step` uses the model's embedding (``_embed``), each layer's residual wiring
(``residual``) and the written-out attention (``mt.model.attention.attention``), with the
layers' own products (whatever :mod:`mt.fast.decoding` put there: oneDNN, int8 or torch). What
it saves against the modules: the attention runs on 3-D batched products (no 4-D permutes, no
``matmul`` broadcasting, no core dispatch), and the source mask is made once per step for all
layers, as an additive row per sentence and head, instead of once per layer. On an AMD Zen 3
that measured +4% greedy and +1% beam 5 on real text, within the machine's spread; a version
that also wrote the residuals out in place measured +6% and +4%, not worth a second copy of
the formula.

With ``kernel`` (``torch.ops.mt.short_attention``, built by ``mt.fast.native``) the attention
over the caches is one C++ call per layer and kind instead of two batched products of tiny
matrices, a softmax and the copies around them; without it, the formula in torch.

:class:`FusedStep` goes further: the whole step, every layer, in one call into C++
(``torch.ops.mt.decoder_step``), Python keeping only the embedding and the caches'
bookkeeping, for copies whose products are all mt's int8 kernels, oneDNN's float32 or torch's;
on an AMD Zen 3 greedy int8 decoding of real text ran 1.30x as fast as layer by layer (beam 5:
1.07x), the same outputs.

Its :meth:`FusedStep.greedy` and :meth:`FusedStep.beam` go further still: a batch's whole
greedy or beam search in one call (``torch.ops.mt.greedy_search``, ``torch.ops.mt.beam_search``),
the steps, a pre-norm model's final LayerNorm, the projection and each step's choice
(``mt::best_token``, ``mt::top_tokens`` and ``Beam``'s ranking) in C++, the rows of new and
ended hypotheses moved as ``mt.decode.rows`` moves them, so that the products see the same rows
and the hypotheses are the Python loop's bit for bit (greedy int8 1.26x, beam 5 1.22x on an AMD
Zen 3).

The beams of a sentence share its encoder rows (G rows per sentence, as ``CrossAttention``
takes them). Used by :class:`mt.fast.decoding.DecodingModel` for the steps it can take (one new
token, no autocast), the first step included, whose encoder-decoder keys/values it makes as the
model does (``CrossAttention.memory_kv``); everything else goes through the model.
"""

from __future__ import annotations

import math
from functools import partial

import torch
from torch import nn

import mt.fast.native as native
from mt.fast.fp32 import Fp32Linear
from mt.fast.onednn import OneDNNLinear
from mt.fast.quantize import Int8Linear
from mt.model.attention import attention
from mt.model.kv_cache import DecoderCache
from mt.vocab import BOS, EOS, PAD


def applies(tgt_in: torch.Tensor, cache: DecoderCache | None, module: nn.Module) -> bool:
    """Whether :func:`decoder_step` computes this call: one new token per row, a cache (empty
    at the first step, whose encoder-decoder keys/values the step then makes), eval mode,
    float32 outside autocast (under bf16 autocast the model's own path casts)."""
    return (
        cache is not None
        and tgt_in.size(1) == 1
        and not module.training
        and not torch.is_grad_enabled()
        and not torch.is_autocast_enabled(tgt_in.device.type)
    )


def _self_attention(attn: nn.Module, cache, kernel, y: torch.Tensor) -> torch.Tensor:
    """One query per row against the cached keys/values (the new ones appended): (B, D)."""
    B, D = y.shape
    H, d_k = attn.h, attn.d_k
    qkv = attn.qkv(y).view(B, 3, H, 1, d_k)
    k, v = cache.append(qkv[:, 1], qkv[:, 2])  # (B, H, T, d_k) views of the cache
    if kernel is not None:  # (B, 1, H, d_k) out: the layout of (B, D)
        return attn.out(kernel(qkv[:, 0], k, v, None, 1 / math.sqrt(d_k)).view(B, D))
    T = k.size(2)
    q = qkv[:, 0].reshape(B * H, 1, d_k)
    out, _ = attention(q, k.reshape(B * H, T, d_k), v.reshape(B * H, T, d_k))  # (B*H, 1, d_k)
    return attn.out(out.view(B, D))


def _cross_attention(
    attn: nn.Module, cache, memory: torch.Tensor, bias: torch.Tensor | None, kernel,
    y: torch.Tensor,
) -> torch.Tensor:
    """G = B / n queries per sentence against its encoder keys/values (of ``memory``, n
    sentences): (B, D). ``bias``: the additive source mask, (n, S) for ``kernel``, else
    (n*H, 1, S); or None."""
    B, D, n = *y.shape, memory.size(0)
    H, d_k, G = attn.h, attn.d_k, B // n
    k, v = attn.memory_kv(memory, cache)  # (n, H, S, d_k): made at the first step, then kept
    if kernel is not None:  # (n, H, G, d_k) queries in, (n, G, H, d_k) = (B, D) out
        q = attn.q(y).view(n, G, H, d_k).transpose(1, 2)
        return attn.out(kernel(q, k, v, bias, 1 / math.sqrt(d_k)).view(B, D))
    S = k.size(2)
    # (B, D) -> (n, G, H, d_k) -> (n*H, G, d_k): the G rows of a sentence share its keys
    q = attn.q(y).view(n, G, H, d_k).transpose(1, 2).reshape(n * H, G, d_k)
    out, _ = attention(q, k.view(n * H, S, d_k), v.view(n * H, S, d_k), bias)  # (n*H, G, d_k)
    return attn.out(out.view(n, H, G, d_k).transpose(1, 2).reshape(B, D))


def source_bias(src_mask: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor | None:
    """The encoder-decoder attention's additive source mask, (n, S) of ``like``'s dtype: 0
    where a sentence may attend, -inf at its padding; None without a mask ((n, 1, 1, S) bool,
    True = a real token)."""
    if src_mask is None:
        return None
    n = src_mask.size(0)
    return like.new_zeros(n, src_mask.size(-1)).masked_fill_(~src_mask.view(n, -1),
                                                             float("-inf"))  # fmt: skip


def decoder_step(
    module: nn.Module,
    tgt_in: torch.Tensor,
    memory: torch.Tensor,
    src_mask,
    cache: DecoderCache,
    kernel=None,
) -> torch.Tensor:
    """The decoder output (B, D) for one new token per row (before the projection).

    Args:
        module: an ``mt.model.transformer.Transformer`` or its decoding copy, in eval mode.
        tgt_in: (B, 1) the new token of each row.
        memory: (n, S, D) encoder output, B = G * n (the G rows of a sentence consecutive).
        src_mask: (n, 1, 1, S) bool, True = real source token, or None (no padding).
        cache: the rows' state (empty at the first step, when the encoder-decoder
            keys/values are made and kept in it); the new keys/values are appended to it.
        kernel: ``torch.ops.mt.short_attention`` (``mt.fast.native``) to attend with, over
            float32 caches; None: torch's batched products.

    Returns:
        (B, D) float32, what ``module.decode(tgt_in, enc, cache, project=False)`` gives.

    Raises:
        ValueError: when the new position is beyond the model's ``max_positions``.
    """
    B, n = tgt_in.size(0), memory.size(0)
    x = module._embed(tgt_in, module.tgt_embedding, cache.length).view(B, -1)  # (B, D)
    bias = source_bias(src_mask, x)  # (n, S), as the kernel takes it
    if bias is not None and kernel is None:  # (n*H, 1, S), as torch's batched products do
        H = module.decoder[0].cross_attn.h
        bias = bias[:, None, None].expand(n, H, 1, -1).reshape(n * H, 1, -1)
    for layer, state in zip(module.decoder, cache.layers):
        x = layer.residual(
            x, 0, partial(_self_attention, layer.self_attn, state.self_attn, kernel)
        )
        x = layer.residual(
            x, 1,
            partial(_cross_attention, layer.cross_attn, state.cross_attn, memory, bias, kernel),
        )
        x = layer.residual(x, 2, layer.ffn)
    return module.decoder_norm(x)


class FusedStep:
    """A decoding copy's decoder step in one call into C++ (``torch.ops.mt.decoder_step``,
    ``mt/fast/csrc/decoder_step.cpp``): what :func:`decoder_step` computes, the embedding and
    the caches' bookkeeping in Python, every layer's products (the copy's own: mt's int8
    kernels, oneDNN's, mt's or torch's float32 ones), cache writes, attention
    (``mt::short_attention``), residual additions and LayerNorms in C++. Build with :meth:`build`.

    The layers' parameters are gathered once, as the operator takes them: per layer four
    tensors for each of the six products (``products`` says what they are), then the three
    LayerNorms' weights and biases.
    """

    def __init__(self, op, params: list[torch.Tensor], widths: list[int], heads: int,
                 d_k: int, pre_norm: bool, eps: float, products: str,
                 head: tuple[list[torch.Tensor], int, str] | None = None) -> None:  # fmt: skip
        self.op, self.params, self.widths = op, params, widths
        self.heads, self.d_k, self.pre_norm, self.eps = heads, d_k, pre_norm, eps
        self.products, self.head = products, head
        self.head_module: nn.Module | None = None  # the projection (None: the tied embedding)

    @classmethod
    def build(cls, module: nn.Module, head: nn.Module | None = None) -> FusedStep | None:
        """The fused step of ``module`` (a decoding copy of ``mt.fast.decoding``, projecting
        through ``head``, or its tied embedding where None), or None where it would not compute
        what the modules compute: products not all of one kind among mt's int8 kernels
        (``Int8Linear``, not on fbgemm), oneDNN's float32 products (``OneDNNLinear``), mt's
        (``mt.fast.fp32.Fp32Linear``) and
        torch's (``nn.Linear``); LayerNorms without weights or with differing eps; or mt's
        kernels not built (``mt.fast.native.decoder_step``). Its whole searches (:meth:`greedy`,
        :meth:`beam`) need a ``head`` of one of those kinds too (of any one: the projection is
        a product apart) and a final LayerNorm, where the model has one, of the layers' eps."""
        op = native.decoder_step()
        if op is None or not len(module.decoder):
            return None
        params: list[torch.Tensor] = []
        widths: list[int] = []
        kinds, eps, pre = set(), set(), set()
        for layer in module.decoder:
            products = (layer.self_attn.qkv, layer.self_attn.out, layer.cross_attn.q,
                        layer.cross_attn.out, getattr(layer.ffn, "w1", None),
                        getattr(layer.ffn, "w2", None))  # fmt: skip
            for linear in products:
                kind, tensors, width = _product_params(linear)
                if kind is None:
                    return None
                kinds.add(kind)
                params += tensors
                widths.append(width)
            for norm in layer.norms:
                if norm.weight is None or norm.bias is None:
                    return None
                params += [norm.weight.detach(), norm.bias.detach()]
                eps.add(norm.eps)
            pre.add(layer.pre_norm)
        if len(kinds) != 1 or len(eps) != 1 or len(pre) != 1:
            return None
        attn = module.decoder[0].self_attn
        final = module.decoder_norm  # the searches norm with the layers' eps
        searches = not isinstance(final, nn.LayerNorm) or final.eps in eps
        fused = cls(op, params, widths, attn.h, attn.d_k, pre.pop(), float(eps.pop()),
                    kinds.pop(), _head_params(module, head) if searches else None)  # fmt: skip
        fused.head_module = head
        return fused

    def __call__(self, module: nn.Module, tgt_in: torch.Tensor, memory: torch.Tensor, src_mask,
                 cache: DecoderCache) -> torch.Tensor:  # fmt: skip
        """As :func:`decoder_step` (without ``kernel``): (B, D) for one new token per row; the
        caches hold float32 (``DecodingModel``'s ``cache_dtype``)."""
        B, past = tgt_in.size(0), cache.length
        x = module._embed(tgt_in, module.tgt_embedding, past).view(B, -1)  # (B, D)
        bias = source_bias(src_mask, x)
        self_k, self_v, cross_k, cross_v = [], [], [], []
        for layer, state in zip(module.decoder, cache.layers):
            k, v = state.self_attn.reserve(past + 1, B, self.heads, self.d_k, torch.float32)
            self_k.append(k)
            self_v.append(v)
            k, v = layer.cross_attn.memory_kv(memory, state.cross_attn)  # made at the first step
            cross_k.append(k)
            cross_v.append(v)
        out = self.op(x, self.params, self.widths, self_k, self_v, past, cross_k, cross_v, bias,
                      self.heads, self.pre_norm, self.eps, self.products)  # fmt: skip
        for state in cache.layers:
            state.self_attn.length = past + 1
        return module.decoder_norm(out)

    def greedy(
        self, module: nn.Module, enc, limits: list[int], min_len: int, alpha: float,
        shortlist=None,
    ) -> tuple[torch.Tensor, ...] | None:
        """A batch's whole greedy search in one call (``torch.ops.mt.greedy_search``,
        ``mt/fast/csrc/greedy_search.cpp``): what ``mt.decode.search.generate`` finds with
        ``Greedy`` through this step and the head, step by step the same rows. None where the
        head is not a product the operator runs or the kernels are not built.

        Args:
            module: the decoding copy this step was built from.
            enc: its encoder output for the batch (``memory`` (n, S, D), ``src_mask``).
            limits: each sentence's maximum output length (``mt.decode.search.max_lengths``).
            min_len: EOS is forbidden until this many tokens are out.
            alpha: the length penalty's exponent, for the reported scores.
            shortlist: the batch's candidate pieces (an ``mt.decode.shortlist.Shortlist``), or
                None: the head over its pieces (the product ``decode`` makes of them) and each
                sentence's bias.

        Returns:
            ``(tokens (h, T), count (h,), logprob (h,), score (h,), per (n,))``: the h
            hypotheses, ``per[i]`` of them (1, or 0 where none survived) for sentence i in
            turn, each ``tokens[j, :count[j]]`` with its summed log-probability and score.
        """
        op = native.greedy_search()
        inputs = self._search_inputs(module, enc, shortlist)
        if inputs is None or op is None:
            return None
        return op(*inputs, limits, min_len, alpha, BOS, EOS, (1 << PAD) | (1 << BOS),
                  *_shortlist_inputs(shortlist))  # fmt: skip

    def beam(
        self, module: nn.Module, enc, limits: list[int], K: int, nbest: int, alpha: float,
        settle: bool, min_len: int, shortlist=None,
    ) -> tuple[torch.Tensor, ...] | None:
        """A batch's whole beam search in one call (``torch.ops.mt.beam_search``,
        ``mt/fast/csrc/beam_search.cpp``): what ``mt.decode.search.generate`` finds with
        ``Beam(K)`` through this step, the head and ``mt::top_tokens``, step by step the same
        rows. None where the head is not a product the operator runs or the kernels are not
        built. Arguments as :meth:`greedy`'s and ``generate``'s; returns as :meth:`greedy`,
        up to ``nbest`` hypotheses a sentence, best first.
        """
        op = native.beam_search()
        inputs = self._search_inputs(module, enc, shortlist)
        if inputs is None or op is None:
            return None
        return op(*inputs, limits, K, nbest, alpha, settle, min_len, BOS, EOS,
                  (1 << PAD) | (1 << BOS), *_shortlist_inputs(shortlist))  # fmt: skip

    def _search_inputs(self, module: nn.Module, enc, shortlist=None):
        """What both whole searches take before their settings: the embedding, the step's
        parameters, the encoder-decoder keys/values (made as the step makes them at its
        first call), the source mask, the final LayerNorm and the head (over a shortlist's
        pieces where there is one); None where the head is not a product they run."""
        if self.head is None:
            return None
        if shortlist is None:
            weights, width, kind = self.head
            vocab = module.vocab_size
        else:
            narrow = _head_params(module, self.head_module, shortlist.ids)
            if narrow is None:
                return None
            weights, width, kind = narrow
            vocab = len(shortlist)
        cache = module.new_cache(torch.float32)
        cross_k, cross_v = [], []
        for layer, state in zip(module.decoder, cache.layers):
            k, v = layer.cross_attn.memory_kv(enc.memory, state.cross_attn)
            cross_k.append(k)
            cross_v.append(v)
        final = module.decoder_norm
        norm = [] if isinstance(final, nn.Identity) else [final.weight.detach(),
                                                          final.bias.detach()]
        return [module.tgt_embedding.detach(), module.pe, math.sqrt(module.d_model),
                self.params, self.widths, cross_k, cross_v, source_bias(enc.src_mask, enc.memory),
                self.heads, self.pre_norm, self.eps, self.products, norm, weights, width, kind,
                vocab]  # fmt: skip


def _shortlist_inputs(shortlist) -> list:
    """The whole searches' last two arguments: a copy of the shortlist's bias (the operators
    move its rows as sentences end) and its pieces; none without one."""
    if shortlist is None:
        return []
    bias = None if shortlist.bias is None else shortlist.bias.float().contiguous().clone()
    return [bias, shortlist.ids.contiguous()]


def _head_params(module: nn.Module, head: nn.Module | None, ids: torch.Tensor | None = None):
    """What the whole searches (``mt::greedy_search``, ``mt::beam_search``) take of the
    projection (``head``, or ``module``'s tied embedding where None): its four tensors, output
    width and kind; None where it is not a product they run. With ``ids`` (a shortlist's
    pieces), the product ``DecodingModel.decode`` makes of those rows (``Shortlist.project``:
    the head's ``subset``, or the tied embedding's rows)."""
    none = torch.empty(0)
    if head is None:
        weight = module.output_weight.detach()
        if ids is not None:
            weight = weight.index_select(0, ids).contiguous()
        return [weight, none, none, none], weight.size(0), "linear"
    if ids is not None and isinstance(head, Int8Linear):
        if head.kernel == "fbgemm":
            return None
        w, scale, comp, n = head.subset_packed(ids)
        return [w, scale, comp, none], n, f"int8-{head.kernel}"
    kind, tensors, width = _product_params(head if ids is None else head.subset(ids))
    return None if kind is None else (tensors, width, kind)


def _product_params(linear) -> tuple[str | None, list[torch.Tensor], int]:
    """What ``mt::decoder_step`` takes of one product: its kind (None: not one it runs), four
    tensors (an empty one for a missing bias and the unused places) and its output width."""
    none = torch.empty(0)
    if isinstance(linear, Int8Linear):
        if linear.kernel == "fbgemm":
            return None, [], 0
        w, scale, comp, n = linear._packed
        bias = linear.bias if linear.bias is not None else none
        return f"int8-{linear.kernel}", [w, scale, comp, bias], n
    if isinstance(linear, OneDNNLinear):
        if linear.weight.dtype != torch.float32:  # bfloat16 copies cast around each product
            return None, [], 0
        weight = linear.weight if linear.packed is None else linear.packed
        bias = linear.bias if linear.bias is not None else none
        return "onednn", [weight, bias, none, none], linear.weight.size(0)
    if isinstance(linear, Fp32Linear):
        bias = linear.bias if linear.bias is not None else none
        return "f32-avx2", [linear.packed, bias, none, none], linear.out_features
    if type(linear) is nn.Linear:
        bias = linear.bias.detach() if linear.bias is not None else none
        return "linear", [linear.weight.detach(), bias, none, none], linear.out_features
    return None, [], 0
