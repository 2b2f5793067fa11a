"""The training loss, fast: :func:`mt.model.loss.label_smoothed_nll_loss` of
``log_softmax(logits)`` without the (N, V) float log-probabilities; ``tests/test_loss.py`` holds
both functions equal to the formula in values and gradients.

- :func:`label_smoothed_cross_entropy` (logits in, fused): one float block of rows at a time,
  the closed-form gradient ``g * (softmax(z) - q)`` written straight in the logits' dtype.
- :func:`projected_cross_entropy` (decoder output and projection in): the logits never exist
  whole; each row block is projected, scored and turned into its gradient at once (on a CPU by
  mt's kernel ``mt::smoothed_ce`` where built). What the training copy and a GPU train with.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from mt.vocab import PAD


class _SmoothedCrossEntropy(torch.autograd.Function):
    """The loss from the logits, fused (module docstring). The unfused path (``log_softmax`` ->
    gather + sum -> their backward) makes about ten passes over an (N, V) float tensor; on a CPU
    they cost more than the model's matrix products."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, eps: float, rows: int):
        N, V = logits.shape
        eps_i = eps / (V - 1) if V > 1 else 0.0
        acc = torch.float64 if logits.dtype == torch.float64 else torch.float32
        lse, nll, smooth = (logits.new_empty(N, dtype=acc) for _ in range(3))
        for i in range(0, N, rows):
            # One block, cast once: element-wise ops that mix bfloat16 and float32 operands
            # take torch's slow per-element casting loop on a CPU (many times a plain pass).
            z, t = logits[i : i + rows].to(acc), target[i : i + rows].unsqueeze(-1)
            lp = torch.log_softmax(z, dim=-1)  # float32 at least
            nll[i : i + rows] = -lp.gather(-1, t).squeeze(-1)
            smooth[i : i + rows] = -lp.sum(dim=-1)
            lse[i : i + rows] = z[:, 0] - lp[:, 0]
        ctx.save_for_backward(logits, target, lse)
        ctx.eps, ctx.eps_i, ctx.rows = eps, eps_i, rows
        nll_sum = nll.sum()
        ctx.mark_non_differentiable(nll_sum)
        return (1.0 - eps - eps_i) * nll_sum + eps_i * smooth.sum(), nll_sum

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor, grad_nll: torch.Tensor):
        logits, target, lse = ctx.saved_tensors
        grad = torch.empty_like(logits, memory_format=torch.contiguous_format)
        g = grad_loss.to(lse.dtype)
        on_target = -(1.0 - ctx.eps - ctx.eps_i)  # p - q = p - eps_i, minus (1-eps-eps_i) at t
        for i in range(0, logits.size(0), ctx.rows):
            z, t = logits[i : i + ctx.rows], target[i : i + ctx.rows].unsqueeze(-1)
            shift = lse[i : i + ctx.rows].unsqueeze(-1)
            # softmax in float, in a new block (z cast once, never mixed-dtype ops: see forward)
            p = torch.sub(z, shift) if z.dtype == lse.dtype else z.to(lse.dtype).sub_(shift)
            p.exp_().sub_(ctx.eps_i).scatter_add_(-1, t, p.new_full(t.shape, on_target))
            if grad.dtype == p.dtype:
                torch.mul(p, g, out=grad[i : i + ctx.rows])
            else:
                grad[i : i + ctx.rows].copy_(p.mul_(g))
        return grad, None, None, None


BLOCK_BYTES = 1 << 22  # ~4 MB of float32 per row block: the block stays in a CPU cache


def block_rows(V: int) -> int:
    """Rows of (N, V) logits that the fused loss treats at once: ~4 MB of float32, which stays
    in a CPU's cache (28 rows at V = 37k)."""
    return max(1, BLOCK_BYTES // (4 * max(V, 1)))


def label_smoothed_cross_entropy(
    logits: torch.Tensor, target: torch.Tensor, eps: float, ignore_index: int | None = PAD
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`mt.model.loss.label_smoothed_nll_loss` of ``log_softmax(logits)``, fused.

    ``logits`` (N, V) float32, bfloat16 or float16, ``target`` (N,); rows whose target is
    ``ignore_index`` are dropped (None: every row is real, no scan, no copy). Computed in
    float32 one block of rows at a time (:func:`block_rows`); the gradient has the logits'
    dtype. Returns ``(loss_sum, nll_sum)``, float32 scalars; only the loss is differentiable.

    Example:
        >>> z, t = torch.randn(4, 10, requires_grad=True), torch.tensor([4, 5, 0, 9])
        >>> loss, nll = label_smoothed_cross_entropy(z, t, 0.1)
        >>> loss.backward()
    """
    if logits.dim() != 2 or target.dim() != 1 or logits.size(0) != target.size(0):
        raise ValueError(
            f"expected logits (N,V) and target (N,), got {tuple(logits.shape)} and "
            f"{tuple(target.shape)}"
        )
    if ignore_index is not None:
        keep = target != ignore_index
        if not bool(keep.all()):
            logits, target = logits[keep], target[keep]
    rows = block_rows(logits.size(1))
    return _SmoothedCrossEntropy.apply(logits, target, float(eps), rows)


class _ProjectedSmoothedCrossEntropy(torch.autograd.Function):
    """The loss of ``h W^T`` in row blocks: the (N, V) logits never exist at once.

    Each block is projected, scored and, when gradients are wanted, turned into the gradient
    for a unit upstream gradient, ``G = softmax(z) - q``, whose products ``G W`` (for ``h``) and
    ``G^T h`` (for ``W``, summed over blocks) are taken at once; backward only scales them. This
    saves the memory traffic of two (N, V) float32 tensors (logits and their gradient, 112 MB
    each for 3,500 tokens at V = 8000) and, on a CPU, the page faults of allocating them afresh
    every step.
    """

    @staticmethod
    def forward(ctx, h, weight, target, eps, vocab, rows, dtype, product, bucket):
        N = h.size(0)
        w = weight[:vocab].to(dtype)  # (V, D): the rows that are scored
        eps_i = eps / (vocab - 1) if vocab > 1 else 0.0
        on_target = -(1.0 - eps - eps_i)
        acc = torch.float64 if dtype == torch.float64 else torch.float32  # scores, sums
        grads = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        grad_h = torch.empty_like(h) if grads else None
        # the weight's gradient: its first block's product writes it (no zero fill of V x D
        # first), later blocks add theirs; zeros only where no block writes (rows from `vocab`
        # on, never scored; all of it without rows)
        grad_w = torch.empty_like(weight, dtype=acc) if grads else None
        if grads:
            grad_w[vocab if N else 0 :].zero_()
        nll, smooth = (h.new_empty(N, dtype=acc) for _ in range(2))
        kernel = _block_kernel(h.device, dtype)
        for i in range(0, N, rows):
            x, t = h[i : i + rows].to(dtype), target[i : i + rows].unsqueeze(-1)
            r = x.size(0)
            padded = bucket(r) if bucket is not None else r
            if padded != r:  # the product's row count, padded here on the narrow side (D)
                x = F.pad(x, (0, 0, 0, padded - r))  # rather than in G W's (r, V) input
            scores = product(x, w, None)  # (padded, V)
            if kernel is not None:  # the sums and, in place, G: mt's kernel, three passes a row
                nll[i : i + r], smooth[i : i + r] = kernel(
                    scores, target[i : i + r], r, eps_i, on_target, grads
                )
                g = scores
            else:
                lp = torch.log_softmax(scores.to(acc), dim=-1)
                real = lp[:r]
                nll[i : i + r] = -real.gather(-1, t).squeeze(-1)
                smooth[i : i + r] = -real.sum(dim=-1)
                if grads:
                    g = lp.exp_().sub_(eps_i)  # softmax - eps_i ...
                    g[:r].scatter_add_(-1, t, g.new_full(t.shape, on_target))  # ... at t
                    if padded != r:
                        g[r:] = 0.0  # the padding rows: no gradient
                    g = g.to(dtype)
            if not grads:
                continue
            grad_h[i : i + r] = product(g, w.t(), None)[:r]  # G W: W^T as the (in, out) weight
            if dtype == acc:  # G^T x, into the gradient (i == 0) or added to it
                grad_w[:vocab].addmm_(g.t(), x, beta=0.0 if i == 0 else 1.0)
            elif i == 0:
                grad_w[:vocab].copy_(g.t().mm(x))  # a 16-bit product, a float32 gradient
            else:  # add_ on the view: `grad_w[:vocab] += ...` would copy the view onto itself
                grad_w[:vocab].add_(g.t().mm(x))
        ctx.save_for_backward(grad_h, grad_w)
        ctx.weight_dtype = weight.dtype
        nll_sum = nll.sum()
        ctx.mark_non_differentiable(nll_sum)
        return (1.0 - eps - eps_i) * nll_sum + eps_i * smooth.sum(), nll_sum

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor, grad_nll: torch.Tensor):
        grad_h, grad_w = ctx.saved_tensors
        grad_h = grad_h * grad_loss.to(grad_h.dtype)
        grad_w = (grad_w * grad_loss).to(ctx.weight_dtype)
        return grad_h, grad_w, None, None, None, None, None, None, None


def _block_kernel(device: torch.device, dtype: torch.dtype) -> Callable | None:
    """mt's kernel for a block's sums and gradient (``mt.fast.native.smoothed_ce``) where it
    applies (float32 or bfloat16 scores on a CPU) and is built; None: torch's operators."""
    if device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16):
        return None
    from mt.fast.native import smoothed_ce

    return smoothed_ce()


BLOCKWISE_BLOCK_BYTES = 1 << 24  # 16 MB of float32 scores per block (512 rows at V = 8000)
BLOCKWISE_MIN_ROWS = 256  # fewer rows make G^T h a thin, slow product
GPU_BLOCKWISE_BLOCK_BYTES = 1 << 29  # 512 MB: a GPU wants few, large kernels


def projected_block_rows(
    vocab: int, device: torch.device | str, bucket: Callable[[int], int] | None = None
) -> int:
    """Rows per block of :func:`projected_cross_entropy` on ``device``: 16 MB of float32 scores
    on a CPU, at least 256; 512 MB on a GPU, at least 1024 (with ``bucket``, the row counts a
    product pads to, the largest such count at most that)."""
    if torch.device(device).type == "cuda":
        rows = max(1024, GPU_BLOCKWISE_BLOCK_BYTES // (4 * max(vocab, 1)))
    else:
        rows = max(BLOCKWISE_MIN_ROWS, BLOCKWISE_BLOCK_BYTES // (4 * max(vocab, 1)))
    return rows if bucket is None else _unpadded(rows, bucket)


def _unpadded(rows: int, bucket: Callable[[int], int]) -> int:
    """The largest row count at most ``rows`` that ``bucket`` leaves as it is (no padding)."""
    while rows > 1 and bucket(rows) != rows:
        rows -= 1
    return rows


def projected_cross_entropy(
    h: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    eps: float,
    vocab: int | None = None,
    product: Callable = F.linear,
    rows: int | None = None,
    bucket: Callable[[int], int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`label_smoothed_cross_entropy` of ``h weight[:vocab]^T`` (rows from ``vocab`` on
    never scored), one block of ``rows`` rows of ``h`` at a time (:func:`projected_block_rows`),
    the products through ``product`` (``(x, w, bias) -> x w^T (+ bias)``), under autocast in its
    dtype and the scores in float32. ``bucket``: the row counts ``product`` pads its input to
    (``mt.fast.onednn.bucket_rows``), or None; given, the blocks hold such counts (the last one
    padded here, D wide), since a pad of G W's V-wide input would copy a large block.

    Example:
        >>> h, w = torch.randn(6, 4, requires_grad=True), torch.randn(10, 4, requires_grad=True)
        >>> loss, nll = projected_cross_entropy(h, w, torch.tensor([4, 5, 1, 9, 2, 3]), 0.1)
        >>> loss.backward()
    """
    if h.dim() != 2 or target.shape != h.shape[:1] or weight.size(-1) != h.size(-1):
        raise ValueError(
            f"expected h (N,D), target (N,), weight (V,D), got {tuple(h.shape)}, "
            f"{tuple(target.shape)}, {tuple(weight.shape)}"
        )
    vocab = weight.size(0) if vocab is None else vocab
    if rows is None:
        rows = projected_block_rows(vocab, h.device, bucket)
    elif bucket is not None:
        rows = _unpadded(rows, bucket)
    device = h.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else h.dtype
    with torch.autocast(device, enabled=False):
        return _ProjectedSmoothedCrossEntropy.apply(
            h, weight, target, float(eps), vocab, rows, dtype, product, bucket
        )
