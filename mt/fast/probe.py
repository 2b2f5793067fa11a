"""Speed settings chosen by measuring on the device in hand, not by a CPU flag.

The same AVX512-BF16 flag can mean bf16 well ahead of fp32 on one CPU and behind it on another,
and a CPU without it still runs bf16 (emulated, many times slower). So ``auto`` settings time
each candidate on the work that dominates the run, at the run's shapes (for training, a layer's
products forward and backward, ``mt.fast.precision.layer_step``); the fastest wins and the
figures are logged. A candidate more than :data:`SCREEN_RATIO` times the best at a small size is
ruled out at once (emulated bf16 takes seconds at full size); the rest are timed at the run's
size. The candidates take turns, call by call, and each keeps its median, so a busy moment of a
shared machine slows every candidate alike. Results are cached per machine (CPU model, GPU,
threads) and torch version in ``<cache_dir>/probes.json``, beside the prepared data.
"""

from __future__ import annotations

import json
import logging
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from mt.fast.native import cpu_fields
from mt.files import write_json

log = logging.getLogger(__name__)

_DECIDED: dict[str, str] = {}  # key -> choice, for the life of the process

SCREEN_RATIO = 3.0  # at the small size, a candidate this much slower than the best is out
REPEATS = 3  # timed calls per candidate at each size (after one warm-up call)


def fastest(figures: dict[str, float], allowed: list[str]) -> str:
    """The allowed candidate with the smallest time (ties: the first allowed); one without a
    figure (ruled out) is never chosen."""
    timed = [c for c in allowed if figures.get(c) is not None]
    if not timed:
        return allowed[0]
    return min(timed, key=lambda c: (figures[c], allowed.index(c)))


def measure(
    make: Callable[[str, int], Callable[[], object]],
    candidates: list[str],
    size: int,
    screen_size: int,
    sync=None,
) -> dict[str, float | None]:
    """Seconds per call of each candidate at ``size`` (None: ruled out at ``screen_size``);
    ``make(candidate, size)`` returns the call to time (its inputs built outside the timing)."""
    screen = in_turns({c: make(c, screen_size) for c in candidates}, REPEATS, sync)
    best = min(screen.values())
    kept = [c for c in candidates if screen[c] <= SCREEN_RATIO * best]
    full = in_turns({c: make(c, size) for c in kept}, REPEATS, sync)
    return {c: full.get(c) for c in candidates}


def in_turns(calls: dict[str, Callable[[], object]], repeats: int, sync=None) -> dict[str, float]:
    """Median seconds of each call, the calls taking turns: one warm-up call each, then
    ``repeats`` rounds of one timed call each."""
    sync = sync or (lambda: None)
    for fn in calls.values():
        fn()
    times: dict[str, list[float]] = {c: [] for c in calls}
    for _ in range(repeats):
        for c, fn in calls.items():
            sync()
            start = time.perf_counter()
            fn()
            sync()
            times[c].append(time.perf_counter() - start)
    return {c: statistics.median(t) for c, t in times.items()}


def cpu_model() -> str:
    """The CPU's model name (``lscpu``'s), from /proc/cpuinfo; the platform's otherwise."""
    import platform

    return cpu_fields().get("model name") or platform.processor() or platform.machine()


def _machine_key(device: torch.device) -> str:
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_model()
    return f"{device.type}|{where}|threads={torch.get_num_threads()}|torch={torch.__version__}"


class ProbeCache:
    """``<cache_dir>/probes.json``: ``{key: {"choice", "figures"}}`` (None: no cache)."""

    def __init__(self, cache_dir: str | Path | None) -> None:
        self.path = Path(cache_dir) / "probes.json" if cache_dir else None

    def _read(self) -> dict:
        if self.path is None or not self.path.is_file():
            return {}
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    def get(self, key: str) -> dict | None:
        entry = self._read().get(key)
        return entry if isinstance(entry, dict) and "choice" in entry else None

    def put(self, key: str, entry: dict) -> None:
        if self.path is None:
            return
        data = self._read()
        data[key] = entry
        try:
            write_json(self.path, data)
        except OSError as err:  # a read-only cache: the probe runs again next time
            log.warning("probe results not cached in %s: %s", self.path, err)


def choose(
    what: str,
    device: torch.device,
    shape: str,
    make: Callable[[str, int], Callable[[], object]],
    candidates: list[str],
    size: int,
    screen_size: int,
    cache_dir: str | Path | None = None,
) -> str:
    """The fastest of ``candidates`` for ``what`` on ``device`` at ``shape`` (cached); logs
    the figures it chose by."""
    key = f"{what}|{shape}|{_machine_key(device)}"
    if key in _DECIDED:  # this process decided it already
        return _DECIDED[key]
    cache = ProbeCache(cache_dir)
    hit = cache.get(key)
    if hit is not None and hit["choice"] in candidates:
        log.info("%s=auto: %s (cached probe, %s)", what, hit["choice"], _shown(hit["figures"]))
        _DECIDED[key] = hit["choice"]
        return hit["choice"]
    sync = torch.cuda.synchronize if device.type == "cuda" else None
    start = time.perf_counter()
    # A probe runs at whatever moment first needs it (e.g. the first validation, when not
    # cached); whatever its inputs or stand-in layers draw must not shift training's dropout.
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        figures = measure(make, candidates, size, screen_size, sync)
    choice = fastest(figures, candidates)
    log.info("%s=auto: %s (probe at %s on %s, %.2f s: %s)", what, choice, shape, device,
             time.perf_counter() - start, _shown(figures))  # fmt: skip
    cache.put(key, {"choice": choice, "figures": figures})
    _DECIDED[key] = choice
    return choice


def decided() -> dict[str, str]:
    """What this process has decided so far (key -> choice), for :func:`adopt` elsewhere."""
    return dict(_DECIDED)


def adopt(decisions: dict[str, str]) -> None:
    """Take another process's :func:`decided` as this one's: a distributed run's ranks run rank
    0's kernels instead of each probing at once on shared cores (skewing every rank's figures)
    and possibly choosing differently; a key names the machine, so a rank elsewhere probes."""
    _DECIDED.update(decisions)


def _shown(figures: dict) -> str:
    return ", ".join(
        f"{c} {'ruled out' if t is None else f'{t * 1000:.1f} ms'}" for c, t in figures.items()
    )
