"""The decoding driver: many sentences through search, the way every caller decodes.

``mt-translate``, ``mt-evaluate``, validation during training and the benchmark all come here:
the sources are checked against the model's length limit (:func:`fit_to_model`: one policy,
"count long inputs, warn, truncate" or "stop naming the line"), grouped into length-sorted
batches (:func:`make_batches`), and searched with the model as written (``mt.decode.search``)
under the precision ``decode.precision`` asks for (``mt.device.autocast``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import multiprocessing
import signal
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from typing import Any

import torch

from mt.data.batches import collate, make_src
from mt.decode.search import Hypothesis, prefix_tensor, search
from mt.decode.shortlist import check_settings, load_lexicon
from mt.device import autocast, gpu_attention
from mt.schema import DecodeConfig

log = logging.getLogger(__name__)


def fit_to_model(
    src_ids: list[list[int]],
    limit: int | None,
    policy: str = "truncate",
    first_line: int = 1,
    what: str = "source",
) -> list[list[int]]:
    """``src_ids`` (without EOS) checked against the model's ``max_positions`` ``limit``
    (``ids + EOS <= limit``; None: no limit). ``policy``: ``truncate`` cuts the ids to
    ``limit - 1`` (one warning counting the ``what`` lines); ``error`` raises ValueError naming
    the first line too long (``first_line``: the number of ``src_ids[0]``)."""
    if policy not in ("error", "truncate"):
        raise ValueError(f"decode.too_long must be error or truncate, got {policy!r}")
    if limit is None:
        return src_ids
    too_long = [n for n, ids in enumerate(src_ids) if len(ids) + 1 > limit]
    if not too_long:
        return src_ids
    if policy == "error":
        n = too_long[0]
        raise ValueError(
            f"line {first_line + n} has {len(src_ids[n])} tokens, more than the model's "
            f"max_positions - 1 = {limit - 1}; set decode.too_long=truncate to cut it"
        )
    log.warning("%d %s line(s) longer than max_positions=%d truncated", len(too_long), what, limit)
    return [ids[: limit - 1] for ids in src_ids]


def make_batches(lengths: list[int], batch_size: int, max_tokens: int = 0) -> list[list[int]]:
    """Batches of indices into ``lengths`` (source lengths without EOS), longest first, each of
    at most ``batch_size`` sentences and ``max_tokens`` padded source tokens, EOS included
    (0: no limit); every index appears exactly once."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    batches: list[list[int]] = []
    for i in order:  # longest first: a batch is as wide as its first source
        if batches:
            n, width = len(batches[-1]), lengths[batches[-1][0]] + 1
            if n < max(1, batch_size) and not (max_tokens > 0 and (n + 1) * width > max_tokens):
                batches[-1].append(i)
                continue
        batches.append([i])
    return batches


DECODE_PRECISIONS = ("fp32", "bf16", "fp16", "auto")


def resolve_decode(cfg: DecodeConfig, model: Any, device: torch.device | str | None = None
                   ) -> DecodeConfig:  # fmt: skip
    """``cfg`` with ``decode.precision=auto`` resolved: bf16 on a CUDA GPU with native
    bfloat16 (Ampere and later), fp32 elsewhere. On a CPU the model as written decodes fastest
    in float32: under bf16 autocast every step casts each weight again, and attention over the
    caches runs in bfloat16, which CPUs compute no faster. ``device``: where ``model`` runs
    (default: where its first parameter is; a model without parameters decodes in fp32).
    ValueError: a precision other than fp32, bf16, fp16 or auto."""
    if cfg.precision not in DECODE_PRECISIONS:
        raise ValueError(f"decode.precision must be one of {DECODE_PRECISIONS}, got "
                         f"{cfg.precision!r}")  # fmt: skip
    if cfg.precision != "auto":
        return cfg
    if device is None:
        first = next(iter(model.parameters()), None) if hasattr(model, "parameters") else None
        device = "cpu" if first is None else first.device
    device = torch.device(device)
    native = device.type == "cuda" and torch.cuda.is_bf16_supported(including_emulation=False)
    return dataclasses.replace(cfg, precision="bf16" if native else "fp32")


def decode_workers(workers: int, device: torch.device | str, batches: int) -> int:
    """How many batches ``decode.workers`` decodes side by side: on a CPU, as asked (0: one per
    intra-op thread), at most one per batch; elsewhere one (ValueError: a negative count)."""
    if workers < 0:
        raise ValueError(f"decode.workers must be >= 0 (0: one per core), got {workers}")
    if torch.device(device).type != "cpu":
        return 1
    return max(1, min(workers or torch.get_num_threads(), batches))


_JOB: Callable[[list[int]], Any] | None = None  # the batch decoder of the pool being forked


def _run_job(batch: list[int]) -> Any:
    """In a forked worker: the parent's batch decoder (inherited) on one batch."""
    assert _JOB is not None
    return _JOB(batch)


@functools.cache
def _tell(workers: int, kind: str, each: int) -> None:
    """Log once per process (and setting) which kind of workers decode here."""
    log.info("decoding %d batches at a time, in %s of %d intra-op thread(s) each", workers,
             kind, each)  # fmt: skip


def _worker_init(threads: int) -> None:
    torch.set_num_threads(threads)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle


def forks_workers(threads_each: int = 1) -> bool:
    """Whether side-by-side decoding runs in forked processes here: where ``fork`` exists, each
    worker runs on one intra-op thread (GNU OpenMP's thread pool does not survive a fork: a
    child that opens a parallel region of two threads hangs, as torch's data-loader workers
    avoid by running on one), this process runs no other Python thread (a fork copies only
    the calling thread, and with it any lock another one holds; training's prefetch thread and
    ``mt-serve``'s keep the threads) and is not itself a daemonic worker (which may not have
    children)."""
    return (
        threads_each == 1
        and "fork" in multiprocessing.get_all_start_methods()
        and threading.active_count() == 1
        and not multiprocessing.current_process().daemon
    )


@contextlib.contextmanager
def side_by_side(
    workers: int, job: Callable[[list[int]], Any]
) -> Iterator[Callable[[list[list[int]]], Iterator[Any]]]:
    """``map`` of ``job`` over batches, ``workers`` batches at a time, sharing this process's
    intra-op threads between them; results in order, the first error raised (and the batches not
    yet started cancelled); the thread count is restored after.

    Decoding spends much of a step in Python under the interpreter's lock, where threads side
    by side mostly wait for each other. So where :func:`forks_workers`, the workers are forked
    processes of one thread each (the model and inputs inherited, nothing pickled but batch
    indices and hypotheses); elsewhere threads (docs/performance.md)."""
    global _JOB
    total = torch.get_num_threads()
    each = max(1, total // workers)
    torch.set_num_threads(each)
    try:
        forked = forks_workers(each)
        _tell(workers, "forked processes" if forked else "threads", each)
        if forked:
            _JOB = job
            context = multiprocessing.get_context("fork")
            pool = ProcessPoolExecutor(workers, context, _worker_init, (each,))
            run = functools.partial(pool.map, _run_job)
        else:  # set in each thread too: OpenMP keeps the count per thread
            pool = ThreadPoolExecutor(workers, "mt-decode", torch.set_num_threads, (each,))
            run = functools.partial(pool.map, job)
        try:
            yield run
        finally:  # on an error or Ctrl-C here, the batches not yet started are dropped
            pool.shutdown(wait=True, cancel_futures=True)
    finally:
        _JOB = None
        torch.set_num_threads(total)


def sample_seed(seed: int, index: int) -> int:
    """The generator seed of sentence ``index`` (its position in the whole input)."""
    return (seed * 1_000_003 + index) % (1 << 63)


def translate_nbest(
    model: Any,
    src_ids: list[list[int]],
    decode_cfg: DecodeConfig,
    device: torch.device | str = "cpu",
    min_len: int = 0,
    prefix: list[list[int]] | None = None,
    indices: list[int] | None = None,
) -> list[list[Hypothesis]]:
    """Search many sentences in length-sorted batches: ``decode_cfg.nbest`` (at most
    ``beam_size``) hypotheses per sentence, best first, in input order.

    ``model`` (on ``device``, in eval mode) may be an ensemble; ``src_ids`` have no EOS, and
    those longer than its ``max_positions`` are truncated with a warning (callers with a
    stricter policy check first with :func:`fit_to_model`); ``min_len`` and ``prefix`` (target
    ids per sentence): see mt.decode.search.generate. ``indices``: per sentence, its position
    in the whole input (sampling seeds; default 0, 1, ...), so a sentence's sample does not
    depend on how the input is split.
    """
    src_ids = fit_to_model(src_ids, model.max_positions, "truncate")
    precision = resolve_decode(decode_cfg, model, device).precision
    gpu_attention(torch.device(device))
    lexicon = None
    if decode_cfg.shortlist:
        check_settings(decode_cfg.shortlist_k, decode_cfg.shortlist_frequent)
        lexicon = load_lexicon(decode_cfg.shortlist, model.vocab_size)
    indices = list(range(len(src_ids))) if indices is None else indices
    lengths = [len(ids) for ids in src_ids]
    out: list[list[Hypothesis]] = [[] for _ in src_ids]

    def decode(batch: list[int]) -> list[list[Hypothesis]]:
        src = make_src([list(src_ids[i]) for i in batch]).to(device)
        forced = [list(prefix[i]) for i in batch] if prefix is not None else None
        seeds = [sample_seed(decode_cfg.seed, indices[i]) for i in batch]
        shortlist = None
        if lexicon is not None:
            k, frequent = decode_cfg.shortlist_k, decode_cfg.shortlist_frequent
            shortlist = lexicon.shortlist(src, k, frequent, prefix_tensor(forced, device))
        with autocast(device, precision):
            return search(model, src, decode_cfg, min_len, forced, seeds, shortlist)

    batches = make_batches(lengths, decode_cfg.batch_size, decode_cfg.max_tokens)
    workers = decode_workers(decode_cfg.workers, device, len(batches))
    with contextlib.ExitStack() as stack:
        if workers == 1:
            results = map(decode, batches)
        else:  # the same batches, so the same outputs
            results = stack.enter_context(side_by_side(workers, decode))(batches)
        for batch, hyps in zip(batches, results):
            for i, h in zip(batch, hyps):
                out[i] = h
    return out


def translate_ids(
    model: Any,
    src_ids: list[list[int]],
    decode_cfg: DecodeConfig,
    device: torch.device | str = "cpu",
    min_len: int = 0,
    prefix: list[list[int]] | None = None,
    indices: list[int] | None = None,
) -> list[list[int]]:
    """The best output ids (no BOS/EOS) for each source, in input order (see translate_nbest)."""
    hyps = translate_nbest(model, src_ids, decode_cfg, device, min_len, prefix, indices)
    return [h[0].tokens for h in hyps]


@torch.inference_mode()
def score_ids(
    model: Any,
    src_ids: list[list[int]],
    tgt_ids: list[list[int]],
    device: torch.device | str = "cpu",
    batch_size: int = 64,
) -> list[list[float]]:
    """Teacher-forced ``log p(y_t | y_<t, x)`` of each target token and the final EOS
    (``len(tgt) + 1`` values per sentence, in input order) of targets ``tgt_ids`` (without
    BOS/EOS) given sources ``src_ids`` (without EOS). ``model``: anything whose
    ``decode(tgt_in, enc, None)`` gives (B, T, V) scores for a whole prefix (eval mode)."""
    src_ids = fit_to_model(src_ids, model.max_positions, "truncate")
    tgt_ids = fit_to_model(tgt_ids, model.max_positions, "truncate", what="target")
    out: list[list[float]] = [[] for _ in src_ids]
    for batch in make_batches([len(s) for s in src_ids], batch_size):
        pairs = collate([(src_ids[i], tgt_ids[i]) for i in batch]).to(device)
        logits = model.decode(pairs.tgt_in, model.encode(pairs.src), None)  # (B, T, V)
        lprobs = torch.log_softmax(logits.float(), dim=-1)
        picked = lprobs.gather(-1, pairs.tgt_out[..., None]).squeeze(-1).cpu()  # (B, T)
        for row, i in enumerate(batch):
            out[i] = picked[row, : len(tgt_ids[i]) + 1].tolist()
    return out
