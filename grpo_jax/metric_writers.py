"""Metric logging: a JSONL file (the source of truth), TensorBoard and optional W&B.

``metrics.jsonl`` holds one JSON object per ``write_scalars`` call, flushed
immediately, so plots and experiments can be rebuilt from it even after a
crash. Non-finite values are written as the strings ``"nan"``, ``"inf"`` and
``"-inf"`` (strict JSON has no NaN literal, and unlike ``null`` the strings
keep which non-finite value it was); ``read_metrics`` turns them back into
floats. Only process 0 writes; on other processes every method is a no-op.
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path
from typing import Any

import jax
import numpy as np
from absl import logging

_NON_FINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}
_warned_no_wandb = False


def _to_json_number(value: float) -> float | str:
    if math.isfinite(value):
        return value
    return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")


def _from_json_number(value: Any) -> Any:
    return _NON_FINITE.get(value, value) if isinstance(value, str) else value


def _safe_name(name: str) -> str:
    # Text log names become file names; keep them inside the workdir.
    return re.sub(r"[^\w.-]+", "_", name).strip("._") or "text"


def _ends_mid_line(path: Path) -> bool:
    if path.stat().st_size == 0:
        return False
    with open(path, "rb") as f:
        f.seek(-1, os.SEEK_END)
        return f.read(1) != b"\n"


class MetricWriter:
    """Writes scalars/text/images to ``workdir`` (JSONL + TensorBoard + optional W&B)."""

    def __init__(
        self,
        workdir: str | os.PathLike,
        tensorboard: bool = True,
        wandb: bool = False,
        wandb_project: str = "grpo_jax",
        config: Any = None,
    ):
        self.workdir = Path(workdir)
        self.enabled = jax.process_index() == 0
        self._jsonl = self._tb = self._wandb = None
        if not self.enabled:
            return
        self.workdir.mkdir(parents=True, exist_ok=True)
        # Append: a resumed run continues the same file rather than losing history.
        path = self.workdir / "metrics.jsonl"
        self._jsonl = open(path, "a", encoding="utf-8")
        if _ends_mid_line(path):
            # A crash mid-write left a partial last line; start ours on a fresh
            # line so only that partial row is lost, not our first one too.
            self._jsonl.write("\n")
        if tensorboard:
            from tensorboardX import SummaryWriter  # Deferred: slow-ish import.

            self._tb = SummaryWriter(logdir=str(self.workdir / "tb"))
        if wandb:
            self._wandb = self._init_wandb(wandb_project, config)

    def _init_wandb(self, project: str, config: Any) -> Any:
        global _warned_no_wandb
        try:
            import wandb
        except ImportError:
            if not _warned_no_wandb:
                logging.warning("wandb=True but wandb is not installed; skipping W&B")
                _warned_no_wandb = True
            return None
        if hasattr(config, "to_dict"):
            config = config.to_dict()
        run = wandb.init(project=project, config=config, dir=str(self.workdir))
        return run

    def write_scalars(self, step: int, scalars: dict[str, Any]) -> None:
        """Logs one row ``{"step": step, name: float, ...}`` to every sink."""
        if not self.enabled:
            return
        if "step" in scalars:
            raise ValueError("'step' is reserved in metrics; rename that scalar")
        step = int(step)
        # float(np.asarray(...)) accepts Python, NumPy and (device) JAX scalars.
        values = {k: float(np.asarray(v)) for k, v in scalars.items()}
        row = {"step": step, **{k: _to_json_number(v) for k, v in values.items()}}
        self._jsonl.write(json.dumps(row, allow_nan=False) + "\n")
        self._jsonl.flush()  # A crash must not lose logged rows.
        if self._tb is not None:
            for name, value in values.items():
                self._tb.add_scalar(name, value, step)
        if self._wandb is not None:
            self._wandb.log(values, step=step)

    def write_text(self, step: int, name: str, text: str) -> None:
        """Appends ``text`` under a step header to ``workdir/{name}.txt`` (and TensorBoard)."""
        if not self.enabled:
            return
        path = self.workdir / f"{_safe_name(name)}.txt"
        with open(path, "a", encoding="utf-8") as f:
            f.write(f"=== step {int(step)} ===\n{text}\n\n")
        if self._tb is not None:
            self._tb.add_text(name, text, int(step))
        if self._wandb is not None:
            import wandb

            self._wandb.log({name: wandb.Html(f"<pre>{text}</pre>")}, step=int(step))

    def write_image(
        self, step: int, name: str, path_or_array: str | os.PathLike | np.ndarray
    ) -> None:
        """Logs an HWC image (uint8, or float in [0, 1]) or an image file, e.g. a figure."""
        if not self.enabled:
            return
        if isinstance(path_or_array, (str, os.PathLike)):
            import matplotlib.image

            image = matplotlib.image.imread(os.fspath(path_or_array))
        else:
            image = np.asarray(path_or_array)
        if image.ndim == 2:
            image = image[..., None]
        if image.dtype != np.uint8:  # TensorBoard expects [0, 1] floats or uint8.
            image = np.clip(image.astype(np.float32), 0.0, 1.0)
        if self._tb is not None:
            self._tb.add_image(name, image, int(step), dataformats="HWC")
        if self._wandb is not None:
            import wandb

            self._wandb.log({name: wandb.Image(image)}, step=int(step))

    def flush(self) -> None:
        """Pushes buffered TensorBoard events to disk (JSONL is always flushed)."""
        if self._jsonl is not None:
            self._jsonl.flush()
        if self._tb is not None:
            self._tb.flush()

    def close(self) -> None:
        """Flushes and closes every sink; safe to call twice."""
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None
        self.enabled = False  # Later writes are no-ops, not errors on closed files.

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_metrics(path: str | os.PathLike) -> list[dict[str, Any]]:
    """Reads ``metrics.jsonl`` (or a workdir containing it) back into a list of rows.

    ``"nan"``/``"inf"``/``"-inf"`` strings become floats again. A line cut short
    by a crash mid-write is skipped with a warning rather than failing the read.
    """
    path = Path(path)
    if path.is_dir():
        path = path / "metrics.jsonl"
    rows = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                logging.warning("%s:%d is not valid JSON; skipped", path, lineno)
                continue
            rows.append({k: _from_json_number(v) for k, v in row.items()})
    return rows


class ProgressBar:
    """A tqdm bar over training steps showing key figures (loss, reward, ...) as postfix."""

    def __init__(self, total: int, initial: int = 0, enabled: bool = True):
        self._bar = None
        # Only one process draws, else multi-host logs interleave N bars.
        if enabled and jax.process_index() == 0:
            from tqdm.auto import tqdm

            self._bar = tqdm(total=total, initial=initial, dynamic_ncols=True)

    def update(self, step: int, **key_figures: Any) -> None:
        """Moves the bar to ``step`` and shows ``key_figures`` (4 significant digits)."""
        if self._bar is None:
            return
        postfix = {}
        for key, value in key_figures.items():
            try:
                postfix[key] = f"{float(np.asarray(value)):.4g}"
            except (TypeError, ValueError):
                postfix[key] = str(value)
        self._bar.set_postfix(postfix, refresh=False)
        self._bar.update(int(step) - self._bar.n)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
