"""Shared test fixtures: the real corpora (MT_DATA_DIR) and a fresh config per test."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


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
