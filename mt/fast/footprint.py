"""GPU memory planned on a CPU: the peak of a training step computed on fake tensors."""

from __future__ import annotations


def estimate_step_gb(
    model_cfg, vocab_size: int, tokens: int, precision: str = "bf16", master_weights: bool = False,
    activation_checkpointing: bool = False,
) -> dict:  # fmt: skip
    """The peak memory of one training step (forward, the blockwise loss, backward, Adam) of
    a model at ``tokens`` padded tokens per batch, computed without running it: the step runs
    on fake tensors (no storage) under torch's memory tracker, which counts parameters,
    activations, gradients and optimizer state as they live and die. Returns GiB per kind
    (``total``: the peak). Sentences of 25 tokens; autocast's dtype for ``precision``, or with
    ``master_weights`` a 16-bit working copy and float32 masters (``mt.fast.master``);
    ``activation_checkpointing``: each layer recomputes its activations in the backward pass
    (``mt.fast.recompute``), as ``train.activation_checkpointing`` trains.
    """
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker

    from mt.fast.master import MasterWeights
    from mt.fast.training import TrainingModel, checkpointed
    from mt.model.transformer import build_model

    with FakeTensorMode():
        model = build_model(model_cfg, vocab_size)
        master = MasterWeights(model, precision) if master_weights else None
        step = TrainingModel(model if master is None else master.model, blockwise=True)
        if activation_checkpointing:
            step = checkpointed(step)
        opt = torch.optim.Adam(model.parameters(), lr=1e-4)
        tracker = _peak_only(MemTracker)()
        tracker.track_external(model, opt, *([master.model] if master else []))
        B, L = max(1, tokens // 25), 25
        src, tgt = (torch.randint(4, vocab_size, (B, L)) for _ in range(2))
        with tracker:
            train_step(step, opt, master, src, tgt, model_cfg.d_model, precision, "cpu")
        peak = tracker.get_tracker_snapshot("peak")
    totals: dict[str, float] = {}
    for per_device in peak.values():
        for kind, size in per_device.items():
            name = "total" if kind == "Total" else str(getattr(kind, "value", kind)).lower()
            totals[name] = totals.get(name, 0.0) + size / 2**30
    return totals


def _peak_only(tracker_class):
    """``MemTracker`` keeping only the step's overall peak, which is all this module reads.

    The stock tracker also keeps each module's own peak, a pass over every module at every op
    (minutes for the big model); where its internals are not the ones known here, the stock
    tracker is used as it is (slower, the same peak)."""
    from copy import deepcopy

    known = {"_update_peak_stats", "_curr_mem_snap", "_peak_mem", "_peak_mem_snap"}
    probe = tracker_class()
    if not all(hasattr(probe, name) for name in known):
        return tracker_class

    class PeakOnly(tracker_class):
        def _update_peak_stats(self, peak_state) -> None:
            for dev, snap in self._curr_mem_snap.items():
                total = snap.get("Total", 0)
                if self._peak_mem.get(dev, 0) < total:
                    self._peak_mem[dev] = total
                    self._peak_mem_snap[dev] = deepcopy(snap)

    return PeakOnly


def fit_tokens(
    estimate, memory_gb: float, low: int, high: int, headroom: float = 0.85, step: int = 1024
) -> int:
    """The largest padded-token count per batch in ``[low, high]`` (a multiple of ``step``, or
    ``low``) whose step peak ``estimate(tokens)`` (GiB) fits ``headroom x memory_gb``.

    The peak grows linearly with the tokens of a batch (activations, the loss's blocks; the
    parameters and Adam's state are the constant), so two estimates give the line and a third
    checks its answer; a check that fails steps down by ``step`` until one fits. The headroom
    leaves the allocator's fragmentation and the CUDA graphs' pools their share. A ValueError
    names the memory and the estimate when not even ``low`` tokens fit.
    """
    if not 0 < low <= high:
        raise ValueError(f"need 0 < low <= high, got {low}, {high}")
    budget = headroom * memory_gb
    a, b = estimate(low), estimate(high)
    if a > budget:
        raise ValueError(
            f"a batch of {low} tokens needs {a:.1f} GiB by the memory model, more than "
            f"{headroom:.0%} of the GPU's {memory_gb:.1f} GiB"
        )
    if b <= budget:
        return high
    per_token = (b - a) / (high - low)
    tokens = low + int((budget - a) / per_token) if per_token > 0 else high
    tokens = max(low, min(high, tokens // step * step))
    while tokens > low and estimate(tokens) > budget:
        tokens = max(low, tokens - step)
    return tokens


def train_step(step, opt, master, src, tgt, d_model: int, precision: str, device_type: str) -> None:
    """One update as training makes it (forward, the blockwise smoothed loss, backward, Adam),
    the step the memory model counts and ``bench memory`` measures."""
    from mt.fast.precision import autocast

    if master is not None:
        master.pull()
    with autocast(device_type, precision if master is None else "fp32"):
        h = step(src, tgt, None, project=False).reshape(-1, d_model)
        loss, _ = step.loss(h, tgt.reshape(-1), 0.1)
    loss.backward()
    if master is not None:
        master.push_grads()
    opt.step()
