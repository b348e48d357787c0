"""experiments/device_lock.py: the GPU suite's children take turns on the device for their
timed sections while their compiles overlap. Real processes, real flocks."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "experiments"))
import device_lock  # noqa: E402

# each child: wait for all, then twice a 0.6 s "compile" (shared) and a 0.2 s "timing"
CHILD = """
import os, sys, time
from pathlib import Path
sys.path.insert(0, sys.argv[1])
import device_lock
ready = Path(sys.argv[2])
(ready / str(os.getpid())).touch()
while len(list(ready.iterdir())) < int(sys.argv[3]):
    time.sleep(0.01)
for _ in range(2):
    with device_lock.shared():
        time.sleep(0.6)
    with device_lock.timed():
        time.sleep(0.2)
"""


def overlap(a: dict, b: dict) -> float:
    return min(a["end"], b["end"]) - max(a["start"], b["start"])


def test_timed_sections_run_alone_and_compiles_side_by_side(tmp_path):
    lock, ready, n = tmp_path / "lock", tmp_path / "ready", 3
    ready.mkdir()
    env = {**os.environ, device_lock.ENV: str(lock)}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", CHILD, str(ROOT / "experiments"), str(ready), str(n)], env=env
        )  # fmt: skip
        for _ in range(n)
    ]
    assert [p.wait(timeout=120) for p in procs] == [0] * n
    rows = [json.loads(ln) for ln in (lock / "sections.jsonl").read_text().splitlines()]
    summary = device_lock.summary(lock)
    assert summary["processes"] == n and summary["timed_overlap_s"] == 0, summary
    assert summary["timed"]["sections"] == summary["shared"]["sections"] == 2 * n
    assert abs(summary["timed"]["held_s"] - 2 * n * 0.2) < 0.5 * n, summary
    timed = [r for r in rows if r["kind"] == "timed"]
    assert all(overlap(a, b) <= 0 for a in timed for b in rows if b["pid"] != a["pid"])
    # the compiles did overlap: shared really is shared, not a second exclusive lock
    shared = [r for r in rows if r["kind"] == "shared"]
    assert max(overlap(a, b) for a in shared for b in shared if a["pid"] != b["pid"]) > 0.1


# two "compilers" keep the device shared without a gap for 3 s; a "timer" asks at 0.5 s
CHAIN = """
import os, sys, time
sys.path.insert(0, sys.argv[1])
import device_lock
start, role = float(sys.argv[2]), sys.argv[3]
time.sleep(max(0.0, start + {"b": 0.0, "c": 0.15, "t": 0.5}[role] - time.time()))
if role == "t":
    with device_lock.timed():
        pass
else:
    for _ in range(10):
        with device_lock.shared():
            time.sleep(0.3)
"""


def test_a_waiting_timing_goes_ahead_of_later_compiles(tmp_path):
    """Shared flocks alone would let overlapping compiles starve a timing for the whole
    chain; the gate puts it in line, so it waits only for the compiles already running."""
    env = {**os.environ, device_lock.ENV: str(tmp_path)}
    start = str(time.time() + 2.0)  # every process started by then, even on a loaded machine
    procs = {
        role: subprocess.Popen(
            [sys.executable, "-c", CHAIN, str(ROOT / "experiments"), start, role], env=env
        )
        for role in "bct"
    }
    assert all(p.wait(timeout=120) == 0 for p in procs.values())
    rows = [json.loads(ln) for ln in (tmp_path / "sections.jsonl").read_text().splitlines()]
    (timing,) = [r for r in rows if r["kind"] == "timed"]
    chain_end = max(r["end"] for r in rows if r["kind"] == "shared")
    assert timing["waited_s"] < 1.0 and timing["end"] < chain_end - 1.0, (timing, chain_end)


def test_without_the_variable_both_are_no_ops(tmp_path, monkeypatch):
    monkeypatch.delenv(device_lock.ENV, raising=False)
    with device_lock.shared():
        with device_lock.timed():  # nesting is harmless when nothing is locked
            pass
    assert device_lock.report() == {}


def test_sections_do_not_nest_within_one_process(tmp_path, monkeypatch):
    """A second flock from the same process would wait on its own first one: refused."""
    monkeypatch.setenv(device_lock.ENV, str(tmp_path))
    with device_lock.shared():
        with pytest.raises(RuntimeError, match="do not nest"):
            with device_lock.timed():
                pass
    with device_lock.timed():  # the refused one left nothing held
        pass
    assert set(device_lock.report()["device_lock_wait_s"]) == {"shared", "timed"}
    assert device_lock.summary(tmp_path)["timed"]["sections"] == 1
