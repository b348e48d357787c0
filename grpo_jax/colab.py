"""Helpers for the notebooks (notebooks/*.ipynb): runtime setup, configs by name, small mode.

The notebooks define none of the framework; they call these, the trainer and `plots`.

  GRPO_JAX_NOTEBOOK_SMALL=1   shrinks every notebook's runs to seconds (the test suite executes
                              the notebooks on CPU this way, tests/test_notebooks.py)
"""

import os

from grpo_jax.config_blocks import load_config  # noqa: F401  (the notebooks call colab.load_config)

SMALL_ENV = "GRPO_JAX_NOTEBOOK_SMALL"


def small() -> bool:
    """True when the notebooks should run their small (CI) versions."""
    return os.environ.get(SMALL_ENV, "").strip() not in ("", "0", "false", "False")


def setup_backend():
    """JAX's own default backend and devices: a Colab TPU v2 runtime is a TPU VM, which JAX
    finds by itself (the TPU-node setup, jax.tools.colab_tpu, is gone from JAX and from
    Colab), as it finds a GPU; otherwise the CPU. Returns (backend name, devices)."""
    import jax

    return jax.default_backend(), jax.devices()


def setup(corpus: bool = True):
    """A notebook's first step after the install: the backend, and (for the Shakespeare
    notebooks) the corpus found the CLI's way -- $GRPO_JAX_DATA, the user cache, or
    downloaded and checked against its sha256 (grpo_jax.data.resolve_data_path).

    Prints one line each and returns a dict: backend, devices, small, data (path or None).
    """
    backend, devices = setup_backend()
    info = {"backend": backend, "devices": devices, "small": small(), "data": None}
    print(f"backend={backend} devices={len(devices)} x {devices[0].device_kind} small={small()}")
    if corpus:
        from grpo_jax import data

        path = data.resolve_data_path()
        # An explicitly named file may be the user's own corpus (resolve_data_path accepts
        # it with a warning); say which it is rather than fail.
        canonical = data.file_sha256(path) == data.CANONICAL_SHA256
        verdict = "sha256 verified" if canonical else "NOT the canonical tiny Shakespeare"
        print(f"corpus: {path.name} ({path.stat().st_size:,} bytes, {verdict})")
        info["data"] = path
    return info


def metric_series(workdir, key: str):
    """(steps, values) of one metric from a run's metrics.jsonl."""
    from grpo_jax.metric_writers import read_metrics

    rows = [r for r in read_metrics(workdir) if key in r]
    return [r["step"] for r in rows], [r[key] for r in rows]
