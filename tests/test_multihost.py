"""The entry point on several devices and several processes, run as a user runs it.

One process with 8 fake CPU devices on the mesh (data=2, member=4) is the reference. Against
it: the same command on (data=1, member=1) and its step-2 checkpoint resumed on other meshes
(tests/_sharding_check.py resume); and the README's multi-process command, 2 processes x 4
CPU devices on localhost (``--config.distributed=True --coordinator_address=127.0.0.1:PORT
--num_processes=2 --process_id=P``, CPU collectives over gloo), which must log the same
losses, write every output file once, keep process 1 quiet, and resume on its own mesh.

Every subprocess shares one persistent compilation cache: the resumed runs load the programs
their first runs compiled (in a 2-process run, process 0 writes the cache and both read it).
"""

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest
from _sharding_check import run_python
from conftest import signal_after

from grpo_jax import checkpoint as ckpt_lib
from grpo_jax import distributed as dist
from grpo_jax import main

ROOT = Path(__file__).resolve().parents[1]
CHECK = ROOT / "tests" / "_sharding_check.py"
TOL = 1e-5
COMMON = [
    "--config=shakespeare:tiny",
    "--config.train.batch_size=8",
    "--config.train.num_steps=4",
    "--config.train.checkpoint_every=2",
    "--config.train.eval_every=100",  # one evaluation: at the last step
    "--config.eval.num_windows=8",
]
MESH24 = ["--config.mesh.data=2", "--config.mesh.member=4"]
# absl's log-line prefix, e.g. "I1122 03:20:59.229493 140217969466240 trainer.py:95] ...".
ABSL_LOG_LINE = re.compile(r"^[IWE]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ (\S+):\d+\]")


def _env(cache, devices: int, shakespeare_path) -> dict:
    env = {
        k: v
        for k, v in os.environ.items()
        # a launcher's variables would make jax join (or look for) another run
        if not k.startswith(("JAX_", "SLURM_", "OMPI_", "PMI_", "TPU_"))
    }
    env.update(
        XLA_FLAGS=(
            os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={devices}"
            # CPU codegen effort only: every run of a comparison uses the same flags
            " --xla_backend_optimization_level=0"
        ).strip(),
        JAX_PLATFORMS="cpu",
        JAX_COMPILATION_CACHE_DIR=str(cache),
        JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
        JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0",
        GRPO_JAX_DATA=str(shakespeare_path),
        PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
    )
    return env


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("xla_cache")


@pytest.fixture(scope="module")
def env8(cache, shakespeare_path):
    return _env(cache, 8, shakespeare_path)


@pytest.fixture(scope="module")
def env4(cache, shakespeare_path):
    return _env(cache, 4, shakespeare_path)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(args, env, logs: Path, n=2, timeout=300, wait=True, entry=("-m", "grpo_jax.main")):
    """The README's multi-process command, once per process; returns each one's output
    (stdout + stderr). A process that fails or hangs fails the test, and none is left.
    ``wait=False``: the running processes instead, for ``finish``. ``entry``: what Python
    runs, the CLI's module by default."""
    port = _free_port()
    logs.mkdir(parents=True, exist_ok=True)
    procs = []
    for i in range(n):
        with open(logs / f"process{i}.log", "w") as log:
            procs.append(
                subprocess.Popen(
                    [sys.executable, *entry, *args, "--config.distributed=True"]
                    + [f"--coordinator_address=127.0.0.1:{port}", f"--num_processes={n}"]
                    + [f"--process_id={i}"],
                    cwd=ROOT,
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            )
    if not wait:
        return procs
    codes, outputs = finish(procs, logs, timeout)
    for i, (code, out) in enumerate(zip(codes, outputs, strict=True)):
        assert code == 0, f"process {i} exited {code}:\n{out[-4000:]}"
    return outputs


def finish(procs, logs: Path, timeout: int):
    """(exit codes, outputs) of ``launch(..., wait=False)``'s processes; a process still
    running after ``timeout`` seconds fails the test, and none is left."""
    try:
        codes = [p.wait(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return codes, [(logs / f"process{i}.log").read_text() for i in range(len(procs))]


def _rows(path: Path):
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def _losses(workdir: Path) -> dict:
    rows = [r for r in _rows(workdir / "metrics.jsonl") if "loss" in r]
    steps = [r["step"] for r in rows]
    assert len(steps) == len(set(steps)), steps  # a step logged twice
    return {r["step"]: r["loss"] for r in rows}


@pytest.fixture(scope="module")
def one_process(env8, tmp_path_factory):
    """1 process x 8 devices on (data=2, member=4): the reference run."""
    workdir = tmp_path_factory.mktemp("one_process") / "run"
    run_python(
        ["-m", "grpo_jax.main", *COMMON, *MESH24, "--config.logging.tensorboard=False"]
        + [f"--workdir={workdir}"],
        env8,
    )
    return workdir


def test_entry_point_meshes_and_checkpoint_across_meshes(one_process, env8, tmp_path):
    """main.py on (data=2, member=4) logs the same losses as on (data=1, member=1); its step-2
    checkpoint resumes on a single device and on (data=8, FSDP) with the same losses."""
    single_wd = tmp_path / "mesh11"
    run_python(
        ["-m", "grpo_jax.main", *COMMON, "--config.logging.tensorboard=False"]
        + ["--config.mesh.data=1", "--config.mesh.member=1", f"--workdir={single_wd}"],
        env8,
    )
    ref, single = _losses(one_process), _losses(single_wd)
    assert sorted(ref) == [1, 2, 3, 4] and sorted(single) == [1, 2, 3, 4]
    np.testing.assert_allclose([single[s] for s in ref], [ref[s] for s in ref], atol=TOL)

    proc = run_python([CHECK, "resume", one_process, tmp_path / "resume"], env8)
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert res["single"]["devices"] == 1
    assert res["data8"]["devices"] == 8 and "data" in res["data8"]["spec"]  # FSDP over data
    for name in ("single", "data8"):
        got = res[name]["losses"]  # JSON: step keys are strings
        assert sorted(got) == ["3", "4"], (name, got)  # resumed at step 2
        np.testing.assert_allclose([got["3"], got["4"]], [ref[3], ref[4]], atol=TOL, err_msg=name)


# ------------------------------------------------------- 2 processes x 4 CPU devices


@pytest.fixture(scope="module")
def two_processes(env4, tmp_path_factory):
    """The reference's command on 2 processes x 4 devices, with TensorBoard on (its event
    files are one more writer to check)."""
    root = tmp_path_factory.mktemp("two_processes")
    outputs = launch([*COMMON, *MESH24, f"--workdir={root / 'run'}"], env4, root / "logs")
    return root / "run", outputs


def _other_lines(output: str) -> list[str]:
    """Process 1's absl log lines other than jax's own "Connecting to ..." line."""
    lines = [m for line in output.splitlines() if (m := ABSL_LOG_LINE.match(line))]
    return [m.string for m in lines if m.group(1) != "distributed.py"]


def test_two_processes_log_the_losses_of_one(one_process, two_processes):
    workdir, _ = two_processes
    ref, got = _losses(one_process), _losses(workdir)
    assert sorted(got) == [1, 2, 3, 4]
    np.testing.assert_allclose([got[s] for s in ref], [ref[s] for s in ref], atol=TOL)


def test_two_processes_write_every_file_once(two_processes):
    workdir, _ = two_processes
    files = sorted(
        str(p.relative_to(workdir))
        for p in workdir.rglob("*")
        if p.is_file() and "checkpoints" not in p.parts
    )
    events = [f for f in files if f.startswith("tb/")]
    assert len(events) == 1, files  # one TensorBoard writer
    assert [f for f in files if not f.startswith("tb/")] == [
        "char_heatmap.png",
        "char_stats.jsonl",
        "config.json",
        "config.txt",
        "metrics.jsonl",
        "samples.txt",
    ], files
    assert sorted(int(p.name) for p in (workdir / "checkpoints").iterdir()) == [2, 4]
    rows = _rows(workdir / "metrics.jsonl")
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3, 4]
    assert [r["step"] for r in rows if "eval/val_loss" in r] == [4]
    assert [r["step"] for r in _rows(workdir / "char_stats.jsonl")] == [1, 2, 3, 4]
    assert re.findall(r"=== step (\d+) ===", (workdir / "samples.txt").read_text()) == ["4"]


def test_only_process_zero_prints_eval_and_diagnostics(two_processes):
    _, (out0, out1) = two_processes
    assert "Traceback" not in out0 + out1
    # process 0 prints the mesh, the KL diagnostic (tiny's kl ~ 2 > kl_bound) and the eval
    assert out0.count("mesh(data=2, member=4) over 8 devices") == 1, out0
    assert out0.count("exceeds diagnostics.kl_bound") == 1, out0
    assert out0.count("step 4 eval:") == 1, out0
    assert _other_lines(out1) == [], out1


def test_resume_on_two_processes(one_process, two_processes, env4, tmp_path):
    """A 2-process run stopped after its step-2 checkpoint (its checkpoint and its logged
    rows up to step 2) and restarted on 2 processes continues at step 3: every step logged
    once, the losses those of the uninterrupted run."""
    source, _ = two_processes
    workdir = tmp_path / "run"
    shutil.copytree(source / "checkpoints" / "2", workdir / "checkpoints" / "2")
    kept = [line for line in (source / "metrics.jsonl").read_text().splitlines(keepends=True)]
    kept = [line for line in kept if json.loads(line)["step"] <= 2]
    (workdir / "metrics.jsonl").write_text("".join(kept))
    out0, out1 = launch(
        [*COMMON, *MESH24, "--config.logging.tensorboard=False", f"--workdir={workdir}"],
        env4,
        tmp_path / "logs",
    )
    assert out0.count("at step 2") == 1 and "resumed from" in out0, out0
    assert _other_lines(out1) == [], out1
    ref, got = _losses(one_process), _losses(workdir)
    assert sorted(got) == [1, 2, 3, 4]
    np.testing.assert_allclose([got[s] for s in ref], [ref[s] for s in ref], atol=TOL)
    assert sorted(int(p.name) for p in (workdir / "checkpoints").iterdir()) == [2, 4]
    assert [r["step"] for r in _rows(workdir / "char_stats.jsonl")] == [3, 4]


def test_a_signal_to_one_process_stops_every_process_at_one_step(env4, tmp_path):
    """A scheduler signals each host at its own moment, or only one (a preempted host): here
    process 1 alone gets SIGTERM mid-run. Every process stops at the same step, saves it and
    exits 143. Before interrupts.agreed, process 1 stopped alone while process 0 went on into
    the next step's collectives: both aborted, on a gloo collective mismatch and jax's
    heartbeat (about 90 s) or on its shutdown barrier (300 s), and the stop step was saved
    only where the checkpoint cadence had just saved it."""
    workdir, logs = tmp_path / "run", tmp_path / "logs"
    common = [a for a in COMMON if not a.startswith("--config.train.num_steps=")]
    args = [*common, *MESH24, "--config.train.num_steps=200", f"--workdir={workdir}"]
    procs = launch(args, env4, logs, wait=False)
    signal_after(procs, workdir, 2, signal.SIGTERM, to=procs[1])
    codes, outputs = finish(procs, logs, timeout=120)
    steps = [
        re.findall(r"interrupted by SIGTERM at step (\d+): checkpoint saved", out)
        for out in outputs
    ]
    assert codes == [143, 143] and steps[0] == steps[1] and len(steps[0]) == 1, (codes, outputs)
    step = int(steps[0][0])
    assert 2 <= step < 200 and ckpt_lib.latest_step_of(workdir / "checkpoints") == step
    assert max(r["step"] for r in _rows(workdir / "metrics.jsonl")) == step


# The CLI with an injected error on process FAIL_ON ("all": every process): a RuntimeError (bad
# input: the CLI's one error line) or a TypeError (a bug: its traceback), raised in the training
# loop as step FAIL_AT ends (after its checkpoint, before its step boundary's gather), or
# FAIL_AT=end: once the run has ended.
FAILING_CLI = """
import os
from grpo_jax import main, metric_writers, trainer
def fail():
    import jax
    if os.environ["FAIL_ON"] in ("all", str(jax.process_index())):
        raise {"RuntimeError": RuntimeError, "TypeError": TypeError}[os.environ["FAIL_AS"]](
            "injected")
update, loop = metric_writers.ProgressBar.update, trainer._loop
write = metric_writers.MetricWriter.write_scalars
def failing_update(self, step, **figures):
    if os.environ["FAIL_IN"] == "bar" and str(step) == os.environ["FAIL_AT"]:
        fail()
    return update(self, step, **figures)
def failing_write(self, step, scalars):  # process 0's own work: its metric writer
    if os.environ["FAIL_IN"] == "writer" and str(step) == os.environ["FAIL_AT"]:
        fail()
    return write(self, step, scalars)
def failing_loop(*args):
    out = loop(*args)
    if os.environ["FAIL_AT"] == "end":
        fail()
    return out
metric_writers.ProgressBar.update, trainer._loop = failing_update, failing_loop
metric_writers.MetricWriter.write_scalars = failing_write
main.cli()
"""


@pytest.mark.parametrize(
    "fail_on, fail_as, fail_at, fail_in",
    [
        ("1", "TypeError", "4", "bar"),
        ("all", "RuntimeError", "2", "bar"),
        ("1", "RuntimeError", "end", "bar"),
        ("0", "TypeError", "4", "writer"),
    ],
)
def test_an_error_on_one_process_ends_every_process_at_once(
    env4, tmp_path, fail_on, fail_as, fail_at, fail_in
):
    """An error on process 1 alone in the training loop (a user's function raising on one
    host), here in the last step after its checkpoint: process 1 exits after
    dist.ERROR_WAIT_S, and process 0, waiting for it in the step's gather, at once, naming
    process 1 and its error. Before, process 1 waited 300 s in jax's shutdown barrier for
    process 0, which waited for it in the collective; or, with no gather after the last step,
    process 0 finished and jax's heartbeat time-out killed it 100 s later. An error on every
    process (a non-finite loss) ends each with its own line. An error outside the loop exits
    as before, through jax's shutdown barrier, which the other process reaches when its run
    ends: it exits 0. An error in process 0's own work (its metric writer, a task's hook) is
    held to the end of the step's collectives, and every process stops there together, before
    the step's checkpoint (4 is not saved, as on one process): process 0 leaving alone took
    jax's coordination service with it, and jax aborted process 1 (SIGABRT)."""
    workdir, logs = tmp_path / "run", tmp_path / "logs"
    env = {**env4, "FAIL_ON": fail_on, "FAIL_AS": fail_as, "FAIL_AT": fail_at, "FAIL_IN": fail_in}
    args = [*COMMON, *MESH24, f"--workdir={workdir}"]
    procs = launch(args, env, logs, wait=False, entry=("-c", FAILING_CLI))
    codes, (out0, out1) = finish(procs, logs, timeout=120)
    assert codes == ([0, 1] if fail_at == "end" else [1, 1]), (codes, out0[-3000:], out1[-3000:])
    kept = 2 if fail_at == "2" or fail_in == "writer" else 4  # saved before the error
    assert ckpt_lib.latest_step_of(workdir / "checkpoints") == kept
    if fail_in == "writer":
        assert "TypeError: injected" in out0  # its traceback
        assert "error: process 0 stopped on an error at step 4" in out1
        assert "ended on its own error" not in out0 + out1
    elif fail_as == "TypeError":
        assert "TypeError: injected" in out1  # its traceback
        assert "process 1 ended on its own error: TypeError: injected" in out0
    else:
        for out in (out0, out1) if fail_on == "all" else (out1,):
            assert out.count("error: injected") == 1
        assert "ended on its own error" not in out0 + out1


@pytest.mark.parametrize(
    "decided, left", [("alone", ["SystemExit: a hook gave up"]), ("together", [])]
)
def test_sys_exit_in_the_loop_is_decided_as_an_error(monkeypatch, capsys, decided, left):
    """A user's function calling ``sys.exit`` in the training loop: on one process alone it leaves
    as an error does (training_loop decides, main ends it through leave_on_error, traceback
    first); on every process it exits as asked, through jax's shutdown barrier. Before, only an
    Exception was decided: process 1 calling sys.exit alone at step 4 (the in-loop case above)
    held both processes 316 s, and then both aborted (SIGABRT). The decision and the exit are
    the ones the cases above run across processes; here they are stubbed, in this process."""
    got = []

    def run(config, workdir, mode, launch):
        with dist.training_loop():
            sys.exit("a hook gave up")

    flag_values = dict(coordinator_address=None, num_processes=None, process_id=None)
    flag_values.update(local_device_ids=None, mode="train", config=None, workdir="unused")
    monkeypatch.setattr(main, "FLAGS", types.SimpleNamespace(**flag_values))
    monkeypatch.setattr(main, "run", run)
    monkeypatch.setattr(dist, "joined", lambda: True)
    monkeypatch.setattr(dist, "_decide", lambda: decided)
    monkeypatch.setattr(dist, "_outcome", None)
    monkeypatch.setattr(dist, "leave_on_error", got.append)  # the real one exits the process
    with pytest.raises(SystemExit) as exit_:
        main.main(["grpo-jax"])
    assert exit_.value.code == "a hook gave up" and got == left
    assert ('sys.exit("a hook gave up")' in capsys.readouterr().err) == bool(left)


def test_a_held_error_is_the_first_and_raised_on_every_process(monkeypatch):
    """distributed.HeldError: on one process an error in process 0's own work raises at once,
    as before; on several the step's first is held (the writer's, not what failed after it; a
    sys.exit too, not a KeyboardInterrupt), and ``check`` raises it, or on a process holding
    none a RuntimeError naming process 0, once any process holds one; a step that held no
    work gathers nothing (the gather stubbed)."""
    from jax.experimental import multihost_utils

    def no_gather(x):
        raise AssertionError("one process gathered")

    held = dist.HeldError()
    with pytest.raises(OSError, match="disk full"), held.hold():
        raise OSError("disk full")
    monkeypatch.setattr(multihost_utils, "process_allgather", no_gather)
    held.check(3)  # one process: nothing held, nothing gathered
    monkeypatch.setattr(dist, "_several", lambda: True)
    for error in (OSError("disk full"), SystemExit("a hook gave up")):
        with held.hold():
            raise error
    with pytest.raises(KeyboardInterrupt), held.hold():
        raise KeyboardInterrupt
    flags = {"this": held, "other": dist.HeldError()}
    monkeypatch.setattr(multihost_utils, "process_allgather", no_gather)
    flags["other"].check(2)  # several processes, but a step without hold(): no gather
    for h in flags.values():  # the other process enters the same block, its writer a no-op
        with h.hold():
            pass
    monkeypatch.setattr(multihost_utils, "process_allgather", lambda x: np.array([0, 0]))
    for h in flags.values():
        h.check(3)  # nobody holds one: every process goes on
    for h in flags.values():  # the next step's held work
        with h.hold():
            pass
    monkeypatch.setattr(multihost_utils, "process_allgather", lambda x: np.array([1, 0]))
    with pytest.raises(OSError, match="^disk full$"):
        flags["this"].check(3)
    with pytest.raises(RuntimeError, match="^process 0 stopped on an error at step 3 "):
        flags["other"].check(3)


def test_a_signal_stop_raises_process_0s_failed_flush_on_every_process(monkeypatch):
    """A signal's stop (trainer._stop) flushes process 0's writer after the checkpoint; its
    failure is held like the loop's, so process 1 stops on it too (a RuntimeError naming
    process 0) instead of exiting on the signal while process 0 leaves alone, which aborted
    process 1 (SIGABRT). One process: the signal's Interrupted (the gather stubbed)."""
    from jax.experimental import multihost_utils

    from grpo_jax import interrupts, trainer

    ckpt = types.SimpleNamespace(wait=lambda: None, has_intact=lambda step: step == 2)
    writer = types.SimpleNamespace(flush=lambda: None)  # process 1's: a no-op
    stop = lambda: trainer._stop(ckpt, writer, 2, None, signal.SIGTERM, dist.HeldError())
    with pytest.raises(interrupts.Interrupted):
        stop()
    monkeypatch.setattr(dist, "_several", lambda: True)
    monkeypatch.setattr(multihost_utils, "process_allgather", lambda x: np.array([1, 0]))
    with pytest.raises(RuntimeError, match="^process 0 stopped on an error at step 2 "):
        stop()


def _one_then_two_processes(args, cache, env4, shakespeare_path, tmp_path) -> dict:
    """A 3-step run as 1 process x 4 devices, then as 2 processes x 2: their losses must be
    equal. Returns the 2-process run's {step: loss}."""
    run_python(["-m", "grpo_jax.main", *args, f"--workdir={tmp_path / 'one'}"], env4)
    launch([*args, f"--workdir={tmp_path / 'two'}"], _env(cache, 2, shakespeare_path), tmp_path)
    ref, got = _losses(tmp_path / "one"), _losses(tmp_path / "two")
    assert sorted(got) == sorted(ref) == [1, 2, 3]
    np.testing.assert_allclose([got[s] for s in ref], [ref[s] for s in ref], atol=TOL)
    return got


def test_python_rewards_on_two_processes(cache, env4, shakespeare_path, tmp_path):
    """A Python reward decodes the whole batch, of which each process holds its devices'
    shards: 2 processes x 2 devices log the losses of 1 process x 4 (before
    sharding.fetch_global both stopped with "spans non-addressable devices")."""
    args = [
        "--config=arithmetic:tiny",
        "--config.pretrain.before_train=False",
        "--config.reward.terms=correct:1.0,format:1.0",  # format: non-zero at random init
        "--config.train.num_steps=3",
        "--config.train.checkpoint_every=100",
        "--config.train.eval_every=100",
        "--config.logging.tensorboard=False",
        "--config.mesh.data=2",
        "--config.mesh.member=2",
    ]
    got = _one_then_two_processes(args, cache, env4, shakespeare_path, tmp_path)
    rewards = [r["reward"] for r in _rows(tmp_path / "two" / "metrics.jsonl") if "reward" in r]
    assert max(rewards) > 0 and max(abs(x) for x in got.values()) > 0  # a non-trivial check


def test_pretraining_on_two_processes(cache, env4, shakespeare_path, tmp_path):
    """A supervised step splits its batch over ``data`` as GRPO's does: 2 processes x 2
    devices log the pretraining losses of 1 process x 4 on (data=4)."""
    args = [
        "--config=shakespeare:tiny",
        "--mode=pretrain",
        "--config.pretrain.batch_size=8",
        "--config.train.checkpoint_every=100",
        "--config.train.eval_every=100",
        "--config.logging.tensorboard=False",
        "--config.mesh.data=4",
        "--config.mesh.member=1",
    ]
    _one_then_two_processes(args, cache, env4, shakespeare_path, tmp_path)


# ------------------------------------------------------------------ launch settings


def test_launch_flags_fall_back_to_the_environment():
    env = {"JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234", "JAX_NUM_PROCESSES": "2"}
    env["JAX_PROCESS_ID"] = "1"
    assert dist.resolve(environ=env) == dist.Launch("10.0.0.1:1234", 2, 1, None)
    # a flag wins over its variable; device ids parse
    got = dist.resolve("h:99", None, 0, ["0", "1"], environ=env)
    assert got == dist.Launch("h:99", 2, 0, (0, 1))
    assert dist.resolve(environ={}) == dist.Launch() and not dist.Launch().given()
    assert dist.resolve(local_device_ids=["3"], environ={}).given()


@pytest.mark.parametrize(
    "kwargs, environ, words",
    [
        ({"num_processes": 2, "process_id": 2}, {}, ["--process_id=2", "< --num_processes=2"]),
        ({}, {"JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "-1"}, ["JAX_PROCESS_ID=-1"]),
        ({"num_processes": 0}, {}, ["--num_processes=0", ">= 1"]),
        ({}, {"JAX_NUM_PROCESSES": "two"}, ["JAX_NUM_PROCESSES='two'", "integer"]),
        ({"coordinator_address": "localhost"}, {}, ["'localhost'", "HOST:PORT"]),
        ({"coordinator_address": "h:0"}, {}, ["'h:0'", "HOST:PORT"]),
        ({"local_device_ids": ["0", "0"]}, {}, ["--local_device_ids=0,0", "distinct"]),
        ({"local_device_ids": ["a"]}, {}, ["--local_device_ids=a"]),
        ({"local_device_ids": ["1", "01"]}, {}, ["--local_device_ids=1,01", "distinct"]),
        ({"local_device_ids": ["²"]}, {}, ["--local_device_ids=²", "device numbers"]),
    ],
)
def test_bad_launch_settings_are_one_line(kwargs, environ, words):
    with pytest.raises(ValueError) as err:
        dist.resolve(**kwargs, environ=environ)
    assert "\n" not in str(err.value)
    for word in words:
        assert word in str(err.value), (word, str(err.value))


def test_cli_says_how_to_join_when_there_is_nothing_to_join(env4, tmp_path):
    """distributed=True on a lone machine, and launch flags without distributed=True: one
    error line each, naming the flags; no workdir is made. A cluster's JAX_* variables alone
    are not launch flags: the lone eval goes on (to its own error, no checkpoint)."""
    cases = {
        "nothing": ["--config.distributed=True"],
        "no_process_id": ["--config.distributed=True", "--coordinator_address=127.0.0.1:1"]
        + ["--num_processes=2"],
        "not_distributed": ["--num_processes=2", "--process_id=0"],
        # a cluster's variables (even a malformed one) do not make a lone run distributed
        "cluster_environment": ["--mode=eval"],
    }
    cluster = {"JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234", "JAX_NUM_PROCESSES": "two"}
    procs = {
        name: subprocess.Popen(
            [sys.executable, "-m", "grpo_jax.main", "--config=shakespeare:tiny", *args]
            + [f"--workdir={tmp_path / name}"],
            cwd=ROOT,
            env={**env4, **(cluster if name == "cluster_environment" else {})},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for name, args in cases.items()
    }
    results = {name: p.communicate(timeout=120) + (p.returncode,) for name, p in procs.items()}
    expect = {
        "nothing": ["--coordinator_address", "--num_processes", "--process_id", "no TPU pod"],
        "no_process_id": ["--process_id (or JAX_PROCESS_ID) is not set"],
        "not_distributed": ["--config.distributed=True"],
        "cluster_environment": ["has no checkpoint to evaluate"],
    }
    for name, (_, err, code) in results.items():
        lines = [line for line in err.splitlines() if not ABSL_LOG_LINE.match(line)]
        assert code == 1 and len(lines) == 1 and lines[0].startswith("error: "), (name, err)
        for word in expect[name]:
            assert word in lines[0], (name, word, lines[0])
        assert not (tmp_path / name).exists()
