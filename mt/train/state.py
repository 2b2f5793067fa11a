"""Where a training run stands, and what must hold for it to go on: one home for run state.

:class:`TrainState` and what a checkpoint of the run holds, RNG states included (a resumed run
draws what the uninterrupted did); each epoch's batch plan; which checkpoint resumes a run
directory, agreed by every rank, and the checks a resume makes; which validation value decides
``best.pt`` and patience; and the run's ``config.yaml`` (:func:`record_config`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import random
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

from mt import distributed
from mt.checkpoint import (
    CheckpointError,
    load_checkpoint,
    model_cfg_from,
    model_state,
    periodic_checkpoints,
    tokenizer_blobs,
)
from mt.config import flatten_keys, to_yaml
from mt.data.batches import BatchSampler
from mt.data.mixing import train_mix, train_specs
from mt.files import write_text
from mt.schema import Config

log = logging.getLogger(__name__)


@dataclass
class TrainState:
    """Where training stands; saved in every checkpoint and restored on resume."""

    step: int = 0  # optimiser updates applied
    epoch: int = 0  # current epoch (0-based)
    batch: int = 0  # index of the next batch within the epoch (exact resume)
    best: Optional[float] = None  # best validation metric so far
    best_step: int = 0
    bad_evals: int = 0  # validations without improvement (patience)
    last_eval_step: int = -1
    wall: float = 0.0  # seconds spent training, over all restarts
    nonfinite: int = 0  # consecutive skipped updates
    # train.reset as applied, oldest first: {"step": the resumed step, "parts": [names]}
    resets: list = field(default_factory=list)


def data_plan(cfg: Config, world_size: int) -> dict[str, Any]:
    """What decides the order of batches in an epoch (besides the data): a checkpoint's
    position in an epoch (``data.batch``) only means something under the same plan."""
    tc = cfg.train
    max_len = cfg.model.max_positions - 1 if tc.skip_long else None
    plan = {"world_size": world_size, "max_tokens": tc.max_tokens, "seed": tc.seed,
            "max_len": max_len}  # fmt: skip
    if world_size * tc.accum_steps > 1:  # batches grouped per update (absent before: 1)
        plan["group"] = world_size * tc.accum_steps
    if tc.shape_buckets:  # absent when off
        plan["shape_buckets"] = [tc.shape_buckets, max(1, tc.pad_multiple)]
    specs = train_specs(cfg.data)
    if cfg.data.corpus_temperature != 1.0 or any(s.weight != 1.0 for s in specs):
        plan["mix"] = [[s.name, s.weight] for s in specs]  # absent when every weight is 1
        plan["temperature"] = cfg.data.corpus_temperature
    if cfg.tokenizer.sampling_alpha:  # each epoch reads its own sampled encoding
        plan["sampling"] = [cfg.tokenizer.sampling_alpha, cfg.tokenizer.sampled_copies]
    return plan


def check_data_plan(ckpt: dict, cfg: Config, world_size: int, path: Path) -> None:
    """Refuse to resume in the middle of an epoch under another batch plan.

    The stored batch index counts this rank's batches of the epoch plan that the world size,
    ``train.max_tokens``, the seed and the length limit made; under another plan it would point
    at other pairs (some skipped, some repeated). At an epoch boundary (index 0) any plan is
    fine: the next epoch starts from its beginning. The error says what differs.
    """
    data = ckpt.get("data", {})
    stored = data.get("plan")
    now = data_plan(cfg, world_size)
    if stored is None or dict(stored) == now:
        return
    diff = _differences(dict(stored), now)
    if int(data.get("batch", 0)) == 0:
        log.info("batch plan changed at an epoch boundary (stored, now): %s", diff)
        return
    names = {"world_size": "number of ranks (torchrun --nproc_per_node x nodes)",
             "max_tokens": "train.max_tokens", "seed": "train.seed",
             "max_len": "model.max_positions / train.skip_long",
             "group": "batches per update (ranks x train.accum_steps)",
             "shape_buckets": "[train.shape_buckets, train.pad_multiple]",
             "mix": "corpus weights (data.splits.train)",
             "temperature": "data.corpus_temperature",
             "sampling": "[tokenizer.sampling_alpha, tokenizer.sampled_copies]"}  # fmt: skip
    shown = "; ".join(
        f"{names.get(k, k)}: {a} in the checkpoint, {b} now" for k, (a, b) in diff.items()
    )
    raise CheckpointError(
        f"{path} stopped in the middle of epoch {data.get('epoch')} (batch {data.get('batch')}) "
        f"under another batch plan ({shown}). Resuming would skip or repeat pairs: resume with "
        "the original settings (they may change at the next epoch boundary), or start a new run "
        "from these weights with train.init_from"
    )


def train_sampler(
    split, cfg: Config, rank: int = 0, world_size: int = 1, corpus_sizes: list[int] | None = None
) -> BatchSampler:
    """The training batches of ``split`` for this rank: ``train.max_tokens``, the run's seed,
    pairs beyond the positional range skipped when ``train.skip_long``, the batches of one
    update (ranks x ``train.accum_steps``) of similar lengths, and the corpora at their weights
    (``corpus_sizes``: the prepared pairs of each, ``Prepared.corpus_sizes``)."""
    tc = cfg.train
    return BatchSampler(
        split.src.lengths, split.tgt.lengths, tc.max_tokens, seed=tc.seed, rank=rank,
        world_size=world_size, max_len=cfg.model.max_positions - 1 if tc.skip_long else None,
        group=world_size * tc.accum_steps, mix=train_mix(cfg.data, corpus_sizes),
        buckets=tc.shape_buckets, multiple=max(1, tc.pad_multiple),
    )  # fmt: skip


class TrainBatches:
    """This rank's training batches, epoch by epoch: the pairs an epoch reads (with
    ``tokenizer.sampling_alpha``, sampled encoding ``epoch`` mod their number,
    ``Prepared.train_split``) and their :func:`train_sampler`, one per encoding."""

    def __init__(self, prepared, cfg: Config, rank: int = 0, world_size: int = 1) -> None:
        self.prepared, self.cfg, self.rank, self.world_size = prepared, cfg, rank, world_size
        self._samplers: dict[int, BatchSampler] = {}
        self._ahead: threading.Thread | None = None

    def plan_ahead(self, epoch: int) -> None:
        """Start making ``epoch``'s batch plan in a background thread: numpy's sorting and
        gathers release the GIL, so the plan of millions of pairs is made on another core while
        the model is set up. :meth:`at` waits for it; a failure is met again there."""

        def plan() -> None:
            with contextlib.suppress(Exception):  # at() makes it again and raises there
                self._at(epoch)[1].batches(epoch)

        self._ahead = threading.Thread(target=plan, name="mt-plan", daemon=True)
        self._ahead.start()

    def at(self, epoch: int) -> tuple[Any, BatchSampler]:
        """``(split, sampler)`` of ``epoch``: ``iterate_batches(split, sampler, epoch)``."""
        if self._ahead is not None:
            self._ahead.join()
            self._ahead = None
        return self._at(epoch)

    def _at(self, epoch: int) -> tuple[Any, BatchSampler]:
        split = self.prepared.train_split(epoch)  # one object per encoding (Prepared caches)
        if id(split) not in self._samplers:
            self._samplers[id(split)] = train_sampler(
                split, self.cfg, self.rank, self.world_size, self.prepared.corpus_sizes()
            )
        return split, self._samplers[id(split)]


def check_compatible(
    ckpt: dict, cfg: Config, vocab_size: int, path: Path, tokenizer_bytes: list[bytes] | None = None
) -> None:
    """Raise CheckpointError unless ``ckpt``'s model fits ``cfg.model`` and the vocabulary.

    With ``tokenizer_bytes`` (the prepared data's SentencePiece model(s)), the checkpoint's
    embedded model(s) must be byte-identical: the same vocabulary size with other pieces would
    silently give every embedding row a different meaning.
    """
    if int(ckpt["vocab_size"]) != vocab_size:
        raise CheckpointError(
            f"{path} has a vocabulary of {ckpt['vocab_size']}, the prepared data {vocab_size}"
        )
    if tokenizer_bytes is not None and tokenizer_blobs(ckpt) != list(tokenizer_bytes):
        raise CheckpointError(
            f"{path} was trained with a different SentencePiece model than the prepared data "
            f"(same vocabulary size {vocab_size}, other pieces): its embeddings would map to "
            f"the wrong pieces. Prepare the data with tokenizer.reuse={path} to encode it with "
            f"the checkpoint's own model"
        )
    stored, now = dataclasses.asdict(model_cfg_from(ckpt)), dataclasses.asdict(cfg.model)
    shape = ("N", "N_dec", "d_model", "d_ff", "h", "norm", "share_embeddings")
    diff = _differences(stored, now, shape)
    if diff:
        raise CheckpointError(f"{path} holds a different model shape (stored, config): {diff}")
    if stored != now:
        log.info("model settings differ from %s (dropout etc.): using the configuration", path)


def seed_everything(seed: int) -> None:
    """Seed python, numpy and torch (all devices)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


BEST_METRICS = ("bleu", "chrf", "loss")  # train.best_metric's values
HIGHER_IS_BETTER = {"valid_bleu", "valid_chrf"}  # the others (the loss): lower is better


def metric_key(cfg: Config) -> str:
    """The validation record key that decides best.pt and patience: ``valid_bleu``,
    ``valid_chrf`` or ``valid_loss`` (``train.best_metric=bleu`` without ``train.eval_bleu``,
    which decodes nothing: the loss)."""
    tc = cfg.train
    if tc.best_metric not in BEST_METRICS:
        raise ValueError(f"train.best_metric must be bleu, chrf or loss, got {tc.best_metric!r}")
    if tc.best_metric == "chrf" and not tc.eval_bleu:
        raise ValueError(
            "train.best_metric=chrf needs train.eval_bleu=true (validation decodes to score chrF)"
        )
    if tc.best_metric in ("bleu", "chrf") and tc.eval_bleu:
        return f"valid_{tc.best_metric}"
    return "valid_loss"


def better(key: str, new: float, old: Optional[float]) -> bool:
    """Is ``new`` an improvement on ``old`` (higher BLEU or chrF, lower loss)?"""
    if old is None:
        return True
    return new > old if key in HIGHER_IS_BETTER else new < old


def rng_state() -> dict[str, Any]:
    """Every RNG state (python, numpy, torch, cuda) as tensors, lists and numbers."""
    version, internal, gauss = random.getstate()
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    return {
        "python": [version, list(internal), gauss],
        "numpy": [
            np_name,
            torch.from_numpy(np_keys.astype(np.int64)),
            int(np_pos),
            int(np_has_gauss),
            float(np_gauss),
        ],
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`rng_state` captured."""
    version, internal, gauss = state["python"]
    random.setstate((int(version), tuple(int(x) for x in internal), gauss))
    name, keys, pos, has_gauss, gauss_np = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, gauss_np))
    torch.set_rng_state(state["torch"].cpu())
    cuda = state.get("cuda") or []
    if cuda and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all([t.cpu() for t in cuda])


def has_checkpoints(ckpt_dir: Path) -> bool:
    return (ckpt_dir / "last.pt").is_file() or bool(periodic_checkpoints(ckpt_dir))


def resume_checkpoint(ckpt_dir: Path) -> tuple[Optional[dict], Optional[Path]]:
    """The training state to resume: ``last.pt``, or when it is unreadable the newest readable
    periodic checkpoint that holds a training state (with a warning naming both):
    ``(checkpoint, path)``, ``(None, None)`` for a new run; CheckpointError when checkpoints
    exist but none of them can resume the run.
    """
    last = ckpt_dir / "last.pt"
    candidates = ([last] if last.is_file() else []) + periodic_checkpoints(ckpt_dir)[::-1]
    errors = []
    for path in candidates:
        try:
            ckpt = load_checkpoint(path, require_training=True)
        except CheckpointError as err:
            errors.append(str(err))
            continue
        if path != last:
            log.warning(
                "%s: resuming from %s (step %d) instead: %s", last, path.name, ckpt["step"],
                errors[0] if errors else "last.pt is missing",
            )  # fmt: skip
        return ckpt, path
    if candidates:
        raise CheckpointError(
            f"no checkpoint in {ckpt_dir} can resume the run: " + " | ".join(errors)
        )
    return None, None


def agree_on_resume(ckpt_dir: Path, is_main: bool) -> tuple[Optional[dict], Optional[Path]]:
    """:func:`resume_checkpoint` decided by rank 0 and checked by every rank.

    Rank 0 chooses (as in a single process) and broadcasts the file name and step; each other
    rank loads that file from its own ``ckpt_dir`` and checks the step (or, for a new run, that
    it sees no checkpoint either). A rank that disagrees raises CheckpointError (its own
    reason), the others ``mt.distributed.RankError`` with that reason.
    """
    ckpt, path, error = None, None, None

    def choose():  # rank 0, as in a single process
        nonlocal ckpt, path
        ckpt, path = resume_checkpoint(ckpt_dir)
        return None if ckpt is None else (path.name, ckpt["step"])

    choice = distributed.decide_on_rank0(choose, f"choosing the checkpoint to resume in {ckpt_dir}")
    if not is_main:
        try:
            ckpt, path = _load_choice(ckpt_dir, choice)
        except CheckpointError as err:
            error = err
    distributed.check_all(error, f"agreeing with rank 0 on the checkpoint in {ckpt_dir}")
    return ckpt, path


def _load_choice(ckpt_dir: Path, choice) -> tuple[Optional[dict], Optional[Path]]:
    """Load rank 0's choice ``(file name, step)`` (None: a new run) from this rank's view."""
    shared = "run_dir must be one directory that every rank sees (a shared filesystem)"
    if choice is None:
        if has_checkpoints(ckpt_dir):
            raise CheckpointError(
                f"rank 0 starts a new run, but this rank sees checkpoints in {ckpt_dir}: {shared}"
            )
        return None, None
    name, step = choice
    path = ckpt_dir / name
    try:
        ckpt = load_checkpoint(path, require_training=True)
    except CheckpointError as err:
        raise CheckpointError(
            f"rank 0 resumes {name} (step {step}), but this rank cannot read it: {err}. {shared}"
        ) from err
    if ckpt["step"] != step:
        raise CheckpointError(
            f"rank 0 resumes {name} at step {step}, but this rank reads step {ckpt['step']} "
            f"from {path}: {shared}"
        )
    return ckpt, path


def keep_best_of_best_pt(state: TrainState, best_path: Path, key: str) -> None:
    """After a resume, ``state.best`` is as old as the resumed checkpoint; ``best.pt`` may hold
    a better model saved after it. Take that value, so best.pt is only replaced by better."""
    if not best_path.is_file():
        return
    try:
        best = load_checkpoint(best_path)
    except CheckpointError as err:
        log.warning("%s is unreadable (%s); the next validation replaces it", best_path, err)
        return
    value = best.get("best")
    if best.get("best_metric") != key or value is None:
        return
    if better(key, value, state.best):
        log.info("best.pt (step %s) holds %s %.4g, better than the resumed state's %s",
                 best.get("step"), key, value, state.best)  # fmt: skip
        state.best, state.best_step = float(value), int(best.get("step", 0))


def record_config(run_dir: Path, cfg: Config, resuming: bool) -> None:
    """``config.yaml`` holds a run's original configuration. A new run writes it; a resumed
    run keeps it, and when its own configuration differs writes that to
    ``config.resume-<n>.yaml`` and logs each changed key."""
    text = to_yaml(cfg)
    path = run_dir / "config.yaml"
    if not resuming or not path.is_file():
        write_text(path, text)
        return
    original = path.read_bytes().decode("utf-8", errors="replace")
    if original == text:
        return
    n = 1 + sum(1 for _ in run_dir.glob("config.resume-*.yaml"))
    write_text(run_dir / f"config.resume-{n}.yaml", text)
    changes = _changed_keys(original, text)
    log.warning(
        "resuming with a different configuration (kept in config.resume-%d.yaml; config.yaml "
        "keeps the original): %s", n, "; ".join(changes) or "formatting only",
    )  # fmt: skip


def _changed_keys(old: str, new: str) -> list[str]:
    """``key: old -> new`` for each leaf that differs between two YAML configurations."""
    import yaml

    try:
        a, b = (flatten_keys(yaml.safe_load(text) or {}) for text in (old, new))
    except yaml.YAMLError:
        return ["config.yaml is not valid YAML"]
    return [f"{k}: {x!r} -> {y!r}" for k, (x, y) in _differences(a, b).items()]


def training_state(
    raw_model, prepared, cfg: Config, state: TrainState, optimizer, scheduler, scaler, full: bool,
    world_size: int = 1, ema=None,
) -> dict[str, Any]:  # fmt: skip
    """A checkpoint dict: the self-describing model part, plus training state when ``full``
    (and ``ema``'s average, a :class:`mt.train.ema.WeightEMA`). With ``full`` every rank must
    call this (the RNG states of all ranks are gathered)."""
    ckpt = model_state(raw_model, cfg.model, prepared.tokenizer, prepared.vocab_size)
    ckpt.update(step=state.step, epoch=state.epoch, best=state.best, best_metric=metric_key(cfg),
                data_summary=data_summary(prepared))  # fmt: skip
    if full:
        ckpt.update(
            optimizer=optimizer.state_dict(),
            scheduler=scheduler.state_dict(),
            scaler=scaler.state_dict(),
            rng=distributed.all_gather_object(rng_state()),
            data={"epoch": state.epoch, "batch": state.batch, "plan": data_plan(cfg, world_size)},
            train_cfg=dataclasses.asdict(cfg.train),
            state=dataclasses.asdict(state),
        )
        if ema is not None:
            ckpt["ema"] = ema.state_dict()
    return ckpt


def data_summary(prepared) -> dict[str, Any]:
    """What the data was, from the prepared data's ``meta.json``, for the model card
    (:mod:`mt.export.card`): kept in every checkpoint, so an exported model can say what it
    was trained on wherever the checkpoint is copied. Names and counts, never local paths."""
    meta = getattr(prepared, "meta", None) or {}
    data, counts = meta.get("data") or {}, meta.get("counts") or {}
    source, directory = data.get("source"), data.get("dir")
    local = source == "local" or (source == "auto" and bool(directory) and Path(directory).is_dir())
    splits = data.get("splits") or {}
    train = counts.get("train") or {}
    return {
        "name": data.get("name"),
        "src_lang": data.get("src_lang"),
        "tgt_lang": data.get("tgt_lang"),
        "source": "local" if local else "hub",
        "hf_path": None if local else data.get("hf_path"),
        "hf_name": None if local else data.get("hf_name"),
        # the commit the hub dataset resolved to (meta.json), else the one asked for
        "revision": None if local else meta.get("revision") or data.get("revision"),
        "local_dir": Path(directory).name if local and directory else None,
        "corpora": [
            {"name": str(c.get("name")), "pairs": int(c.get("pairs", 0))}
            for c in train.get("corpora") or []
        ],
        "read": (train.get("clean") or {}).get("read"),
        "pairs": {r: (counts.get(r) or {}).get("pairs") for r in ("train", "valid", "test")},
        "splits": {role: str(splits.get(role)) for role in ("valid", "test")},
        "max_train_pairs": data.get("max_train_pairs"),
    }


RESETS = ("optimizer", "schedule", "meters", "data")
# the train settings behind Adam's param groups (mt.train.update.adam_settings)
OPTIMIZER_KEYS = ("beta1", "beta2", "eps", "weight_decay", "decoupled_weight_decay")
SCHEDULE_KEYS = ("lr", "factor", "warmup", "cooldown", "max_steps", "max_minutes")


def resets_to_apply(tc, resume: Optional[dict], path: Optional[Path]) -> list[str]:
    """The parts of ``train.reset`` (names from :data:`RESETS`) to start afresh now.

    A reset is an instruction for one resume, but a requeued job repeats its command line: a
    resume whose ``train.reset`` is the list the checkpoint's own run was started with (its
    ``train_cfg``) applies nothing, since that run applied it (or was a new run, with nothing
    to reset) and what it saved already holds the effect. Another list is applied, and so is
    the same one with ``train.reset_again=true``. Logged either way.
    """
    names = [str(n) for n in (tc.reset or [])]
    unknown = [n for n in names if n not in RESETS]
    if unknown:
        raise ValueError(f"train.reset: unknown {unknown}; choose from {list(RESETS)}")
    if resume is None or not names:
        return names
    stored = [str(n) for n in (resume.get("train_cfg") or {}).get("reset") or []]
    if tc.reset_again or set(stored) != set(names):
        return names
    applied = (resume.get("state") or {}).get("resets") or []
    done = [r["step"] for r in applied if set(r["parts"]) == set(names)]
    when = f"applied at step {done[-1]}" if done else "applied when it started, or a new run"
    log.info(
        "train.reset=[%s]: not applied again: %s was saved by a run started with the same list "
        "(%s); train.reset_again=true applies it on this start too",
        ",".join(names), path.name if path else "the checkpoint", when,
    )  # fmt: skip
    return []


def changed_settings(stored: dict, cfg: Config, keys: tuple[str, ...]) -> dict[str, tuple]:
    """``{key: (in the checkpoint, now)}`` for the train settings ``keys`` that differ."""
    return _differences(stored, dataclasses.asdict(cfg.train), [k for k in keys if k in stored])


def _differences(old: dict, new: dict, keys=None) -> dict[str, tuple]:
    """``{key: (old value, new value)}`` for each of ``keys`` (default: every key of either,
    sorted) whose values differ."""
    keys = sorted(set(old) | set(new)) if keys is None else keys
    return {k: (old.get(k), new.get(k)) for k in keys if old.get(k) != new.get(k)}
