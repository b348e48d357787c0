"""One device shared by several measuring processes: timed sections run alone, compiles
overlap (experiments/gpu_suite.py runs its children a few at a time).

A child wraps its compiles (and the first call that compiles) in ``shared()`` and the calls
it times in ``timed()``. While any process holds ``timed()`` no other process holds either,
so a timing never shares the device with another child's compile (XLA's GPU autotuner runs
candidate kernels on the device while it compiles) or with another timing; compiles, being
host work, run side by side. A process waiting to time goes ahead of compiles that ask after
it (a gate file it holds while it waits), so a stream of compiles cannot starve it.

The locks are ``flock``s on two files in the directory named by $GRPO_JAX_DEVICE_LOCK; the
kernel drops them when a process exits, so a child killed at its time limit frees the device.
Each section held is logged there (``sections.jsonl``: pid, kind, start, end, seconds waited)
and ``summary()`` reads the log back: the suite records it, and its test checks that no timed
section overlapped another process's section. Without the variable both are no-ops: a
measurement run by hand is unchanged. Plain Python (no jax), so TRL's interpreter
(experiments/trl_grpo.py) uses it too.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import time
from pathlib import Path

ENV = "GRPO_JAX_DEVICE_LOCK"
_waited = {"shared": 0.0, "timed": 0.0}  # seconds this process spent waiting for each
_held: list = []  # the kind held now: flocks do not nest within one process


@contextlib.contextmanager
def _hold(kind: str):
    root = os.environ.get(ENV)
    if not root:
        yield
        return
    if _held:  # a second flock from this process would wait on its own first one
        raise RuntimeError(f"device_lock: {kind}() inside {_held[0]}(); they do not nest")
    Path(root).mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    gate = os.open(Path(root) / "gate", os.O_RDWR | os.O_CREAT, 0o644)
    device = os.open(Path(root) / "device", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(gate, fcntl.LOCK_EX)  # in line behind a timing that is waiting
        try:
            fcntl.flock(device, fcntl.LOCK_EX if kind == "timed" else fcntl.LOCK_SH)
        finally:
            os.close(gate)  # closing the descriptor drops its flock
        waited = time.perf_counter() - t0
        _waited[kind] += waited
        _held.append(kind)
        start = time.time()
        yield
        # logged while still held, so the next holder's start follows this end
        _log(root, {"pid": os.getpid(), "kind": kind, "start": start, "end": time.time(),
                    "waited_s": round(waited, 3)})  # fmt: skip
    finally:
        if _held:
            _held.pop()
        os.close(device)


def _log(root: str, entry: dict) -> None:
    # one short O_APPEND write per line: whole lines, whichever process writes
    fd = os.open(Path(root) / "sections.jsonl", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (json.dumps(entry) + "\n").encode())
    finally:
        os.close(fd)


def shared():
    """Compiling (or anything else that may overlap other processes' compiles)."""
    return _hold("shared")


def timed():
    """Timing: no other process holds the device meanwhile."""
    return _hold("timed")


def report() -> dict:
    """``{"device_lock_wait_s": {...}}`` for a child's JSON when the lock is on, else {}."""
    if not os.environ.get(ENV):
        return {}
    return {"device_lock_wait_s": {k: round(v, 3) for k, v in _waited.items()}}


def summary(root) -> dict:
    """What the processes that shared ``root`` logged: sections and seconds held and waited by
    kind, and ``timed_overlap_s``, the longest time a timed section shared with another
    process's section (0 when the lock did its job)."""
    path = Path(root) / "sections.jsonl"
    rows = [json.loads(ln) for ln in path.read_text().splitlines()] if path.exists() else []
    out = {"processes": len({r["pid"] for r in rows})}
    for kind in ("shared", "timed"):
        mine = [r for r in rows if r["kind"] == kind]
        out[kind] = {
            "sections": len(mine),
            "held_s": round(sum(r["end"] - r["start"] for r in mine), 3),
            "waited_s": round(sum(r["waited_s"] for r in mine), 3),
        }
    overlaps = [
        min(a["end"], b["end"]) - max(a["start"], b["start"])
        for a in rows
        if a["kind"] == "timed"
        for b in rows
        if b["pid"] != a["pid"]
    ]
    out["timed_overlap_s"] = round(max([0.0, *overlaps]), 6)
    return out
