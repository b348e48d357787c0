"""Metric logging: a JSONL file (the source of truth), TensorBoard and optional W&B.

``metrics.jsonl`` holds one JSON object per ``write_scalars`` call, flushed
immediately, so plots and experiments can be rebuilt from it even after a
crash. Non-finite values are written as the strings ``"nan"``, ``"inf"`` and
``"-inf"`` (strict JSON has no NaN literal, and unlike ``null`` the strings
keep which non-finite value it was); ``read_metrics`` turns them back into
floats. Only process 0 writes; on other processes every method is a no-op.

Scalar and image names must be legal TensorBoard tags (letters, digits, ``_ - . /``,
no leading ``/``): TensorBoard would silently rename any other name (``eval/pass@1``
became ``eval/pass_1``), so the dashboard and ``metrics.jsonl`` would disagree. Such a
name is refused with one error instead, whichever sinks are on.

``ProgressBar`` draws a tqdm bar on a terminal (or in a notebook) and otherwise, in a
log file, writes one plain line per log step: a bar's carriage-return redraws would
turn a log into one endless line with the other log lines glued onto it.
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np
from absl import logging

_NON_FINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}
_warned_no_wandb = False
# The characters tensorboardX keeps in a tag (summary._INVALID_TAG_CHARACTERS); it
# replaces any other with "_" and strips a leading "/".
_TB_ILLEGAL = re.compile(r"[^-/\w.]")


# pass@k was renamed pass_at_k (TensorBoard logged it as pass_k); older workdirs and
# result files still carry it.
_OLD_PASS_AT = re.compile(r"pass@(\d+)")


def current_names(obj: Any) -> Any:
    """``obj`` (a metrics row, or a JSON summary of them) with today's metric names:
    dict keys ``...pass@k`` become ``...pass_at_k``, at any depth."""
    if isinstance(obj, dict):
        return {_OLD_PASS_AT.sub(r"pass_at_\1", k): current_names(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [current_names(v) for v in obj]
    return obj


def check_name(name: str) -> str:
    """Returns ``name`` if TensorBoard keeps it as is, else raises ValueError."""
    if not isinstance(name, str) or not name or _TB_ILLEGAL.search(name) or name[0] == "/":
        legal = _TB_ILLEGAL.sub("_", str(name)).lstrip("/") or "x"
        raise ValueError(
            f"metric name {name!r} is not a legal TensorBoard tag (letters, digits, "
            f"'_-./', no leading '/'); TensorBoard would log it as {legal!r}, unlike "
            f"metrics.jsonl: rename it, e.g. to {legal!r}"
        )
    return name


def _to_json_number(value: float) -> float | str:
    if math.isfinite(value):
        return value
    return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")


def _from_json_number(value: Any) -> Any:
    return _NON_FINITE.get(value, value) if isinstance(value, str) else value


def _safe_name(name: str) -> str:
    # Text log names become file names; keep them inside the workdir.
    return re.sub(r"[^\w.-]+", "_", name).strip("._") or "text"


def truncate_rows(path: Path, last_step: int) -> None:
    """Rewrites ``path`` keeping the lines of rows with step <= ``last_step`` (byte for byte,
    so an uninterrupted run's file and a resumed one's agree). Write-then-rename: a crash
    here leaves the old file, never a half-written one."""
    with open(path, encoding="utf-8") as f:
        lines = f.readlines()
    kept = []
    for line in lines:
        try:
            step = json.loads(line).get("step")
        except (json.JSONDecodeError, AttributeError):
            continue  # a partial row of a crash mid-write: read_metrics would skip it too
        if isinstance(step, int) and step <= last_step:
            kept.append(line if line.endswith("\n") else line + "\n")
    _rewrite(path, lines, kept)


def _rewrite(path: Path, lines: list[str], kept: list[str]) -> None:
    """``path`` as ``kept`` when that drops any of its ``lines``; write-then-rename."""
    if len(kept) == len(lines):
        return
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("".join(kept), encoding="utf-8")
    os.replace(tmp, path)


_SECTION = re.compile(r"^=== step (-?\d+) ===$")


def _truncate_sections(path: Path, last_step: int) -> None:
    """Rewrites a write_text file keeping its sections of steps <= ``last_step`` (and any
    text before the first header); write-then-rename, as truncate_rows."""
    kept, keep = [], True
    lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
    for line in lines:
        header = _SECTION.match(line.rstrip("\n"))
        if header:
            keep = int(header[1]) <= last_step
        if keep:
            kept.append(line)
    _rewrite(path, lines, kept)


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
        start_step: int | None = None,
    ):
        """``start_step``: the step a run starts (or resumes) from. Rows, text sections
        (write_text) and TensorBoard events past it came from a run killed after its last
        checkpoint; the steps are about to be logged again, so they are dropped and each step
        appears once (-1: a run that logs its step 0 again drops that too)."""
        self.workdir = Path(workdir)
        self.enabled = jax.process_index() == 0
        # text files are cut back to start_step at their first write (their names come later)
        self._start_step, self._cut = start_step, set()
        self._jsonl = self._tb = self._wandb = None
        if not self.enabled:
            return
        self.workdir.mkdir(parents=True, exist_ok=True)
        # Append: a resumed run continues the same file rather than losing history.
        path = self.workdir / "metrics.jsonl"
        if start_step is not None and path.exists():
            truncate_rows(path, int(start_step))
        self._jsonl = open(path, "a", encoding="utf-8")
        if _ends_mid_line(path):
            # A crash mid-write left a partial last line; start ours on a fresh
            # line so only that partial row is lost, not our first one too.
            self._jsonl.write("\n")
        if tensorboard:
            from tensorboardX import SummaryWriter  # Deferred: slow-ish import.

            # purge_step: TensorBoard hides the old event files' events at steps >= it.
            purge = None if start_step is None else int(start_step) + 1
            self._tb = SummaryWriter(logdir=str(self.workdir / "tb"), purge_step=purge)
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
        # float(np.asarray(...)) accepts Python, NumPy and (device) JAX scalars. Names are
        # checked before anything is written: a refused row leaves no partial trace.
        values = {check_name(k): float(np.asarray(v)) for k, v in scalars.items()}
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
        if self._start_step is not None and path not in self._cut and path.exists():
            _truncate_sections(path, int(self._start_step))
        self._cut.add(path)
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
        check_name(name)
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
    by a crash mid-write is skipped with a warning rather than failing the read. Old
    names get today's (``current_names``), so an old workdir reads like a new one.
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
            rows.append({k: _from_json_number(v) for k, v in current_names(row).items()})
    return rows


def _in_notebook() -> bool:
    # tqdm.auto draws a widget in a Jupyter/Colab kernel, whose stderr is no TTY but
    # is no log file either: keep the bar there.
    ipython = sys.modules.get("IPython")
    try:
        return ipython is not None and "IPKernelApp" in ipython.get_ipython().config
    except AttributeError:  # IPython imported, but no shell running
        return False


def _format_figure(value: Any) -> str:
    try:
        return f"{float(np.asarray(value)):.4g}"
    except (TypeError, ValueError):
        return str(value)


def _format_eta(seconds: float) -> str:
    minutes, secs = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


class ProgressBar:
    """Training progress: a tqdm bar on a TTY, else one log line per ``log_every`` steps.

    ``tty=None`` decides by ``sys.stderr.isatty()`` (tqdm draws on stderr) or a notebook
    kernel; ``enabled=False`` (``logging.progress``) shows nothing. Only process 0 shows
    anything, else multi-host logs interleave N bars.
    """

    def __init__(
        self,
        total: int,
        initial: int = 0,
        enabled: bool = True,
        log_every: int = 1,
        tty: bool | None = None,
    ):
        self._bar = None
        self._lines = False
        self.total, self.log_every = int(total), max(int(log_every), 1)
        if not enabled or jax.process_index() != 0:
            return
        if tty is None:
            tty = sys.stderr.isatty() or _in_notebook()
        if tty:
            from tqdm.auto import tqdm

            self._bar = tqdm(total=total, initial=initial, dynamic_ncols=True)
        else:
            self._lines = True
            self._last_step, self._last_time = int(initial), time.perf_counter()
            self._first = None  # (step, time) of the first line: the ETA's origin

    def update(self, step: int, **key_figures: Any) -> None:
        """Moves to ``step`` and shows ``key_figures`` (4 significant digits)."""
        step = int(step)
        if self._bar is not None:
            postfix = {key: _format_figure(value) for key, value in key_figures.items()}
            self._bar.set_postfix(postfix, refresh=False)
            self._bar.update(step - self._bar.n)
        elif self._lines and (step % self.log_every == 0 or step == self.total):
            if step > self._last_step:  # one line per step, even if called twice
                logging.info("%s", self._line(step, key_figures))

    def _line(self, step: int, key_figures: dict[str, Any]) -> str:
        now = time.perf_counter()
        # steps/s: since the previous line (today's speed). The ETA uses the mean rate since
        # the first line instead: it leaves out compiling (before the first line) but counts
        # evals and checkpoints, and does not jump after every eval.
        rate = (step - self._last_step) / max(now - self._last_time, 1e-9)
        self._last_step, self._last_time = step, now
        self._first = self._first or (step, now)
        first_step, first_time = self._first
        mean = (step - first_step) / (now - first_time) if step > first_step else rate
        parts = [f"step {step}/{self.total}"]
        parts += [f"{key} {_format_figure(value)}" for key, value in key_figures.items()]
        parts += [f"{rate:.3g} steps/s", f"eta {_format_eta((self.total - step) / mean)}"]
        return " | ".join(parts)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        self._lines = False
