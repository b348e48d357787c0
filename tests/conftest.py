"""Shared pytest fixtures."""

import os
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def shakespeare_path() -> Path:
    """The tiny Shakespeare file in shared/ beside the repo (or $GRPO_JAX_DATA).

    Never copied into the repo; tests that need the real corpus skip without it.
    """
    candidates = [Path(__file__).resolve().parents[2] / "shared/data/tinyshakespeare.txt"]
    if os.environ.get("GRPO_JAX_DATA"):
        candidates.append(Path(os.environ["GRPO_JAX_DATA"]))
    for path in candidates:
        if path.is_file():
            return path
    pytest.skip("tiny Shakespeare not found: put it in shared/data or set GRPO_JAX_DATA")
