"""Shared fixtures: where the real datasets live, and one Ray instance per test session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = Path(os.environ.get("FEDROD_TEST_DATA", REPO.parent / "shared" / "data"))
MNIST_FILES = (
    "train-images-idx3-ubyte.gz",
    "train-labels-idx1-ubyte.gz",
    "t10k-images-idx3-ubyte.gz",
    "t10k-labels-idx1-ubyte.gz",
)


@pytest.fixture(scope="session")
def shared_data_dir() -> Path:
    """The directory holding the verified real datasets (``../shared/data``); skips when absent."""
    if not all((SHARED_DATA / "mnist" / f).is_file() for f in MNIST_FILES):
        pytest.skip(f"real MNIST not found under {SHARED_DATA}/mnist (set FEDROD_TEST_DATA)")
    return SHARED_DATA
