"""Helpers for the notebooks (notebooks/*.ipynb): backend setup, configs by name, small mode.

The notebooks define none of the framework; they call these and the trainer.

  GRPO_JAX_NOTEBOOK_SMALL=1   shrinks every notebook's runs to seconds (the test suite executes
                              the notebooks on CPU this way, tests/test_notebooks.py)
"""

import os
from pathlib import Path

from grpo_jax.config_blocks import load_config  # noqa: F401  (the notebooks call colab.load_config)

SMALL_ENV = "GRPO_JAX_NOTEBOOK_SMALL"


def small() -> bool:
    """True when the notebooks should run their small (CI) versions."""
    return os.environ.get(SMALL_ENV, "").strip() not in ("", "0", "false", "False")


def setup_backend():
    """Uses a Colab TPU when present (old 'TPU node' runtimes need an explicit setup; TPU VMs
    and GPUs are found by JAX itself). Returns (backend name, devices)."""
    if "COLAB_TPU_ADDR" in os.environ:
        try:
            import jax.tools.colab_tpu

            jax.tools.colab_tpu.setup_tpu()
        except (ImportError, AttributeError, RuntimeError) as err:
            print(f"Colab TPU node setup unavailable ({err}); using JAX's default backend")
    import jax

    return jax.default_backend(), jax.devices()


def repo_root() -> Path:
    """The repository checkout holding configs/ (the package is installed with pip -e)."""
    return Path(__file__).resolve().parents[1]


def metric_series(workdir, key: str):
    """(steps, values) of one metric from a run's metrics.jsonl."""
    from grpo_jax.metric_writers import read_metrics

    rows = [r for r in read_metrics(workdir) if key in r]
    return [r["step"] for r in rows], [r[key] for r in rows]
