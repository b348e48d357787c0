"""Shared pytest fixtures and helpers."""

import os
import subprocess
import sys
import time
from pathlib import Path

# XLA:CPU's older loop emitters for every fusion, in this process and (through the
# environment) in every process a test starts. The suite is mostly compiles of small
# programs at backend optimisation level 0, and there the MLIR fusion emitters cost most of a
# compile. On a 2-core machine (2026-11-28, jax 0.10.2) `JAX_DISABLE_MOST_OPTIMIZATIONS=1
# python experiments/benchmark.py --config=configs/shakespeare.py:tiny,exhaustive
# --noroofline --steps=1 --warmup=0` compiled in 1.7-1.9 s instead of 3.6-3.7 (`tiny,sampled`:
# 1.5-1.6 instead of 2.9-3.0; three runs each), and the whole suite (`-n 2`) took 6:57
# instead of 12:00.
# Not a setting for real runs: at full optimisation the same flag made the reference step
# compile in 10 s instead of 6.5 and run 0.39 s instead of 0.24-0.28. The values tests
# compare are computed under the same flag on both sides, and within tolerances of the
# independent references either way.
SUITE_XLA_FLAG = "--xla_cpu_use_fusion_emitters=false"


def _xla_knows(flag: str) -> bool:
    """Whether this jaxlib accepts ``flag``: XLA aborts the process on an unknown one, so a
    jaxlib that has dropped it must not be handed it (the suite then only runs slower)."""
    env = {**os.environ, "XLA_FLAGS": flag, "JAX_PLATFORMS": "cpu"}
    probe = [sys.executable, "-c", "import jax; jax.devices()"]
    try:
        return subprocess.run(probe, env=env, capture_output=True, timeout=120).returncode == 0
    except subprocess.TimeoutExpired:  # a jax that cannot start fails the tests themselves
        return False


if SUITE_XLA_FLAG.split("=")[0] not in os.environ.get("XLA_FLAGS", ""):  # once per session:
    # pytest-xdist's workers inherit the controller's environment
    if _xla_knows(SUITE_XLA_FLAG):
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {SUITE_XLA_FLAG}".strip()

import jax  # noqa: E402  (after XLA_FLAGS: the backend reads them when it starts)
import pytest  # noqa: E402


def pytest_report_header(config):
    return f"XLA_FLAGS: {os.environ.get('XLA_FLAGS', '')!r}"


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
