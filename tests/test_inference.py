"""The decoding driver (mt.decode.driver): the precision it decodes in, the row buckets of the
training products it shares a process with, and batches decoded side by side in workers."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import assert_same_nbest, sharp_random_model

from mt.decode.driver import resolve_decode, translate_nbest
from mt.schema import DecodeConfig


@pytest.fixture()
def model():
    return sharp_random_model(vocab_size=45)  # 45: padded to 48, the head slices it back


def sources(seed: int, lengths: list[int]) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(4, 45, (n,), generator=g).tolist() for n in lengths]


def test_auto_decode_precision_is_bf16_only_on_a_gpu_with_native_bfloat16(model, monkeypatch):
    """decode.precision=auto: fp32 on a CPU (the model as written is fastest in float32 there),
    bf16 on a CUDA device with native bfloat16, fp32 on one without; an explicit choice stays,
    and an unknown one is named."""
    auto = DecodeConfig(precision="auto")
    assert resolve_decode(auto, model).precision == "fp32"  # the model's parameters: CPU
    assert resolve_decode(auto, model, "cpu").precision == "fp32"
    for native, want in ((True, "bf16"), (False, "fp32")):
        monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True,
                            native=native: native)  # fmt: skip
        assert resolve_decode(auto, model, "cuda").precision == want
    for kept in ("fp32", "bf16", "fp16"):
        assert resolve_decode(DecodeConfig(precision=kept), model, "cuda").precision == kept
    with pytest.raises(ValueError, match=r"decode.precision must be one of .*'int8'"):
        resolve_decode(DecodeConfig(precision="int8"), model)


def test_bf16_decoding_is_the_model_under_autocast(model):
    """decode.precision=bf16 on a CPU: the model as written under bfloat16 autocast, batched
    as in float32; its n-best lists are those of the model called under autocast itself."""
    from mt.data.batches import make_src
    from mt.decode.search import beam_search

    ids = sources(3, [4, 7, 2, 9])
    cfg = DecodeConfig(beam_size=3, nbest=2, batch_size=4, max_len_a=1.0, max_len_b=5,
                       precision="bf16")  # fmt: skip
    got = translate_nbest(model, ids, cfg)
    order = sorted(range(len(ids)), key=lambda i: -len(ids[i]))  # the driver's one batch
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = beam_search(model, make_src([ids[i] for i in order]), 3, cfg.alpha, 1.0, 5, 2)
    assert_same_nbest(want, [got[i] for i in order], abs_tol=1e-6)
    fp32 = translate_nbest(model, ids, dataclasses.replace(cfg, precision="fp32"))
    gap = max(abs(a.score - b.score) for x, y in zip(got, fp32) for a, b in zip(x, y))
    assert gap > 1e-4  # bfloat16's products differ from float32's: autocast was on


def test_onednn_rows_are_bucketed_to_few_sizes():
    """oneDNN keeps a kernel per input shape (about 1 MB each, never freed: 1.5 GB after 1,500
    row counts); products pad their rows to few sizes, at most 6.25% (or 7 rows) more."""
    from mt.fast.onednn import bucket_rows

    sizes = {bucket_rows(r) for r in range(400, 2601)}
    assert len(sizes) <= 48  # 16 per doubling
    for r in range(1, 5000):
        b = bucket_rows(r)
        assert r <= b <= max(r * 1.0625, r + 7)
        assert bucket_rows(b) == b


def _record_calls(monkeypatch, path, then):
    """``search`` replaced by one that appends (process id, thread name, intra-op threads) to
    ``path`` (one line each: a forked worker's calls reach the parent through the file), then
    calls ``then``."""
    import os
    import threading

    import mt.decode.driver

    def spy(*args, **kwargs):
        with open(path, "a") as f:
            f.write(f"{os.getpid()} {threading.current_thread().name} {torch.get_num_threads()}\n")
        return then(*args, **kwargs)

    monkeypatch.setattr(mt.decode.driver, "search", spy)


def _calls(path) -> list[tuple[int, str, int]]:
    if not path.exists():
        return []
    lines = path.read_text().splitlines()
    return [(int(p), n, int(t)) for p, n, t in (line.split() for line in lines)]


@pytest.mark.parametrize("processes", [True, False])
@pytest.mark.parametrize(
    "settings",
    [{"beam_size": 1}, {"beam_size": 3, "nbest": 2}, {"beam_size": 2, "precision": "bf16"},
     {"sample": True, "top_k": 5, "seed": 3}],
)  # fmt: skip
def test_batches_decoded_side_by_side_equal_one_worker(
    model, monkeypatch, tmp_path, settings, processes
):
    """decode.workers=2: the same batches in two forked processes of one intra-op thread each
    (or two threads of two, where this process may not fork), give the n-best lists of one
    worker; the thread count is restored after."""
    import os

    import mt.decode.driver

    ids = sources(7, [3, 9, 5, 12, 1, 7, 4, 10, 6, 2, 8, 11])
    cfg = {"batch_size": 2, "max_len_a": 1.0, "max_len_b": 4, **settings}
    one = translate_nbest(model, ids, DecodeConfig(**cfg, workers=1))
    monkeypatch.setattr(mt.decode.driver, "forks_workers", lambda each: processes and each == 1)
    _record_calls(monkeypatch, tmp_path / "calls", mt.decode.driver.search)
    before = torch.get_num_threads()
    threads = 2 if processes else 4
    torch.set_num_threads(threads)
    try:
        two = translate_nbest(model, ids, DecodeConfig(**cfg, workers=2))
        assert torch.get_num_threads() == threads
    finally:
        torch.set_num_threads(before)
    seen = _calls(tmp_path / "calls")
    assert len(seen) == 6 and all(t == threads // 2 for _, _, t in seen)
    if processes:  # every batch in a child of this process, none here
        assert all(pid != os.getpid() for pid, _, _ in seen) and len({p for p, _, _ in seen}) <= 2
    else:
        assert all(pid == os.getpid() and n.startswith("mt-decode") for pid, n, _ in seen)
    assert_same_nbest(one, two)


def test_workers_fork_only_from_a_process_without_other_threads():
    """A fork copies only the calling thread (and any lock another holds): with a second thread
    running, side-by-side decoding keeps to threads."""
    import threading

    from mt.decode.driver import forks_workers

    release = threading.Event()
    other = threading.Thread(target=release.wait)
    other.start()
    try:
        assert not forks_workers()
    finally:
        release.set()
        other.join()
    alone = threading.active_count() == 1
    assert forks_workers() == alone and not forks_workers(2)  # never two OpenMP threads each


FORKED_DECODING = """
import json, os, sys, torch
sys.path.insert(0, sys.argv[2])  # the tests' conftest
torch.set_num_threads(2)
import mt.decode.driver as driver
from conftest import sharp_random_model
from mt.schema import DecodeConfig
model = sharp_random_model(vocab_size=45)
g = torch.Generator().manual_seed(7)
ids = [torch.randint(4, 45, (n,), generator=g).tolist() for n in [3, 9, 5, 12, 1, 7, 4, 10]]
cfg = dict(batch_size=2, beam_size=3, nbest=2, max_len_a=1.0, max_len_b=4)
one = driver.translate_nbest(model, ids, DecodeConfig(**cfg, workers=1))
real = driver.search
def spy(*args, **kwargs):
    with open(sys.argv[1], "a") as f:
        f.write(f"{os.getpid()} {torch.get_num_threads()}\\n")
    return real(*args, **kwargs)
driver.search = spy
two = driver.translate_nbest(model, ids, DecodeConfig(**cfg, workers=2))
flat = lambda r: [[(h.tokens, h.score) for h in n] for n in r]
print(json.dumps({"one": flat(one), "two": flat(two), "pid": os.getpid(),
                  "threads": torch.get_num_threads(), "forks": driver.forks_workers()}))
"""


def test_a_process_alone_decodes_in_forked_workers_of_one_thread(tmp_path):
    """In a fresh interpreter (no other thread, as ``mt-translate``) with 2 intra-op threads,
    ``decode.workers=2`` decodes every batch in forked children of one thread each (after the
    parent ran its OpenMP threads: the children must not hang), with the n-best lists of one
    worker on both threads (the same tokens; the scores to rounding, one thread summing in
    another order than two)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    from mt.decode.search import Hypothesis

    calls = tmp_path / "calls"
    tests = str(Path(__file__).parent)
    run = subprocess.run([sys.executable, "-c", FORKED_DECODING, str(calls), tests],
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["forks"] and out["threads"] == 2

    def hyps(lists):
        return [[Hypothesis(tokens, score, score) for tokens, score in n] for n in lists]

    assert_same_nbest(hyps(out["one"]), hyps(out["two"]))
    seen = [line.split() for line in calls.read_text().splitlines()]
    assert len(seen) == 4  # 8 sentences, batches of 2
    assert all(int(pid) != out["pid"] and threads == "1" for pid, threads in seen)


@pytest.mark.parametrize("processes", [True, False])
def test_an_error_in_a_decoding_worker_is_raised_and_the_threads_restored(
    model, monkeypatch, tmp_path, processes
):
    import time

    import mt.decode.driver

    def failing(*args, **kwargs):
        time.sleep(0.01)  # long enough for the other batches to be cancelled, not run
        raise RuntimeError("out of memory in batch")

    monkeypatch.setattr(mt.decode.driver, "forks_workers", lambda each: processes)
    _record_calls(monkeypatch, tmp_path / "calls", failing)
    before = torch.get_num_threads()
    torch.set_num_threads(2)  # one thread per worker
    try:
        with pytest.raises(RuntimeError, match="out of memory in batch"):
            translate_nbest(model, sources(8, [3] * 40), DecodeConfig(batch_size=1, workers=2))
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    assert 1 <= len(_calls(tmp_path / "calls")) < 40  # the batches not started were cancelled


def test_decode_workers_auto_is_one_per_thread_on_a_cpu_and_one_on_a_gpu():
    from mt.decode.driver import decode_workers

    threads = torch.get_num_threads()
    assert decode_workers(0, "cpu", 100) == threads
    assert decode_workers(0, "cpu", 1) == 1  # never more workers than batches
    assert decode_workers(3, "cpu", 2) == 2 and decode_workers(3, "cpu", 10) == 3
    assert decode_workers(0, "cuda", 100) == 1 and decode_workers(4, "cuda", 100) == 1
    with pytest.raises(ValueError, match="decode.workers"):
        decode_workers(-1, "cpu", 10)


@pytest.mark.parametrize("processes", [True, False])
def test_stopping_while_workers_decode_drops_the_batches_not_started(
    monkeypatch, tmp_path, processes
):
    """An error (or Ctrl-C) in the loop that reads the workers' results: the batches not yet
    started are dropped, not decoded before the error surfaces."""
    import time

    import mt.decode.driver
    from mt.decode.driver import side_by_side

    monkeypatch.setattr(mt.decode.driver, "forks_workers", lambda each: processes)
    calls = tmp_path / "calls"

    def job(batch):
        with open(calls, "a") as f:
            f.write(f"{batch[0]}\n")
        time.sleep(0.02)
        return batch

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with pytest.raises(KeyboardInterrupt), side_by_side(2, job) as run:
            results = run([[i] for i in range(60)])  # held, as translate_nbest holds it
            for out in results:
                if out == [1]:
                    raise KeyboardInterrupt
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    assert 2 <= len(calls.read_text().splitlines()) < 20
