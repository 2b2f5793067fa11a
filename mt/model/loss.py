"""The training objective: label-smoothed cross entropy (Szegedy et al., 2016), fairseq form.

With smoothing ``eps`` the target distribution puts ``1 - eps`` on the reference token and
spreads ``eps`` uniformly over the other ``V - 1`` tokens of the vocabulary:

    q(k) = 1 - eps              if k == target
    q(k) = eps / (V - 1)        otherwise

and the loss of one position is the cross entropy ``-sum_k q(k) log p(k)``, i.e.

    loss = (1 - eps - eps / (V - 1)) * nll + eps / (V - 1) * (-sum_k log p(k))

Padding positions contribute nothing. Both sums are returned (the smoothed loss is optimised,
the NLL gives perplexity); the caller normalises. ``mt.fast.loss`` computes the same sums
without the (N, V) log-probabilities; its tests hold the two equal in values and gradients.
"""

from __future__ import annotations

import torch

from mt.vocab import PAD


def label_smoothed_nll_loss(
    lprobs: torch.Tensor, target: torch.Tensor, eps: float, ignore_index: int = PAD
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(loss_sum, nll_sum)``: summed label-smoothed cross entropy and NLL (scalars, sums not
    means) of ``lprobs`` (N, V) (float32 recommended) against ``target`` (N,), over the
    positions whose target is not ``ignore_index``; ``eps`` in [0, 1), 0: plain cross entropy."""
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
