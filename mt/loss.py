"""The training objective: label-smoothed cross entropy (Szegedy et al., 2016), fairseq form.

With smoothing ``eps`` the target distribution puts ``1 - eps`` on the reference token and
spreads ``eps`` uniformly over the other ``V - 1`` tokens of the vocabulary:

    q(k) = 1 - eps              if k == target
    q(k) = eps / (V - 1)        otherwise

and the loss of one position is the cross entropy ``-sum_k q(k) log p(k)``, i.e.

    loss = (1 - eps - eps / (V - 1)) * nll + eps / (V - 1) * (-sum_k log p(k))

Positions whose target is padding contribute nothing. Both sums are returned: the smoothed loss
(what is optimised) and the plain negative log-likelihood (what perplexity is computed from).
The caller normalises, e.g. by the number of target tokens of the whole update.
"""

from __future__ import annotations

import torch

from mt.vocab import PAD


def label_smoothed_nll_loss(
    lprobs: torch.Tensor, target: torch.Tensor, eps: float, ignore_index: int = PAD
) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed label-smoothed cross entropy and summed NLL over the non-padding positions.

    Args:
        lprobs: (N, V) log-probabilities (log_softmax of the logits; float32 recommended).
        target: (N,) reference token ids.
        eps: smoothing mass in [0, 1); 0 gives plain cross entropy.
        ignore_index: target id whose positions are ignored (padding).

    Returns:
        ``(loss_sum, nll_sum)``, two scalar tensors (sums, not means).
    """
    if lprobs.dim() != 2 or target.dim() != 1 or lprobs.size(0) != target.size(0):
        raise ValueError(
            f"expected lprobs (N,V) and target (N,), got {tuple(lprobs.shape)} and "
            f"{tuple(target.shape)}"
        )
    V = lprobs.size(-1)
    keep = target != ignore_index  # (N,)
    safe_target = target.masked_fill(~keep, 0).unsqueeze(-1)  # (N, 1): gather needs valid ids
    nll = -lprobs.gather(dim=-1, index=safe_target).squeeze(-1)  # (N,)
    smooth = -lprobs.sum(dim=-1)  # (N,): -sum_k log p(k)
    nll = nll.masked_fill(~keep, 0.0).sum()
    smooth = smooth.masked_fill(~keep, 0.0).sum()
    eps_i = eps / (V - 1) if V > 1 else 0.0
    loss = (1.0 - eps - eps_i) * nll + eps_i * smooth
    return loss, nll


class _SmoothedCrossEntropy(torch.autograd.Function):
    """The same loss from the logits, fused: forward keeps one float row block at a time, and
    backward writes ``g * (softmax(z) - q)`` (its closed form) straight into the logits' dtype.

    The unfused path (``log_softmax`` -> gather + sum -> their backward) makes about ten passes
    over an (N, V) float tensor; on a CPU they cost more than the model's matrix products.
    """

    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, eps: float, rows: int):
        N, V = logits.shape
        eps_i = eps / (V - 1) if V > 1 else 0.0
        acc = torch.float64 if logits.dtype == torch.float64 else torch.float32
        lse, nll, smooth = (logits.new_empty(N, dtype=acc) for _ in range(3))
        for i in range(0, N, rows):
            # One block, cast once: element-wise ops that mix bfloat16 and float32 operands
            # take torch's slow per-element casting loop on a CPU (5-10x a plain float pass).
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


CPU_BLOCK_BYTES = 1 << 22  # ~4 MB of float32 per row block: the block stays in a CPU cache
GPU_BLOCK_BYTES = 1 << 26  # 64 MB: few, large kernels (a 25k-token x 37k batch: ~55 blocks)


def block_rows(V: int, device: torch.device | str) -> int:
    """Rows of (N, V) logits that the fused loss treats at once on ``device``.

    On a CPU a block of ~4 MB of float32 stays in cache (28 rows at V = 37k); a GPU wants few
    large kernels instead, so its blocks hold 64 MB (the float32 block is the only extra
    memory the loss needs beyond the logits and their gradient).
    """
    budget = GPU_BLOCK_BYTES if torch.device(device).type == "cuda" else CPU_BLOCK_BYTES
    return max(1, budget // (4 * max(V, 1)))


def label_smoothed_cross_entropy(
    logits: torch.Tensor, target: torch.Tensor, eps: float, ignore_index: int | None = PAD
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`label_smoothed_nll_loss` of ``log_softmax(logits)``, fused (what training uses).

    Computed in float32 whatever the logits' dtype, one block of rows at a time (its size
    chosen for the logits' device: :func:`block_rows`); the gradient has the logits' dtype.
    Only the loss is differentiable (the NLL is for reporting).

    Args:
        logits: (N, V) unnormalised scores (float32, bfloat16 or float16).
        target: (N,) reference ids; rows whose target is ``ignore_index`` are dropped.
        ignore_index: the padding id, or None when every row is real (training passes only
            the real positions: no scan, no copy).
        eps: smoothing mass in [0, 1).

    Returns:
        ``(loss_sum, nll_sum)``, float32 scalars (sums over the kept rows).

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
    rows = block_rows(logits.size(1), logits.device)
    return _SmoothedCrossEntropy.apply(logits, target, float(eps), rows)
