"""mt.data.prefetch: batches collated ahead in a thread, in order, errors surfaced, no leaked
thread;
and the global batch size of train.batch_tokens (mt.data.batches.batch_plan)."""

from __future__ import annotations

import os
import signal
import threading
import time

import numpy as np
import pytest
import torch

from mt.data.batches import Batch, BatchSampler, batch_plan, collate, iterate_batches
from mt.data.prefetch import Prefetcher
from mt.data.store import TokenArray


def _prefetch_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("mt-prefetch")]


class _Split:
    def __init__(self, src, tgt):
        self.src, self.tgt = TokenArray.from_sequences(src), TokenArray.from_sequences(tgt)


def _split(n: int = 200, seed: int = 0):
    rng = np.random.default_rng(seed)
    src = [rng.integers(4, 50, rng.integers(1, 30)) for _ in range(n)]
    tgt = [rng.integers(4, 50, rng.integers(1, 30)) for _ in range(n)]
    sampler = BatchSampler([len(s) for s in src], [len(t) for t in tgt], 120, seed=3)
    return _Split(src, tgt), sampler


@pytest.mark.parametrize("depth", [0, 1, 2, 5])
def test_prefetched_batches_equal_the_loops_own_in_order(depth):
    split, sampler = _split()
    expected = list(iterate_batches(split, sampler, 1, start=3))
    with Prefetcher(iterate_batches(split, sampler, 1, start=3), depth) as batches:
        got = list(batches)
    assert len(got) == len(expected) > 5
    for a, b in zip(got, expected):
        assert torch.equal(a.src, b.src) and torch.equal(a.tgt_out, b.tgt_out)
        assert (a.ntokens, a.weight) == (b.ntokens, b.weight)
    assert not _prefetch_threads()


def test_it_keeps_depth_batches_ready_ahead_of_the_loop():
    made: list[int] = []

    def source():
        for i in range(10):
            made.append(i)
            yield i

    with Prefetcher(source(), depth=2) as items:
        deadline = time.monotonic() + 5
        while len(made) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.05)
        # 2 waiting in the queue + 1 made and waiting for room; none consumed yet
        assert made == [0, 1, 2]
        assert next(items) == 0
    assert not _prefetch_threads()


def test_an_error_in_the_thread_is_raised_in_the_loop_with_its_message():
    def source():
        yield 1
        raise ValueError("pair 17 of train.src is damaged")

    batches = Prefetcher(source(), depth=2)
    assert next(batches) == 1
    with pytest.raises(ValueError, match="pair 17 of train.src is damaged"):
        next(batches)
    with pytest.raises(StopIteration):  # finished: no second error, no hang
        next(batches)
    batches.close()
    assert not _prefetch_threads()


def test_leaving_early_stops_a_thread_blocked_on_a_full_queue():
    """A break (stop signal, max_steps) or an exception in the loop: the producer, blocked
    with a full queue over an endless source, stops and is joined; nothing leaks."""
    endless = (i for i in iter(int, 1))
    with Prefetcher(endless, depth=2) as items:
        assert next(items) == 0
        time.sleep(0.05)  # the queue fills and the producer blocks in put()
    assert not _prefetch_threads()
    with pytest.raises(RuntimeError, match="loop failed"):
        with Prefetcher((i for i in iter(int, 1)), depth=3) as items:
            next(items)
            raise RuntimeError("loop failed")
    assert not _prefetch_threads()


def test_items_are_pinned_in_the_thread_when_asked():
    class Item:
        def __init__(self):
            self.pinned_by = None

        def pin_memory(self):
            self.pinned_by = threading.current_thread().name
            return self

    with Prefetcher(iter([Item(), Item()]), depth=2, pin=True) as items:
        got = list(items)
    assert [i.pinned_by for i in got] == ["mt-prefetch"] * 2
    with pytest.raises(ValueError, match="train.prefetch"):
        Prefetcher(iter([]), depth=-1)


@pytest.mark.gpu
def test_batches_are_pinned_for_a_gpu():
    batch = collate([(np.array([7, 8]), np.array([9]))])
    dev = torch.device("cuda", torch.cuda.device_count() - 1)
    with Prefetcher(iter([batch]), depth=2, pin=True, device=dev) as items:
        (got,) = list(items)
    assert isinstance(got, Batch)
    assert got.src.is_pinned() and got.tgt_in.is_pinned() and got.tgt_out.is_pinned()
    on_gpu = got.to(dev)
    assert torch.equal(on_gpu.src.cpu(), batch.src)


def test_training_leaves_no_prefetch_thread(monkeypatch, tmp_path, real_data):
    """A real run ended by max_steps, by an error mid-epoch, by a stop signal: each time the
    thread is gone when train() returns or raises."""
    from test_train import _cfg

    import mt.train.recipe as train_mod

    monkeypatch.setenv("MT_DATA_DIR", str(real_data))
    update = train_mod.Updater.__call__
    train_mod.train(_cfg(tmp_path / "ok", "train.max_steps=2"))
    assert not _prefetch_threads()

    def failing_update(self, group, state):
        raise RuntimeError("update failed")

    monkeypatch.setattr(train_mod.Updater, "__call__", failing_update)
    with pytest.raises(RuntimeError, match="update failed"):
        train_mod.train(_cfg(tmp_path / "bad", "train.max_steps=2"))
    assert not _prefetch_threads()

    def signalled_update(self, group, state):  # a SIGUSR1 arrives during the first update
        monkeypatch.setattr(train_mod.Updater, "__call__", update)
        os.kill(os.getpid(), signal.SIGUSR1)
        return update(self, group, state)

    monkeypatch.setattr(train_mod.Updater, "__call__", signalled_update)
    summary = train_mod.train(_cfg(tmp_path / "signal", "train.max_steps=50"))
    assert (summary["stop"], summary["step"]) == ("signal", 1)
    assert not _prefetch_threads()


# -- train.batch_tokens -------------------------------------------------------------------


@pytest.mark.parametrize("max_tokens", [3125, 4096, 12500, 16384, 25000, 32768])
def test_one_gpu_and_eight_gpus_train_the_same_global_batch(max_tokens):
    """GPUS=1 and GPUS=8 (computed, not launched) give the same padded tokens per update,
    within accum x world tokens of rounding, and never more than batch_tokens or the ceiling."""
    target = 25000
    globals_ = {}
    for world in (1, 2, 8):
        per_rank, accum = batch_plan(target, max_tokens, world)
        assert 1 <= per_rank <= max_tokens
        globals_[world] = per_rank * accum * world
        assert target - accum * world < globals_[world] <= target
        # the fewest accumulation steps the ceiling allows (the reference: a loop)
        fewest = next(a for a in range(1, 100) if a * world * max_tokens >= target)
        assert accum == fewest
    assert abs(globals_[1] - globals_[8]) <= 8
    assert batch_plan(25000, 16384, 1) == (12500, 2)
    assert batch_plan(25000, 16384, 8) == (3125, 1)
    assert batch_plan(25000, 3125, 1) == (3125, 8)


def test_batch_tokens_off_keeps_the_settings_and_a_conflict_names_both():
    assert batch_plan(0, 4096, 8, accum_steps=3) == (4096, 3)
    with pytest.raises(ValueError, match=r"train.batch_tokens=25000.*train.accum_steps=4"):
        batch_plan(25000, 4096, 1, accum_steps=4)
    with pytest.raises(ValueError, match="train.batch_tokens"):
        batch_plan(-1, 4096, 1)


@pytest.mark.parametrize("name", ["wmt14_en_de_base", "wmt14_en_de_big"])
def test_wmt_experiments_train_the_papers_batch_in_bf16_on_one_or_eight_gpus(name):
    from mt.config import load_config
    from mt.train.recipe import _resolve_batch

    cfg = load_config([f"experiment={name}"])
    assert cfg.train.precision == "bf16" and cfg.train.batch_tokens == 25000
    assert cfg.train.compile  # measured faster on an H100 and an H200 (README)
    sizes = []
    for world in (1, 8):
        tc = _resolve_batch(cfg, world).train
        assert tc.max_tokens <= cfg.train.max_tokens
        sizes.append(world * tc.accum_steps * tc.max_tokens)
    assert sizes == [25000, 25000]
    assert load_config(["experiment=multi30k_de_en"]).train.batch_tokens == 0  # the CPU recipe
