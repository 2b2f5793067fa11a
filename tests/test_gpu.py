"""Checks that run real CUDA code: each is the GPU side of a CPU test (the blockwise loss of
test_loss, the training step of test_cpu_training, Inductor of test_acceleration, the search
of test_search). Marked ``gpu``: skipped without a CUDA device; ``pytest -m gpu`` and
``make gpu-check`` run them on a machine with a GPU. Each check is a function of the device, so
that it can be run on a CPU by hand (``python -c "import test_gpu as t; t.check_...('cpu')"``
in tests/) before a GPU is at hand."""

from __future__ import annotations

import contextlib
import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import sharp_random_model

from mt.config import load_config
from mt.data.batches import collate, make_src
from mt.decode.driver import translate_nbest
from mt.decode.search import beam_search, greedy_search
from mt.fast import for_training
from mt.fast.loss import projected_block_rows, projected_cross_entropy
from mt.model import build_model
from mt.model.loss import label_smoothed_nll_loss
from mt.schema import DecodeConfig
from mt.train.state import TrainState
from mt.train.update import Updater, batch_loss, build_optimizer

pytestmark = pytest.mark.gpu


@contextlib.contextmanager
def exact_float32():
    """float32 products in float32 (TF32 off, as mt turns it on for training on CUDA)."""
    if not torch.cuda.is_available():
        yield
        return
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).norm() / want.double().norm())


def leaf(x: torch.Tensor, device: str, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    return x.detach().to(device, dtype).clone().requires_grad_()


def check_blockwise_loss(device: str, n: int = 4000, V: int = 37000, D: int = 64) -> None:
    """The projection + label-smoothed loss in blocks (the GPU's: 3,627 rows a block at
    V=37,000, so two here) against the textbook formula on the whole logits in float64: float64
    to 1e-9, float32 to 1e-5 (loss) / 1e-4 (gradients), bf16 autocast within its rounding."""
    assert projected_block_rows(V, device) < n  # more than one block
    g = torch.Generator().manual_seed(0)
    h64 = torch.randn(n, D, generator=g, dtype=torch.float64)
    w64 = torch.randn(V + 8, D, generator=g, dtype=torch.float64) * 0.3  # 8 padded rows
    target = torch.randint(1, V, (n,), generator=g).to(device)
    h_ref, w_ref = leaf(h64, device), leaf(w64, device)
    lprobs = F.log_softmax(h_ref @ w_ref[:V].t(), -1)
    ref_loss, ref_nll = label_smoothed_nll_loss(lprobs, target, 0.1)
    ref_loss.backward()
    for dtype, tol, grad_tol in ((torch.float64, 1e-9, 1e-9), (torch.float32, 1e-5, 1e-4)):
        h, w = leaf(h64, device, dtype), leaf(w64, device, dtype)
        with exact_float32():
            loss, nll = projected_cross_entropy(h, w, target, 0.1, vocab=V)
            loss.backward()
        assert loss.item() == pytest.approx(ref_loss.item(), rel=tol), dtype
        assert nll.item() == pytest.approx(ref_nll.item(), rel=tol), dtype
        assert relative_error(h.grad, h_ref.grad) < grad_tol, dtype
        assert relative_error(w.grad, w_ref.grad) < grad_tol, dtype
        assert torch.all(w.grad[V:] == 0)  # padded rows are never scored
    h, w = leaf(h64, device, torch.float32), leaf(w64, device, torch.float32)
    with torch.autocast(torch.device(device).type, dtype=torch.bfloat16):
        loss, nll = projected_cross_entropy(h, w, target, 0.1, vocab=V)
    loss.backward()
    assert loss.dtype == torch.float32  # scored in float32 from bf16 products
    assert loss.item() == pytest.approx(ref_loss.item(), rel=1e-2)
    assert relative_error(h.grad, h_ref.grad) < 3e-2
    assert relative_error(w.grad, w_ref.grad) < 3e-2


def small_model(vocab: int = 1000):
    cfg = load_config(["model.N=2", "model.d_model=64", "model.d_ff=128", "model.h=4",
                       "model.dropout=0.0"])  # fmt: skip
    torch.manual_seed(0)
    return build_model(cfg.model, vocab).train()


def random_batch(seed: int, n: int, vocab: int, longest: int = 30):
    rng = np.random.default_rng(seed)
    pairs = [(rng.integers(4, vocab, rng.integers(1, longest)),
              rng.integers(4, vocab, rng.integers(1, longest))) for _ in range(n)]  # fmt: skip
    return collate(pairs)


def check_training_step(device: str) -> None:
    """The step the GPU trains with (``for_training`` on the device: the model, the loss in
    blocks) gives the textbook model's loss and gradients on the CPU: float32 to 1e-5 / 1e-4,
    bf16 autocast within its rounding."""
    model = small_model()
    batch = random_batch(0, 24, 1000)  # padded: lengths 1..29
    ref_loss, ref_nll = batch_loss(model, batch, 0.1, "fp32")
    ref_loss.backward()
    ref_grads = [p.grad.clone() for p in model.parameters()]
    for precision, tol, grad_tol in (("fp32", 1e-5, 1e-4), ("bf16", 1e-2, 0.1)):
        on = copy.deepcopy(model).to(device)
        on.zero_grad(set_to_none=True)
        step = for_training(on, torch.device(device), cpu_kernels=False, precision=precision)
        with exact_float32():
            loss, nll = batch_loss(step, batch.to(device), 0.1, precision)
            loss.backward()
        assert loss.item() == pytest.approx(ref_loss.item(), rel=tol), precision
        assert nll.item() == pytest.approx(ref_nll.item(), rel=tol), precision
        for p, want in zip(on.parameters(), ref_grads):
            assert relative_error(p.grad.cpu(), want) < grad_tol, precision


def check_inductor_training_step(device: str, steps: int = 6) -> list[float]:
    """``train.compile=true`` on the device: Inductor compiles the update's model (bf16 on
    CUDA), batches of other lengths every step run one graph (dynamic shapes; at most one more
    for a batch without source padding), no graph break, finite losses."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    from mt.fast.compile import compile_model

    precision = "bf16" if torch.device(device).type == "cuda" else "fp32"
    cfg = load_config(["model.N=1", "model.d_model=64", "model.d_ff=128", "model.h=4",
                       "model.dropout=0.1", "train.compile=true", "train.cpu_kernels=false",
                       "train.clip_norm=1.0", f"train.precision={precision}"])  # fmt: skip
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    dev = torch.device(device)
    raw = build_model(cfg.model, 1000).to(dev)
    model = compile_model(for_training(raw, dev, cpu_kernels=False, compiled=True), cfg.train)
    opt = build_optimizer(raw.parameters(), cfg.train, dev)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1e-3)
    scaler = torch.amp.GradScaler(dev.type, enabled=False)
    update = Updater(model, raw.parameters(), opt, sched, scaler, cfg, 1)
    losses = [update([random_batch(s, 8 + s, 1000, 10 + 5 * s).to(dev)], TrainState()).loss
              for s in range(steps)]  # fmt: skip
    graphs = int(counters["stats"]["unique_graphs"])
    breaks = sum(counters["graph_break"].values())
    assert breaks == 0, dict(counters["graph_break"])
    assert 1 <= graphs <= 2, graphs
    assert all(np.isfinite(losses)), losses
    return losses


def check_search(device: str) -> None:
    """Beam search on the device: batched equals one by one, beam 1 equals greedy, and the
    device's n-best equals the CPU's (float32, TF32 off; near-ties aside)."""
    cfg = DecodeConfig(beam_size=4, alpha=0.6, max_len_a=0.5, max_len_b=6, nbest=4, batch_size=64)
    g = torch.Generator().manual_seed(1)
    ids = [torch.randint(4, 40, (n,), generator=g).tolist() for n in [2, 40, 7, 25, 1, 13, 3, 9]]
    on = sharp_random_model(40).to(device)
    with exact_float32():
        batched = translate_nbest(on, ids, cfg, device)
        alone = translate_nbest(on, ids, DecodeConfig(**{**cfg.__dict__, "batch_size": 1}), device)
        src = make_src(ids).to(device)
        greedy = greedy_search(on, src, 1.0, 6, alpha=0.6)
        beam1 = beam_search(on, src, 1, 0.6, 1.0, 6)
    on_cpu = translate_nbest(sharp_random_model(40), ids, cfg, "cpu")
    lengths = [len(h[0].tokens) for h in batched]
    assert min(lengths) < 3 and max(lengths) > 12  # early EOS and long outputs in one batch
    for other in (alone, on_cpu):
        for a, b in zip(other, batched):
            assert [h.score for h in a] == pytest.approx([h.score for h in b], abs=1e-3)
            if len(a) < 2 or a[0].score - a[1].score > 1e-3:  # same output except at near-ties
                assert a[0].tokens == b[0].tokens
    for g, (b,) in zip(greedy, beam1):
        assert g.tokens == b.tokens and g.score == pytest.approx(b.score, abs=1e-4)


def test_blockwise_loss_on_the_gpu_equals_the_textbook_formula():
    check_blockwise_loss("cuda")


def test_the_gpu_training_step_equals_the_textbook_model_on_the_cpu():
    check_training_step("cuda")


@pytest.mark.slow
def test_inductor_compiles_the_gpu_training_step_without_breaks_or_recompiles():
    check_inductor_training_step("cuda")


def test_search_on_the_gpu_equals_the_cpu_batched_and_one_by_one():
    check_search("cuda")
