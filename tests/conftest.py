"""Shared test fixtures: the real corpora (MT_DATA_DIR) and a fresh config per test."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

# The scripts' helpers (the export check, the fault injector, the benchmarks) import as modules.
SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
if str(SCRIPTS) not in sys.path:
    sys.path.insert(0, str(SCRIPTS))


def data_dir() -> Path | None:
    """The shared corpora directory, or None when absent (a user's fresh clone)."""
    env = os.environ.get("MT_DATA_DIR")
    candidates = [Path(env)] if env else []
    candidates.append(Path(__file__).resolve().parents[2] / "shared" / "data")
    for path in candidates:
        if (path / "multi30k" / "train.de").is_file():
            return path
    return None


@pytest.fixture(scope="session")
def real_data() -> Path:
    """The real corpora; skips with a visible reason when absent (a failure in CI)."""
    path = data_dir()
    if path is None:
        if os.environ.get("MT_REQUIRE_DATA"):
            pytest.fail("MT_REQUIRE_DATA is set but no corpora were found at MT_DATA_DIR")
        pytest.skip("real corpora not found: set MT_DATA_DIR to shared/data")
    return path


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory, monkeypatch):
    """Keep every test's prepared-data cache out of the repository."""
    monkeypatch.setenv("MT_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "mt-cache"))


def sharp_random_model(vocab_size: int = 40):
    """A small random-weight Transformer with sharp distributions, for search tests: weights
    scaled up, and EOS likely enough that some sentences end early while others run to their
    maximum length."""
    import torch

    from mt.model.transformer import build_model
    from mt.schema import ModelConfig
    from mt.vocab import EOS

    torch.manual_seed(0)
    cfg = ModelConfig(N=2, d_model=32, d_ff=64, h=4, dropout=0.0, max_positions=128)
    model = build_model(cfg, vocab_size=vocab_size).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.5)
        model.embed[EOS] *= 3.0
    return model


def assert_same_nbest(expected, actual, abs_tol: float = 1e-4) -> None:
    """Two searches' n-best lists agree: the same scores (to ``abs_tol``) and tokens, and the
    sentences end at different steps (so the comparison covers finished and live rows)."""
    import pytest

    assert len({len(h[0].tokens) for h in expected}) > 2
    for a, b in zip(expected, actual, strict=True):
        assert [h.score for h in a] == pytest.approx([h.score for h in b], abs=abs_tol)
        assert [h.tokens for h in a] == [h.tokens for h in b]


def pytest_configure(config):
    """Under pytest-xdist, mt's C++ kernels are built (or found built) once, before the workers
    start: built by whichever tests came first, their minute of compiling ran beside the other
    worker's tests, and the tests that started processes of their own (torchrun nodes, the
    fault injector's runs) each waited for it, up to two minutes apiece in CI."""
    if hasattr(config, "workerinput") or not getattr(config.option, "numprocesses", None):
        return  # a worker, or a run without workers: the first test that needs them builds
    import subprocess

    code = "from mt.fast import native; native.dropout()"  # builds, or loads an earlier build
    subprocess.run([sys.executable, "-c", code], check=False)


def pytest_collection_modifyitems(config, items):
    """Tests marked ``gpu`` need a CUDA device: ``pytest -m gpu`` selects all of them on a GPU
    machine; elsewhere they skip with one reason."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (marked gpu)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
