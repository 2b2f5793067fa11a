"""Several training corpora in one epoch, each at its own weight (corpus mixing).

``data.splits.train`` lists the training corpora; an entry is a name (weight 1) or a mapping
``{name: NAME, weight: W}``. With ``data.corpus_temperature`` T, corpus i of n_i pairs gives an
epoch c_i pairs:

    c_i = w_i * n_i                                                  (T = 1, the default)
    c_i = N * p_i,  p_i = (w_i n_i)^(1/T) / sum_j (w_j n_j)^(1/T),   N = sum_j w_j n_j

so a weight is an upsampling factor (fairseq's ``--upsample-primary``, Marian's data weighting:
2 sees a corpus twice per epoch, 0.5 half of it) and a temperature above 1 flattens the shares
towards uniform (T-sampling over corpus sizes, as in multilingual NMT) without changing the
epoch's size. c_i is rounded to whole pairs: ``c_i // n_i`` full passes over the corpus plus a
random subset, without repetition, of the rest, drawn afresh each epoch from (seed, epoch), so
the realised counts are the same in every epoch and on every rank.

Example:
    >>> [(c.name, c.weight) for c in corpus_specs(["europarl", {"name": "bt", "weight": 0.5}])]
    [('europarl', 1.0), ('bt', 0.5)]
    >>> epoch_counts([1000, 100], [1.0, 1.0], temperature=2.0).tolist()
    [836, 264]
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

KEY = "data.splits.train"


@dataclass(frozen=True)
class CorpusSpec:
    """One training corpus of ``data.splits.train``: its name and weight."""

    name: str
    weight: float = 1.0


def corpus_specs(value: Any, key: str = KEY) -> list[CorpusSpec]:
    """The corpora of a split value: a name, or a list of names and ``{name, weight}`` mappings.
    A bad entry is a one-line ValueError naming it (``data.splits.train[1]``; ``key`` names the
    setting) and what is wrong: a weight that is not a number > 0, a mapping without ``name``,
    an unknown key."""
    if value is None:
        return []
    items = value if isinstance(value, (list, tuple)) else [value]
    specs = []
    for i, item in enumerate(items):
        where = f"{key}[{i}]" if isinstance(value, (list, tuple)) else key
        if hasattr(item, "items"):
            entry = {str(k): v for k, v in item.items()}
            unknown = sorted(set(entry) - {"name", "weight"})
            if unknown or not entry.get("name"):
                raise ValueError(
                    f"{where}={entry}: a corpus is a name or {{name: NAME, weight: W}}"
                    + (f"; unknown key(s) {unknown}" if unknown else "; the name is missing")
                )
            weight = entry.get("weight", 1.0)
            if isinstance(weight, bool) or not isinstance(weight, (int, float)):
                raise ValueError(f"{where}: weight={weight!r} is not a number (give W > 0)")
            if not (math.isfinite(weight) and weight > 0):
                raise ValueError(
                    f"{where}: weight={weight} must be > 0 (a weight scales how many of the "
                    f"corpus's pairs an epoch holds; leave a corpus out to drop it)"
                )
            specs.append(CorpusSpec(str(entry["name"]), float(weight)))
        else:
            specs.append(CorpusSpec(str(item)))
    return specs


def directions(data_cfg) -> list[CorpusSpec]:
    """``data.directions`` (a DataConfig's) as corpora named ``SRC-TGT`` with their weights, e.g.
    ``[de-en, {name: en-de, weight: 2}]``; empty for a one-direction corpus. A name that is not
    two different languages joined by ``-``, or a direction given twice, is a ValueError."""
    specs = corpus_specs(data_cfg.directions, "data.directions")
    for spec in specs:
        src, _, tgt = spec.name.partition("-")
        if not src or not tgt or src == tgt or "-" in tgt:
            raise ValueError(
                f"data.directions: {spec.name!r} is not a direction SRC-TGT of two languages "
                "(e.g. de-en)"
            )
    names = [spec.name for spec in specs]
    if len(set(names)) != len(names):
        raise ValueError(f"data.directions={names}: a direction is given twice")
    return specs


def train_specs(data_cfg) -> list[CorpusSpec]:
    """The training corpora in the order mt-prepare writes them: ``data.splits.train``'s, or
    with ``data.directions`` each of them in each direction, direction after direction, named
    ``de-en:train`` and weighted by the product of the two weights."""
    specs = corpus_specs(data_cfg.splits.train)
    return [
        CorpusSpec(f"{d.name}:{s.name}", d.weight * s.weight)
        for d in directions(data_cfg)
        for s in specs
    ] or specs


def check_temperature(temperature: float) -> None:
    """Raise a one-line ValueError unless ``data.corpus_temperature`` is a finite number > 0."""
    if not (math.isfinite(temperature) and temperature > 0):
        raise ValueError(
            f"data.corpus_temperature={temperature} must be > 0 (1 = the corpora's own sizes "
            "times their weights; larger values flatten the shares towards uniform)"
        )


def epoch_counts(
    sizes: Sequence[int], weights: Sequence[float], temperature: float = 1.0
) -> np.ndarray:
    """Pairs of each corpus in one epoch, int64, from their ``sizes`` (n_i), ``weights``
    (w_i > 0) and the ``temperature`` T > 0 (see the module docstring)."""
    check_temperature(temperature)
    n = np.asarray(sizes, dtype=np.float64)
    w = np.asarray(weights, dtype=np.float64)
    if n.shape != w.shape:
        raise ValueError(f"{len(n)} corpus sizes but {len(w)} weights")
    mass = n * w
    if temperature == 1.0 or mass.sum() == 0:
        return np.rint(mass).astype(np.int64)
    shares = np.where(mass > 0, mass, 0.0) ** (1.0 / temperature)
    return np.rint(mass.sum() * shares / shares.sum()).astype(np.int64)


@dataclass(frozen=True)
class Mix:
    """The training corpora as contiguous ranges of the prepared split (``sizes``: their pairs,
    corpus 0 first), with their names (for the log), weights and ``data.corpus_temperature``."""

    names: tuple[str, ...]
    sizes: tuple[int, ...]
    weights: tuple[float, ...]
    temperature: float = 1.0

    def __post_init__(self) -> None:
        if not len(self.names) == len(self.sizes) == len(self.weights):
            raise ValueError(
                f"{len(self.names)} corpus names, {len(self.sizes)} sizes, "
                f"{len(self.weights)} weights"
            )
        check_temperature(self.temperature)

    @property
    def trivial(self) -> bool:
        """Every corpus once per epoch, as read (no sampling needed)."""
        return self.temperature == 1.0 and all(w == 1.0 for w in self.weights)

    def corpus_of(self, indices: np.ndarray) -> np.ndarray:
        """The corpus number of each pair index."""
        return np.searchsorted(np.cumsum(self.sizes), indices, side="right")

    def sample(self, kept: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """One epoch's pair indices drawn from ``kept`` (the pairs the sampler did not skip, in
        ascending order): per corpus, :func:`epoch_counts` of its kept pairs."""
        groups = np.split(kept, np.searchsorted(kept, np.cumsum(self.sizes)[:-1]))
        counts = epoch_counts([len(g) for g in groups], self.weights, self.temperature)
        out = []
        for group, count in zip(groups, counts.tolist()):
            if len(group) == 0:
                continue
            full, rest = divmod(count, len(group))
            out.extend([group] * full)
            if rest:
                out.append(np.sort(rng.choice(group, size=rest, replace=False)))
        return np.concatenate(out) if out else np.zeros(0, dtype=np.int64)

    def describe(self, counts: Sequence[int]) -> str:
        """One log line: each corpus's pairs in an epoch, its share and weight."""
        total = max(int(sum(counts)), 1)
        parts = [
            f"{name} {int(count):,} ({100 * int(count) / total:.1f}%; {size:,} pairs x {weight:g})"
            for name, size, weight, count in zip(self.names, self.sizes, self.weights, counts)
        ]
        temp = f", temperature {self.temperature:g}" if self.temperature != 1.0 else ""
        return "; ".join(parts) + temp


def train_mix(data_cfg, sizes: Sequence[int] | None) -> Mix | None:
    """The :class:`Mix` of ``data_cfg`` (a DataConfig) over the prepared corpora's ``sizes``
    (``meta.json``'s ``counts.train.corpora``); None when every corpus counts once, as read."""
    specs = train_specs(data_cfg)
    check_temperature(data_cfg.corpus_temperature)
    mix_asked = data_cfg.corpus_temperature != 1.0 or any(s.weight != 1.0 for s in specs)
    if not mix_asked:
        return None
    if sizes is None or len(sizes) != len(specs):
        raise ValueError(
            f"{KEY}: corpus weights need the pairs of each corpus, which this prepared data "
            "does not record: run mt-prepare again (a newer cache format)"
        )
    return Mix(tuple(s.name for s in specs), tuple(int(n) for n in sizes),
               tuple(s.weight for s in specs), float(data_cfg.corpus_temperature))  # fmt: skip
