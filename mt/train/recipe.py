"""Stage 4, ``mt-train``: the training recipe, setup -> train -> save -> cleanup.

The run directory holds everything a run writes (docs/training.md, "What a run writes"), written
by rank 0 alone, holding ``run_dir/.lock``. Starting ``mt-train`` on a run directory that has
``checkpoints/last.pt`` resumes it exactly: model, optimiser, schedule, loss scale, every RNG
state of every rank and the position in the data (an unreadable last.pt: the newest readable
periodic checkpoint, see :mod:`mt.train.state`). ``train.init_from=CKPT`` instead starts a NEW
run from a checkpoint's weights (fresh optimiser, schedule and data order). SIGTERM, SIGUSR1 or
Ctrl-C saves ``last.pt`` and stops; the command then exits with 75 (130 for Ctrl-C), see
:mod:`mt.train.preempt`.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch

from mt import distributed
from mt.allocator import describe_allocator
from mt.checkpoint import load_checkpoint, save_checkpoint
from mt.data.batches import batch_plan, iterate_batches
from mt.data.build import prepare
from mt.data.prefetch import Prefetcher
from mt.fast import (  # the one import of mt.fast in mt.train: what training takes of it
    adopt_probes,
    compile_step,
    compiled_graphs,
    fitted_max_tokens,
    for_training,
    machine,
    pad_multiple,
    probe_decisions,
    resolve_precision,
    set_fp32_precision,
    step_loss,
)
from mt.files import remove_stale_temps, write_json
from mt.model.transformer import build_model
from mt.schema import Config
from mt.train import preempt
from mt.train.ema import WeightEMA
from mt.train.lock import RunLock
from mt.train.progress import progress
from mt.train.schedule import STOPS, budget_progress, cooldown_factor, describe_budget, noam_lambda
from mt.train.snapshots import average_into_best, checkpoint_of, ema_into_best, restore, save
from mt.train.state import (
    HIGHER_IS_BETTER,
    TrainBatches,
    TrainState,
    agree_on_resume,
    better,
    check_compatible,
    check_data_plan,
    has_checkpoints,
    keep_best_of_best_pt,
    metric_key,
    record_config,
    resets_to_apply,
    seed_everything,
    set_rng_state,
)
from mt.train.tracking import MetricsLog, resident_fields
from mt.train.update import Updater, UpdateResult, build_optimizer
from mt.train.validation import describe_search, describe_selection, validate

log = logging.getLogger(__name__)

PREEMPTED = "preempted.json"  # written when a signal stopped the run, removed when it restarts


@dataclass
class Run:
    """Everything a training run holds between setup and cleanup."""

    cfg: Config
    info: distributed.DistInfo
    run_dir: Path
    prepared: Any
    raw_model: torch.nn.Module  # unwrapped, uncompiled: what is saved and decoded
    training_model: torch.nn.Module  # mt.fast.TrainingModel, unwrapped: validation's loss
    update: Updater
    data: TrainBatches  # each epoch's pairs and batch sampler
    state: TrainState
    metrics: MetricsLog
    key: str  # valid_bleu or valid_loss
    stop: preempt.StopFlag = field(default_factory=preempt.StopFlag)
    batches: Optional[Prefetcher] = None  # the current epoch's batches, collated ahead
    ema: Optional[WeightEMA] = None  # train.ema: the moving average of raw_model's weights

    def prefetch(self, source) -> Prefetcher:
        """Collate ``source``'s batches ahead in a background thread (pinned for a GPU)."""
        self.close_batches()
        device = self.info.device
        pin = device.type == "cuda"
        self.batches = Prefetcher(source, self.cfg.train.prefetch, pin=pin, device=device)
        return self.batches

    def close_batches(self) -> None:
        """Stop the background thread of :meth:`prefetch`, if any, and wait for it."""
        if self.batches is not None:
            self.batches.close()
            self.batches = None

    @property
    def ckpt_dir(self) -> Path:
        return self.run_dir / "checkpoints"


def train(cfg: Config) -> dict[str, Any]:
    """Train (or resume) the run in ``cfg.run_dir``; under torchrun, one call per rank. Returns
    ``step``, ``epoch``, ``stop`` (why training ended), ``signal``, ``best`` (the best validation
    value), ``metric`` and ``run_dir``."""
    info = distributed.setup(cfg.train.device, cfg.train.dist_timeout_minutes)
    file_log = restore_signals = lock = run = None
    try:
        lock = _lock_run_dir(Path(cfg.run_dir))
        if info.is_main:
            file_log = logging.FileHandler(Path(cfg.run_dir) / "train.log", encoding="utf-8")
            file_log.setFormatter(logging.Formatter("%(asctime)s | %(levelname)s | %(message)s"))
            logging.getLogger().addHandler(file_log)
        run = setup(cfg, info)
        restore_signals = preempt.install(run.stop, "saving last.pt and stopping")
        try:
            stop = train_loop(run)
            return finish(run, stop)
        finally:
            run.close_batches()
            run.metrics.close()
    finally:
        if restore_signals is not None:
            restore_signals()
        if file_log is not None:
            logging.getLogger().removeHandler(file_log)
            file_log.close()
        if lock is not None:
            lock.release()
        # run and the signal handler's closure hold the DDP wrapper: it goes before the group
        run = restore_signals = None
        distributed.cleanup()


def _lock_run_dir(run_dir: Path) -> Optional[RunLock]:
    """Rank 0 (the only process that writes the run directory) takes its lock; every rank
    learns whether it did, so all of them stop together when another run holds it (rank 0
    with its :class:`LockError`, the others with a ``RankError`` quoting it)."""
    taken: list[RunLock] = []
    distributed.decide_on_rank0(lambda: taken.append(RunLock(run_dir).acquire()),
                                f"locking run_dir {run_dir}")  # fmt: skip
    return taken[0] if taken else None


def setup(cfg: Config, info: distributed.DistInfo) -> Run:
    """Data, model, optimiser, schedule and state, fresh, from ``init_from``, or resumed."""
    tc = cfg.train
    run_dir = Path(cfg.run_dir)
    if tc.threads > 0:
        torch.set_num_threads(tc.threads)
    set_fp32_precision(info.device, tc.tf32)
    seed_everything(tc.seed)
    ckpt_dir = run_dir / "checkpoints"
    if info.is_main:
        remove_stale_temps(run_dir, ckpt_dir)
        (run_dir / PREEMPTED).unlink(missing_ok=True)
        record_config(run_dir, cfg, resuming=has_checkpoints(ckpt_dir))
    prepared = _prepared(cfg, info)
    cfg = _fit_batch(cfg, info, prepared.vocab_size)
    cfg = _resolve_batch(cfg, info.world_size)
    precision = _precision(cfg, info, prepared.vocab_size)
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, precision=precision))
    tc = cfg.train

    resume, resume_path = agree_on_resume(ckpt_dir, info.is_main)
    data = TrainBatches(prepared, cfg, info.rank, info.world_size)
    data.plan_ahead(0 if resume is None else int(resume["state"]["epoch"]))  # a guess on resume
    raw = build_model(cfg.model, prepared.vocab_size)  # same init on every rank (same seed)
    resets = resets_to_apply(tc, resume, resume_path)
    # the tokenizer's bytes only where a checkpoint is checked against them (a fresh run skips
    # their serialisation)
    pieces = prepared.tokenizer.to_bytes() if resume is not None or tc.init_from else None
    if resume is not None:
        check_compatible(resume, cfg, prepared.vocab_size, resume_path, pieces)
        if "data" not in resets:
            check_data_plan(resume, cfg, info.world_size, resume_path)
        raw.load_state_dict(resume["model"])
        log.info("resuming %s from %s (step %d)", run_dir, resume_path.name, resume["step"])
    elif tc.init_from:
        init = load_checkpoint(tc.init_from)
        check_compatible(init, cfg, prepared.vocab_size, Path(tc.init_from), pieces)
        raw.load_state_dict(init["model"])
        log.info("initialised from %s (step %d); fresh optimiser", tc.init_from, init["step"])
    raw.to(info.device)
    n_params = sum(p.numel() for p in raw.parameters())
    log.info("model: %s parameters, vocabulary %d", f"{n_params:,}", prepared.vocab_size)
    log.info("memory allocator: %s", describe_allocator())

    log.info("budget: %s", describe_budget(tc))
    optimizer = build_optimizer(raw.parameters(), tc, info.device)
    if tc.cooldown > 0 and tc.max_steps <= 0 and tc.max_minutes <= 0:
        raise ValueError("train.cooldown needs a budget: set train.max_steps or train.max_minutes")
    lr_lambda = noam_lambda(cfg.model.d_model, tc.warmup, tc.factor, tc.lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)
    scaler = torch.amp.GradScaler(info.device.type, enabled=tc.precision == "fp16")
    state = TrainState()
    if resume is not None:
        state = restore(resume, cfg, resets, optimizer, scheduler, scaler)
        if "meters" not in resets:
            keep_best_of_best_pt(state, ckpt_dir / "best.pt", metric_key(cfg))

    # The module the training step runs (mt.fast.for_training), compiled, then wrapped in DDP
    forward = _training_forward(raw, cfg, info)
    model = compile_step(forward, tc, info.device, _bucket_shapes(data, state.epoch))
    model = distributed.wrap(model, info)
    where = {**machine(info.device), "torch": torch.__version__}  # MLflow's tags
    metrics = MetricsLog(run_dir, state.step, info.is_main, cfg, where)
    update = Updater(model, raw.parameters(), optimizer, scheduler, scaler, cfg, info.world_size,
                     loss_fn=step_loss(model))  # fmt: skip
    # RNG last: from here on the resumed run draws exactly what the uninterrupted one drew.
    if resume is not None:
        states = resume["rng"]
        if len(states) != info.world_size:
            log.warning(
                "resuming %d ranks from %d: RNG streams differ", info.world_size, len(states)
            )
        set_rng_state(states[info.rank % len(states)])
    else:
        seed_everything(tc.seed + info.rank)  # different dropout masks on each rank
    key = metric_key(cfg)
    log.info("best.pt and patience: %s", describe_selection(cfg, key))
    run = Run(cfg, info, run_dir, prepared, raw, forward, update, data, state, metrics, key)
    run.ema = _moving_average(raw, tc.ema, resume, resume_path)
    return run


def _bucket_shapes(data: TrainBatches, epoch: int) -> list | None:
    """The batch shapes of ``train.shape_buckets`` (those of the epoch's sampler), or None."""
    if not data.cfg.train.shape_buckets:
        return None
    buckets = data.at(epoch)[1].buckets
    return None if buckets is None else buckets.shapes()


def _moving_average(raw, decay: float, resume, resume_path) -> Optional[WeightEMA]:
    """``train.ema``'s average of ``raw``'s weights (None when 0): a resumed run's own, or
    one that starts at the weights in hand."""
    if not decay:
        return None
    ema = WeightEMA(raw.parameters(), decay)
    if resume is not None and resume.get("ema") is not None:
        ema.load_state_dict(resume["ema"], str(resume_path))
    elif resume is not None:
        log.info("train.ema: %s holds no moving average; it starts at the resumed weights",
                 resume_path)  # fmt: skip
    return ema


def train_loop(run: Run) -> str:
    """Updates until a limit, a signal or patience stops training; returns the reason."""
    tc, state = run.cfg.train, run.state
    bar = progress(
        "train", total=tc.max_steps or None, initial=state.step, disable=not run.info.is_main
    )
    wall0, t0 = state.wall, time.perf_counter()
    logged: list[UpdateResult] = []  # the updates since the last log record (on the device)
    t_log, paused = t0, 0.0  # when that record was written; time validating/saving since
    stop = _limits(run)
    while stop is None:
        split, sampler = run.data.at(state.epoch)
        n_batches = len(sampler.batches(state.epoch))
        if n_batches == 0:
            raise RuntimeError("no training batches: check the data and train.max_tokens")
        counts = sampler.corpus_counts(state.epoch)
        if counts is not None:
            log.info("epoch %d pairs by corpus: %s", state.epoch, sampler.mix.describe(counts))
        source = iterate_batches(split, sampler, state.epoch, start=state.batch,
                                 pad_multiple=pad_multiple(tc), one_graph=tc.compile)  # fmt: skip
        batches = run.prefetch(source)
        for group in _groups(batches, tc.accum_steps):
            group = [b.to(run.info.device) for b in group]
            lr = _apply_cooldown(run)
            result = run.update(group, state)
            state.batch += len(group)
            state.wall = wall0 + time.perf_counter() - t0
            if result is not None:
                state.step += 1
                if run.ema is not None:
                    run.ema.update()
                bar.update(1)
                if tc.log_every > 0:
                    logged.append(result)
                if tc.log_every > 0 and (state.step % tc.log_every == 0 or state.step == 1):
                    epoch = round(state.epoch + state.batch / n_batches, 4)
                    _log_updates(run, logged, lr, epoch, bar, t_log, paused)
                    logged, t_log, paused = [], time.perf_counter(), 0.0
                t_pause = time.perf_counter()
                if tc.eval_every > 0 and state.step % tc.eval_every == 0:
                    run_validation(run)
                if tc.save_every > 0 and state.step % tc.save_every == 0:
                    save(run, periodic=True)
                paused += time.perf_counter() - t_pause
            stop = _limits(run)
            if stop is not None:
                break
        else:
            state.epoch += 1
            state.batch = 0
            if tc.max_epochs > 0 and state.epoch >= tc.max_epochs:
                stop = "max_epochs"
    run.close_batches()
    run.update.check(state)
    bar.close()
    log.info("training stopped at step %d: %s (%s)", state.step, STOPS.get(stop, stop), stop)
    return stop


def _log_updates(
    run: Run, results: list[UpdateResult], lr: float, epoch: float, bar, since: float,
    paused: float,
) -> None:  # fmt: skip
    """The log record of the latest update, and the progress bar's figures: ONE read of the
    device for all the updates since the last record (their tokens give the rate over the
    training time since ``since``, less ``paused`` seconds of validation and saving)."""
    state = run.state
    figures = torch.stack([r.figures for r in results]).tolist()  # (k, 4): waits for the device
    run.update.check(state)  # the device's finite checks (GPU), read with the figures
    loss, nll, _, gnorm = figures[-1]
    tok_s = sum(f[2] for f in figures) / max(time.perf_counter() - since - paused, 1e-9)
    # the figures of the last record: a log line between records names their update
    bar.set_postfix_str(f"update {state.step}: loss {loss:.3f} lr {lr:.2e} tok/s {tok_s:,.0f}")
    run.metrics.write(
        {
            "step": state.step,
            "epoch": epoch,
            "loss": loss,
            "nll": nll,
            "ppl": math.exp(min(nll, 50.0)),
            "lr": lr,
            "gnorm": gnorm,
            "tgt_tok_per_s": tok_s,
            "wall": round(state.wall, 3),
            **({"compiled_graphs": compiled_graphs()} if run.cfg.train.compile else {}),
        }
    )


def _prepared(cfg: Config, info: distributed.DistInfo):
    """The prepared data. One process builds it on a cache miss; under torchrun every rank only
    loads it (building it inside a collective's timeout would fail on a large corpus), so a
    miss stops every rank with an error that says to run ``mt-prepare`` first."""
    if not info.distributed:
        return prepare(cfg)
    prepared, error = None, None
    try:
        prepared = prepare(cfg, build=False)
    except Exception as err:  # every rank stops, not only this one
        error = err
    distributed.check_all(error, "loading the prepared data")
    return prepared


def _training_forward(raw: torch.nn.Module, cfg: Config, info: distributed.DistInfo):
    """``mt.fast.for_training``'s module for ``raw``. In a distributed run rank 0 builds it
    first, probing the kernels it chooses by (``train.products``, ``train.projection``), and
    the other ranks take rank 0's choices (``mt.fast.adopt_probes``), as they take its
    precision: one probe instead of one per rank at once, and every rank on the same kernels."""
    tc = cfg.train

    def build():
        return for_training(
            raw, info.device, tc.cpu_kernels, tc.precision, tc.compile, tc.max_tokens,
            cfg.cache_dir, tc.master_weights, tc.activation_checkpointing,
        )  # fmt: skip

    built: list[torch.nn.Module] = []

    def first() -> dict[str, str]:  # rank 0 (or the only process): build, and say what it chose
        built.append(build())
        return probe_decisions()

    decisions = distributed.decide_on_rank0(first, "choosing the training kernels")
    if built:
        return built[0]
    adopt_probes(decisions)
    return build()


def _precision(cfg: Config, info: distributed.DistInfo, vocab: int) -> str:
    """``train.precision`` resolved (``auto``: measured at the run's shapes and cached beside
    the prepared data, ``mt.fast.resolve_precision``); rank 0 decides for every rank."""
    tc = cfg.train
    shape = (tc.max_tokens, cfg.model.d_model, cfg.model.d_ff)
    return distributed.decide_on_rank0(
        lambda: resolve_precision(
            tc.precision, info.device, shape, tc.cpu_kernels, cfg.cache_dir, vocab
        ),
        "resolving train.precision",
    )


def _fit_batch(cfg: Config, info: distributed.DistInfo, vocab_size: int) -> Config:
    """``cfg`` with ``train.max_tokens`` the per-GPU batch the memory model fits
    (``train.fit_batch``, :func:`mt.fast.compile.fitted_max_tokens`; rank 0 decides for every
    rank); unchanged where it does not apply."""
    if not cfg.train.fit_batch:
        return cfg
    fitted = distributed.decide_on_rank0(
        lambda: fitted_max_tokens(cfg, vocab_size, info.device), "fitting train.max_tokens"
    )
    if fitted is None:
        log.info("train.fit_batch: applies on CUDA with train.batch_tokens; max_tokens stays %d",
                 cfg.train.max_tokens)  # fmt: skip
        return cfg
    log.info("train.fit_batch: %d padded tokens per GPU batch fit the memory model "
             "(train.max_tokens was %d)", fitted, cfg.train.max_tokens)  # fmt: skip
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, max_tokens=fitted))


def _resolve_batch(cfg: Config, world_size: int) -> Config:
    """``cfg`` with each rank's ``max_tokens`` and ``accum_steps`` for ``train.batch_tokens``
    (:func:`mt.data.batches.batch_plan`; unchanged when it is 0), logged."""
    tc = cfg.train
    max_tokens, accum = batch_plan(tc.batch_tokens, tc.max_tokens, world_size, tc.accum_steps)
    log.info(
        "batch: up to %d padded tokens per update = %d rank(s) x %d accumulation step(s) x "
        "max_tokens %d%s", world_size * accum * max_tokens, world_size, accum, max_tokens,
        f" (train.batch_tokens={tc.batch_tokens})" if tc.batch_tokens else "",
    )  # fmt: skip
    resolved = dataclasses.replace(tc, max_tokens=max_tokens, accum_steps=accum)
    return dataclasses.replace(cfg, train=resolved)


def run_validation(run: Run) -> dict[str, float]:
    """Validate (the work shared by all ranks), keep best.pt and the patience count."""
    state, info = run.state, run.info
    result = validate(
        run.raw_model, run.prepared, run.cfg, info.device, info.rank, info.world_size,
        loss_model=run.training_model,
    )  # fmt: skip
    # every rank computed the same figures (shared work, gathered); rank 0's value decides
    value = distributed.decide_on_rank0(lambda: result.get(run.key), "the validation metric")
    state.last_eval_step = state.step
    improved = better(run.key, value, state.best)
    if improved:
        state.best, state.best_step, state.bad_evals = value, state.step, 0
    else:
        state.bad_evals += 1
    if info.is_main:
        record = {"step": state.step, "epoch": state.epoch, "wall": round(state.wall, 3),
                  **resident_fields()}  # fmt: skip
        run.metrics.write({**record, **result})
        shown = ", ".join(f"{k} {v:.4g}" for k, v in result.items())
        log.info("validation at step %d: %s%s", state.step, shown, " (best)" if improved else "")
        if improved:
            save_checkpoint(run.ckpt_dir / "best.pt", checkpoint_of(run, full=False))
    return result


def finish(run: Run, stop: str) -> dict[str, Any]:
    """Final validation, checkpoints and averaging (skipped after a stop signal)."""
    tc, state = run.cfg.train, run.state
    if stop != "signal":
        if state.last_eval_step != state.step and state.step > 0:
            run_validation(run)
        save(run, periodic=not (run.ckpt_dir / f"checkpoint_{state.step}.pt").is_file())
        if tc.average_last > 1 and run.info.is_main:
            average_into_best(run)
        if run.ema is not None and run.info.is_main:
            ema_into_best(run)
        distributed.barrier()
    else:
        save(run, periodic=False)
        if run.info.is_main:  # for a requeue script that cannot see the exit status (torchrun)
            write_json(run.run_dir / PREEMPTED, {"step": state.step, "signal": run.stop.name})
    budget = {"max_steps": tc.max_steps, "max_minutes": tc.max_minutes,
              "max_epochs": tc.max_epochs, "patience": tc.patience}  # fmt: skip
    run.metrics.write({
        "stage": "train", "seconds": round(state.wall, 3), "step": state.step, "stop": stop,
        "budget": budget, "precision": tc.precision, "machine": machine(run.info.device),
        "selection": selection_record(run),
    })  # fmt: skip
    return {
        "step": state.step,
        "epoch": state.epoch,
        "stop": stop,
        "signal": run.stop.signum if stop == "signal" else None,
        "best": state.best,
        "metric": run.key,
        "run_dir": str(run.run_dir),
    }


def selection_record(run: Run) -> dict[str, Any]:
    """What chose ``best.pt``, for the run's record (``report.md`` states it): the validation
    value (``metric``, ``better``: higher or lower) and the search that decoded the valid set
    (``search``; None without ``train.eval_bleu``, which decodes nothing)."""
    return {
        "metric": run.key,
        "better": "higher" if run.key in HIGHER_IS_BETTER else "lower",
        "search": describe_search(run.cfg) if run.cfg.train.eval_bleu else None,
        "valid_beam": run.cfg.train.valid_beam,
    }


def _apply_cooldown(run: Run) -> float:
    """Set the rate of the coming update, the Noam one times the cool-down factor (the
    scheduler recomputes the plain Noam rate after each update); returns it. The progress is
    the same on every rank: :func:`_limits` makes ``state.wall`` agree."""
    tc, optimizer = run.cfg.train, run.update.optimizer
    if tc.cooldown > 0:
        factor = cooldown_factor(budget_progress(tc, run.state), tc.cooldown)
        for group, noam in zip(optimizer.param_groups, run.update.scheduler.get_last_lr()):
            group["lr"] = noam * factor
    return optimizer.param_groups[0]["lr"]


def _limits(run: Run) -> Optional[str]:
    """Why training should stop now, agreed by every rank (None: go on)."""
    tc, state = run.cfg.train, run.state
    if tc.max_steps > 0 and state.step >= tc.max_steps:
        return "max_steps"
    if tc.max_epochs > 0 and state.epoch >= tc.max_epochs:
        return "max_epochs"
    if tc.patience > 0 and state.bad_evals >= tc.patience:
        log.info("no improvement in %d validations: early stop", state.bad_evals)
        return "patience"
    # One collective: a stop signal seen by any rank, and one training time for all ranks
    # (the slowest rank's), which the time limit and the cool-down then read alike. It runs on
    # the host (gloo, see mt.distributed), so it never waits for the GPU's queued work.
    signal_seen, state.wall = distributed.max_over_ranks(
        [1.0 if run.stop.signum is not None else 0.0, state.wall]
    )
    if signal_seen:
        return "signal"
    if tc.max_minutes > 0 and state.wall >= tc.max_minutes * 60:
        return "max_minutes"
    return None


def _groups(batches, n: int):
    """Consecutive groups of ``n`` batches (the last one may be shorter): one update each."""
    batches = iter(batches)
    while group := list(itertools.islice(batches, n)):
        yield group
