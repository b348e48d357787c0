"""Shared pytest fixtures and helpers."""

import os
import time
from pathlib import Path

import jax
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


def compilation_cache_dir(tmp_path_factory) -> Path:
    """One persistent XLA cache for the whole session: under pytest-xdist the workers' base
    temp dirs share a parent, so a program one worker compiled is loaded by the others."""
    base = tmp_path_factory.getbasetemp()
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    return root / "jax_compilation_cache"


def signal_after(procs, workdir, rows: int, signum, to=None) -> None:
    """Sends ``signum`` to ``to`` (default: each of ``procs``, the run's processes) once
    ``workdir``'s metrics.jsonl has ``rows`` rows, the run mid-way. A run that ends or stalls
    before then fails the test, and none of its processes is left running."""
    path = Path(workdir) / "metrics.jsonl"
    deadline = time.monotonic() + 120
    try:
        while not (path.exists() and path.read_text().count("\n") >= rows):
            assert all(p.poll() is None for p in procs), "run ended before the signal"
            assert time.monotonic() < deadline, f"no {rows} rows in 120 s"
            time.sleep(0.05)
    except BaseException:
        for p in procs:
            p.kill()
            p.communicate()
        raise
    for p in procs if to is None else [to]:
        p.send_signal(signum)


@pytest.fixture(scope="module")
def fast_compiles(tmp_path_factory):
    """Cheap XLA compiles + a session-wide persistent cache (shared with the CLI tests' runs);
    restored afterwards. Modules opt in with ``pytestmark = usefixtures("fast_compiles")``."""
    from jax._src import compilation_cache

    names = (
        "jax_disable_most_optimizations",
        "jax_compilation_cache_dir",
        "jax_persistent_cache_min_compile_time_secs",
        "jax_persistent_cache_min_entry_size_bytes",
    )
    saved = {name: jax.config.values[name] for name in names}
    cache_dir = compilation_cache_dir(tmp_path_factory)
    jax.config.update("jax_disable_most_optimizations", True)
    jax.config.update("jax_compilation_cache_dir", str(cache_dir))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    compilation_cache.reset_cache()
    yield
    for name, value in saved.items():
        jax.config.update(name, value)
    compilation_cache.reset_cache()
