"""Which engine decodes a request: mt's torch search or CTranslate2 (``engine=auto|torch|
ctranslate2``, the ``translate.*``, ``serve.*`` and ``score.*`` settings of mt.schema.EngineConfig).

:func:`choose` is the whole decision, a pure function of the settings, the request, the device
and whether ``ctranslate2`` imports, so it is tested alone. ``auto`` takes CTranslate2 wherever
it can run the request as mt's search would, torch otherwise; ``ctranslate2`` refuses (an
:class:`EngineError` naming the setting) what CTranslate2 cannot run. What only torch runs:

* an ensemble (CTranslate2 decodes one model);
* a model the exporter cannot express (mt.export.hf.check_exportable: pre-LN, two tokenizers);
* beam search with a target prefix: CTranslate2 leaves the forced tokens' log-probabilities out
  of a hypothesis' score and lets only the best beam end right after the prefix, so its beam
  can pick another hypothesis than mt's (greedy search with a prefix is the same on both);
* under ``auto``, sampling: mt seeds each sentence's draw by its line, so a sample does not
  depend on the batching; CTranslate2 draws from a generator per thread, seeded once per
  process (``engine=ctranslate2`` samples with it: the same distribution, other draws).

On a GPU CTranslate2 runs on ``cuda`` with a GPU compute type and torch stays on the GPU: no
choice here leads a CUDA device to CPU-only code.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

ENGINES = ("auto", "torch", "ctranslate2")
CPU_TYPES = ("float32", "int8", "int8_float32")
GPU_TYPES = CPU_TYPES + ("int8_float16", "float16")
# compute_type=auto: float32 on a CPU, where CTranslate2 finds the torch search's translations,
# so what mt-translate writes is what mt-evaluate scored; int8 is about twice as fast there but
# changes a translation in 16 and moves BLEU (docs/benchmarks/ct2-engine-cpu-zen4-2026-12.md),
# a choice left to the user. float16 on a GPU, where its tensor cores pay for it.
AUTO_TYPE = {"cpu": "float32", "cuda": "float16"}


class EngineError(ValueError):
    """A setting the chosen engine cannot run (the message names the setting)."""


@dataclass(frozen=True)
class Choice:
    """An engine for a request: ``torch`` or ``ctranslate2``, why (the log line), and
    CTranslate2's device (``cpu`` or ``cuda``), device index and compute type."""

    engine: str
    reason: str
    device: str = "cpu"
    index: int = 0
    compute_type: str | None = None


def _device(device: Any) -> tuple[str, int]:
    """A torch device ("cpu", "cuda", "cuda:1", torch.device) as CTranslate2's (kind, index)."""
    text = str(device)
    kind, _, index = text.partition(":")
    if kind not in ("cpu", "cuda"):
        raise EngineError(f"CTranslate2 runs on cpu or cuda, not on {text}")
    return kind, int(index or 0)


def compute_type(setting: str, device: str, node: str = "translate") -> str:
    """The compute type ``setting`` names on ``device`` (``cpu`` or ``cuda``): ``auto``'s
    choice, or the setting itself after checking that the device has it."""
    if setting == "auto":
        return AUTO_TYPE[device]
    allowed = GPU_TYPES if device == "cuda" else CPU_TYPES
    if setting not in allowed:
        where = "a GPU" if device == "cuda" else "a CPU"
        raise EngineError(f"{node}.compute_type={setting}: on {where} one of auto, "
                          f"{', '.join(allowed)}")  # fmt: skip
    return setting


def choose(
    engine: str,
    compute: str,
    device: Any,
    ct2_available: bool,
    *,
    beam_size: int = 1,
    sample: bool = False,
    prefix: bool = False,
    ensemble: bool = False,
    model_problem: str | None = None,
    node: str = "translate",
) -> Choice:
    """The engine of one request (see the module docstring).

    ``engine`` and ``compute`` are the ``<node>.engine`` and ``<node>.compute_type`` settings;
    CTranslate2 takes torch's ``device``; ``beam_size``, ``sample``, ``prefix`` (forced
    starts) are the request's search; ``model_problem`` says why the model cannot be converted
    for CTranslate2 (None: it can). Raises EngineError for an unknown setting, or for
    ``engine=ctranslate2`` with what it cannot run.
    """
    if engine not in ENGINES:
        raise EngineError(f"{node}.engine={engine}: expected one of {', '.join(ENGINES)}")
    if engine == "torch":
        return Choice("torch", f"{node}.engine=torch")
    kind, index = _device(device)
    ct2_type = compute_type(compute, kind, node)  # a bad setting fails under auto too
    lacks = None
    if not ct2_available:
        lacks = "ctranslate2 is not installed (pip install mt[export])"
    elif ensemble:
        lacks = "CTranslate2 decodes one model, not an ensemble"
    elif model_problem:
        lacks = f"CTranslate2 cannot express this model ({model_problem})"
    elif prefix and beam_size > 1 and not sample:
        lacks = ("CTranslate2's beam search scores a target prefix otherwise (its tokens' "
                 "log-probabilities left out)")  # fmt: skip
    elif sample and engine == "auto":
        lacks = ("mt seeds each sentence's sample by its line, the same in any batch; "
                 "CTranslate2's draws depend on the batch")  # fmt: skip
    if lacks is not None:
        if engine == "ctranslate2":
            raise EngineError(f"{node}.engine=ctranslate2: {lacks}; use {node}.engine=torch "
                              f"or auto")  # fmt: skip
        return Choice("torch", lacks)
    why = f"{node}.engine={engine}" if engine == "ctranslate2" else "ctranslate2 is installed"
    return Choice("ctranslate2", f"{why}, {ct2_type} on {kind}", kind, index, ct2_type)


@functools.cache
def ct2_available() -> bool:
    try:
        import ctranslate2  # noqa: F401
    except ImportError:
        return False
    return True


def threads(inter: int, intra: int, total: int) -> tuple[int, int]:
    """CTranslate2's (inter_threads, intra_threads) on a CPU: as set, where 0 is auto: as many
    replicas of one thread as ``total`` threads (batches decoded side by side, as mt's
    ``decode.workers``; a decoding step is too small to share among threads well), and the
    threads left per replica."""
    if inter < 0 or intra < 0:
        raise EngineError(f"inter_threads and intra_threads must be >= 0 (0: auto), got "
                          f"{inter} and {intra}")  # fmt: skip
    total = max(1, total)
    inter = inter or (total if not intra else max(1, total // intra))
    intra = intra or max(1, total // inter)
    return inter, intra


@functools.cache
def tell(engine: str, reason: str) -> None:
    """Log a choice once per process (each distinct engine and reason)."""
    log.info("decoding with %s: %s", engine, reason)
