"""The GPU suite's children (experiments/gpu_suite.py): each measurement in its own process,
a few at a time on one device, within the suite's wall-clock budget. A child prints its
record as its last JSON line; a failing, timed-out or out-of-memory child becomes an
{"error": ...} record and never stops the suite."""

import json
import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import NamedTuple

import device_lock
from gpu_suite_parts import shown
from gpu_suite_plan import schedule

ROOT = Path(__file__).resolve().parents[1]


class Limits(NamedTuple):
    """The suite's flags the children run under (gpu_suite.py's --time_scale, --budget_s,
    --trl_python) and when its budget started counting."""

    time_scale: float  # multiplies every part's time limit
    budget_s: float  # the whole suite's wall-clock budget (0: none)
    trl_python: str  # the Python that runs TRL
    start: float  # time.perf_counter() at the suite's start


CHILD_ENV_KEYS = (
    "JAX_PLATFORMS",
    "JAX_DISABLE_MOST_OPTIMIZATIONS",
    "XLA_PYTHON_CLIENT_MEM_FRACTION",
    "XLA_PYTHON_CLIENT_PREALLOCATE",
)
MIN_PART_S = 60  # a part given less than this is not started (no compile fits in it)
OOM = ("RESOURCE_EXHAUSTED", "Out of memory", "out of memory", "OOM")


def child_env(smoke: bool, workers: int, scratch: Path) -> dict:
    """The children's environment. ``scratch`` (the run's temporary directory) holds the
    compilation cache they share (a program two children compile with the same XLA flags is
    compiled once) and, with ``workers`` > 1, the device lock their timed sections take
    turns on."""
    env = dict(os.environ)
    if smoke:  # the CPU, and XLA's cheap compiles: the smoke checks the code, not the speed
        env.update(JAX_PLATFORMS="cpu", JAX_DISABLE_MOST_OPTIMIZATIONS="1")
    else:  # let one part's step use most of the GPU (JAX's default preallocates 75 %)
        env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.92")
        if workers > 1:  # several processes on one GPU: each takes what it uses, up to that
            env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    env.setdefault("JAX_COMPILATION_CACHE_DIR", str(scratch / "jax_cache"))
    if workers > 1:
        env[device_lock.ENV] = str(scratch / "device_lock")
    return env


def run_child(job: dict, env: dict, limits: Limits) -> dict:
    """Runs one measurement; returns its last JSON line (plus wall_s and command), or an
    {"error": ...} record: a failing child never stops the suite."""
    cmd, timeout = job["cmd"], job["timeout"] * limits.time_scale
    t0 = time.perf_counter()
    if limits.budget_s:
        timeout = min(timeout, limits.budget_s - (t0 - limits.start))
    if limits.budget_s and timeout < MIN_PART_S:
        res = {"error": f"not run: --budget_s={limits.budget_s:.0f} spent"}
    else:
        res = run_command(cmd, env, timeout)
    res["wall_s"] = time.perf_counter() - t0
    res["command"] = job.get("shown") or shown(cmd, limits.trl_python)
    status = res.get("error") or res.get("skipped") or "ok"
    print(f"{job['part']} {job['key']}: {status} ({res['wall_s']:.1f} s)", flush=True)
    print(f"  $ {res['command']}", flush=True)
    return res


def show_tail(lines: list) -> None:
    """The last lines a failed child printed, indented, into the suite's log."""
    print("\n".join(f"  | {ln}" for ln in lines[-25:]), flush=True)


def run_command(cmd: list, env: dict, timeout: float) -> dict:
    """One child's last JSON line, or an {"error": ...} record (out_of_memory flagged)."""
    try:
        proc = subprocess.run(
            cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired as e:  # what it printed so far says where it was
        err = e.stderr or b""
        show_tail((err.decode(errors="replace") if isinstance(err, bytes) else err).splitlines())
        return {"error": f"timed out after {timeout:.0f} s"}
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode == 0 and lines:
        return json.loads(lines[-1])
    tail = (proc.stderr.strip() or proc.stdout.strip() or "no output").splitlines()
    show_tail(tail)
    err = next((ln for ln in reversed(tail) if "Error" in ln), tail[-1])
    res = {"error": f"exit {proc.returncode}: {err[:400]}"}
    if any(s in proc.stderr for s in OOM):
        res["out_of_memory"] = True
    return res


def run_jobs(
    jobs: list, env: dict, workers: int, limits: Limits, done=lambda: None, capacity=None
) -> list:
    """The children ``workers`` at a time (with more than one, their timed sections take turns
    through the device lock in ``env``), in gpu_suite_plan.schedule's order within ``capacity``
    bytes; ``done()`` after each. A child that ran out of memory beside others runs again once
    the rest are done, alone (its neighbours' memory may have been what it lacked); its record
    keeps the first error in ``retried_alone_after``."""
    for job in jobs:  # a Python that is not there skips TRL without starting anything
        if job["part"] == "trl" and not (
            Path(limits.trl_python).exists() or shutil.which(limits.trl_python)
        ):
            job["result"] = {"skipped": f"--trl_python={limits.trl_python} not found"}
    todo = [j for j in jobs if "result" not in j]

    def run(job):
        job["result"] = run_child(job, env, limits)
        done()

    if workers <= 1:
        for job in todo:
            run(job)
        return jobs
    schedule(todo, workers, run, capacity)
    for job in [j for j in todo if j["result"].get("out_of_memory")]:
        first = job["result"]
        print(f"{job['part']} {job['key']}: out of memory beside others, again alone", flush=True)
        run(job)
        job["result"]["retried_alone_after"] = {"error": first["error"], "wall_s": first["wall_s"]}
    return jobs
