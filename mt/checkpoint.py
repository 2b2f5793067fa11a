"""Checkpoints: self-describing, atomically written, loadable with ``weights_only=True``.

A checkpoint is a plain dict of tensors, numbers, strings, lists and dicts (no pickled objects),
so ``torch.load(weights_only=True)`` reads it. The keys:

- ``model`` (state_dict of the unwrapped, uncompiled model), ``model_cfg`` (ModelConfig fields),
  ``vocab_size``, ``specials`` ({pad, unk, bos, eos}), ``tokenizer`` ({"joint": bool, "models":
  list of uint8 tensors}), ``step``, ``epoch``: everything decoding needs.
- training state adds ``optimizer``, ``scheduler``, ``scaler``, ``rng`` (``mt.train.state``),
  ``data`` ({epoch, batch}), ``train_cfg``, ``best``, and with ``train.ema`` the moving
  average of the weights, ``ema`` ({decay, updates, weights}, ``mt.train.ema``).

Writes are atomic (:mod:`mt.files`): a crash mid-save leaves the previous file intact. Loading
checks the CRC-32 of every record of the zip container first, so a damaged byte is an error
naming the file, never a silently wrong weight.
"""

from __future__ import annotations

import copy
import logging
import os
import re
import zipfile
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any

import torch

from mt.files import atomic_path, fsync_dir, temp_path
from mt.schema import ModelConfig
from mt.vocab import SPECIALS

log = logging.getLogger(__name__)

MODEL_KEYS = ("model", "model_cfg", "vocab_size", "specials", "tokenizer", "step")
TRAINING_KEYS = ("optimizer", "scheduler", "rng", "data")
PERIODIC = re.compile(r"^checkpoint_(\d+)\.pt$")


class CheckpointError(RuntimeError):
    """A file that is not a usable mt checkpoint (missing, truncated, wrong format, mismatch)."""


def save_checkpoint(path: str | Path, state: dict[str, Any]) -> None:
    """Write ``state`` to ``path`` atomically (:func:`mt.files.atomic_path`: a full disk is an
    ``OSError(ENOSPC)`` saying so, the previous file kept)."""
    atomic_path(path, lambda f: torch.save(state, f))


def link_checkpoint(source: str | Path, path: str | Path) -> None:
    """Make ``path`` the same file as ``source`` (a hard link, atomically replacing ``path``):
    a periodic checkpoint costs no second write when it equals the ``last.pt`` just saved.
    Where hard links are not allowed, the file is copied (still atomically)."""
    source, path = Path(source), Path(path)
    tmp = temp_path(path)
    tmp.unlink(missing_ok=True)
    try:
        os.link(source, tmp)
    except OSError:
        import shutil

        with open(source, "rb") as src:
            atomic_path(path, lambda f: shutil.copyfileobj(src, f, 1 << 24))
        return
    os.replace(tmp, path)
    fsync_dir(path.parent)


def verify_file(path: Path) -> None:
    """Check the CRC-32 of every record of a checkpoint's zip container (torch writes them but
    does not check them on load, so a flipped byte in a tensor would load as a wrong weight)."""
    try:
        with zipfile.ZipFile(path) as z:
            bad = z.testzip()
    except (zipfile.BadZipFile, OSError, EOFError) as e:
        raise CheckpointError(
            f"{path} is not a readable mt checkpoint (not a torch zip file, or truncated): {e}"
        ) from None
    if bad is not None:
        raise CheckpointError(
            f"{path} is corrupted: the bytes of {bad!r} do not match their checksum (a damaged "
            "disk or copy); use another checkpoint"
        )


def load_checkpoint(
    path: str | Path,
    map_location: str | torch.device = "cpu",
    require_training: bool = False,
    mmap: bool = False,
) -> dict[str, Any]:
    """Read a checkpoint with ``torch.load(weights_only=True)`` and check its keys (with
    ``require_training``, the training state's too: resume) and special ids; a
    :class:`CheckpointError` names what is wrong. ``mmap``: map the file instead of reading it
    into the heap, so what is never used (an optimizer state) is never read."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"no checkpoint at {path}")
    verify_file(path)
    try:
        ckpt = torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except Exception as e:  # torch raises many types for garbage (KeyError, EOFError, ...)
        raise CheckpointError(
            f"{path} is not a readable mt checkpoint (not a torch file, truncated, or written "
            f"with pickled objects): {type(e).__name__}: {str(e).splitlines()[0][:200]}"
        ) from e
    if not isinstance(ckpt, dict):
        raise CheckpointError(f"{path} holds a {type(ckpt).__name__}, not a checkpoint dict")
    required = MODEL_KEYS + (TRAINING_KEYS if require_training else ())
    missing = [k for k in required if k not in ckpt]
    if missing:
        raise CheckpointError(f"{path} is missing checkpoint keys {missing}")
    if dict(ckpt["specials"]) != SPECIALS:
        raise CheckpointError(
            f"{path} was written with special ids {dict(ckpt['specials'])}, but this code uses "
            f"{SPECIALS}: the model and the vocabulary would disagree"
        )
    return ckpt


def model_cfg_from(ckpt: dict[str, Any]) -> ModelConfig:
    """The ModelConfig stored in a checkpoint (unknown keys from other versions are ignored)."""
    known = {f.name for f in fields(ModelConfig)}
    return ModelConfig(**{k: v for k, v in ckpt["model_cfg"].items() if k in known})


def load_model(path: str | Path, device: str | torch.device = "cpu"):
    """``(model, tokenizer, ckpt)`` of a checkpoint: the model it describes in eval mode on
    ``device``, the ``mt.data.tokenizer.Tokenizer`` embedded in it, and the checkpoint dict."""
    from mt.data.tokenizer import Tokenizer
    from mt.model.transformer import build_model

    ckpt = load_checkpoint(path, map_location="cpu")
    model = build_model(model_cfg_from(ckpt), int(ckpt["vocab_size"]))
    try:
        model.load_state_dict(ckpt["model"])
    except RuntimeError as e:
        raise CheckpointError(f"{path}: weights do not fit the stored model config: {e}") from e
    tokenizer = Tokenizer.from_bytes(tokenizer_blobs(ckpt))
    return model.to(device).eval(), tokenizer, ckpt


def model_state(model: torch.nn.Module, model_cfg: ModelConfig, tokenizer, vocab_size: int):
    """The parts of a checkpoint that decoding needs, of the unwrapped, uncompiled ``model``
    (``step``/``epoch`` added by the caller)."""
    return {
        "model": model.state_dict(),
        "model_cfg": asdict(model_cfg),
        "vocab_size": int(vocab_size),
        "specials": dict(SPECIALS),
        "tokenizer": {
            "joint": bool(tokenizer.joint),
            "models": [
                torch.frombuffer(bytearray(b), dtype=torch.uint8) for b in tokenizer.to_bytes()
            ],
        },
    }


def tokenizer_blobs(ckpt: dict[str, Any]) -> list[bytes]:
    """The serialized SentencePiece model(s) stored in a checkpoint, in their canonical form
    (``mt.data.tokenizer.canonical_model``: what compares with a prepared tokenizer)."""
    from mt.data.tokenizer import canonical_model

    return [canonical_model(t.numpy().tobytes()) for t in ckpt["tokenizer"]["models"]]


def periodic_checkpoints(directory: str | Path) -> list[Path]:
    """The ``checkpoint_<step>.pt`` files of a directory, oldest (lowest step) first."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in directory.iterdir() if (m := PERIODIC.match(p.name))]
    return [p for _, p in sorted(found)]


def rotate_checkpoints(directory: str | Path, keep_last: int) -> list[Path]:
    """Delete all but the newest ``keep_last`` periodic checkpoints; returns the deleted paths."""
    if keep_last <= 0:
        return []
    old = periodic_checkpoints(directory)[:-keep_last]
    for p in old:
        p.unlink(missing_ok=True)
    return old


def average_checkpoints(
    paths: list[str | Path], into: dict[str, torch.Tensor] | None = None
) -> dict[str, Any]:
    """The element-wise mean of the models' parameters (the paper averages the last 5 or 20).

    Floating-point tensors are averaged in float64 and cast back, or, with ``into`` (a model's
    ``state_dict()``: no second copy of the weights), summed in its own tensors (float32: 5
    terms lose well under a unit in the last place), which become the result's ``model`` and
    may hold a partial sum after an error. Integer buffers are the last checkpoint's. The
    result carries the last checkpoint's description but no training state, and an
    ``averaged`` list naming its inputs. Different parameter names or shapes: CheckpointError.
    """
    if not paths:
        raise CheckpointError("no checkpoints to average")
    total: dict[str, torch.Tensor] = {}
    dtypes: dict[str, torch.dtype] = {}
    out: dict[str, Any] = {}
    for i, path in enumerate(paths):
        # Mapped, not read: whole checkpoints (Adam's state included) read into the heap of a
        # training process, which keeps freed memory, raised its peak at the end of the run;
        # mapped, only the weights are read, a fraction of the file. One file at a time: the
        # pages read from a mapping count as the process's resident memory until it is released.
        ckpt = load_checkpoint(path, mmap=True)
        weights = ckpt["model"]
        reference = total if i > 0 else into  # names and shapes every file must have
        if reference is not None and weights.keys() != reference.keys():
            against = paths[0] if i > 0 else "the model averaged into"
            raise CheckpointError(f"{path} holds different parameters from {against}")
        for k, v in weights.items():
            if reference is not None and v.shape != reference[k].shape:
                raise CheckpointError(
                    f"{path}: {k} has shape {tuple(v.shape)}, not {tuple(reference[k].shape)}"
                )
            if i == 0 or not v.is_floating_point():  # integers: the last checkpoint's
                if into is not None:
                    total[k] = into[k].copy_(v)
                else:  # not the file's storage; float sums in float64
                    total[k] = v.double() if v.is_floating_point() else v.clone()
            else:  # the file is read on the CPU; ``into`` may be a GPU model's
                total[k].add_(v.to(total[k].device))
            dtypes[k] = into[k].dtype if into is not None else v.dtype
        if i == len(paths) - 1:
            keep = {*MODEL_KEYS, "epoch", "train_cfg", "data_summary"} - {"model"}  # not weights
            # copied out of the mapped file: one tensor left in it keeps its whole mapping, and
            # the pages read from it, resident
            out = copy.deepcopy({k: v for k, v in ckpt.items() if k in keep})
        ckpt = weights = v = None  # the mapping goes before the next file is mapped
    n = len(paths)
    out["model"] = {}
    for k in list(total):  # each float64 sum goes once its mean is cast
        t = total.pop(k)  # (.to of a sum in ``into``: its own tensor, no copy)
        out["model"][k] = t.div_(n).to(dtypes[k]) if t.is_floating_point() else t
    out["averaged"] = [str(p) for p in paths]
    return out
