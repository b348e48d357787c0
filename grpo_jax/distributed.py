"""Joining a multi-process run (the launch settings, checked once, then
``jax.distributed.initialize``) and leaving it on an error.

A run with ``config.distributed=True`` is one process per host (or per group of devices),
all running the same program. Each process must learn three things before jax starts its
backend: where process 0 listens (``coordinator_address``, ``host:port``), how many
processes there are and which one it is. They come, in this order of precedence, from

* the flags ``--coordinator_address``, ``--num_processes``, ``--process_id``;
* the environment ``JAX_COORDINATOR_ADDRESS``, ``JAX_NUM_PROCESSES``, ``JAX_PROCESS_ID``
  (jax itself reads only the first of them, hence the fallback here);
* jax's own cluster detection (Cloud TPU pods, SLURM, Open MPI, Kubernetes), for whatever is
  still unset. With nothing given at all the call is the plain ``jax.distributed.initialize()``.

``local_device_ids`` restricts the devices a process sees (jax also reads
``JAX_LOCAL_DEVICE_IDS``). SLURM auto-detection sets it to ``[SLURM_LOCALID]``, one device per
task, so one task per node with 8 GPUs needs ``--local_device_ids=0,1,2,3,4,5,6,7`` to use
them all.

Process 0 alone writes the files and console lines that should appear once
(``is_main_process``): metrics, TensorBoard, samples, a task's hook files, config.json,
the eval and diagnostics lines. Checkpoints are written by every process (orbax: each
writes the shards it owns, process 0 commits).

An error raised in the training loop (a ``sys.exit`` too) leaves through ``leave_on_error``.
If every process failed on it (a non-finite loss) they exit together, as before. If it is this
process's alone, it exits after ``ERROR_WAIT_S`` instead of waiting 300 s in jax's shutdown
barrier for the others, which wait for it in the next collective. An error in process 0's own
work (hooks, metric writers) is held to the end of the step's collectives instead
(``HeldError``): process 0 leaving alone would take jax's coordination service with it.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Mapping, Sequence
from typing import NamedTuple, NoReturn

FLAGS_HINT = "--coordinator_address=HOST:PORT --num_processes=N --process_id=I"
ENV = {
    "coordinator_address": "JAX_COORDINATOR_ADDRESS",
    "num_processes": "JAX_NUM_PROCESSES",
    "process_id": "JAX_PROCESS_ID",
}


class Launch(NamedTuple):
    """How this process joins the run; None = left to jax's cluster detection."""

    coordinator_address: str | None = None
    num_processes: int | None = None
    process_id: int | None = None
    local_device_ids: tuple[int, ...] | None = None

    def given(self) -> bool:
        """Whether anything was set (by flag, or by environment once ``resolve`` read it;
        else: plain auto-detection)."""
        return any(v is not None for v in self)


def _env_int(environ: Mapping[str, str], name: str) -> int | None:
    text = environ.get(name, "").strip()
    if not text:
        return None
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{name}={text!r} is not an integer; set it to one") from None


def _check_address(address: str) -> str:
    """``host:port`` with a port in 1..65535 (``[::1]:1234`` for IPv6)."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(
            f"coordinator address {address!r} is not HOST:PORT; give process 0's host and a "
            "free port, e.g. --coordinator_address=10.0.0.1:1234"
        )
    return address


def _device_ids(ids: Sequence[str | int] | None) -> tuple[int, ...] | None:
    if ids is None:
        return None
    text = [str(i).strip() for i in ids if str(i).strip()]
    # isdecimal, not isdigit ("²" is a digit int() refuses); distinct as numbers ("0" = "00")
    numbers = [int(t) for t in text if t.isascii() and t.isdecimal()]
    if not text or len(numbers) != len(text) or len(set(numbers)) != len(numbers):
        raise ValueError(
            f"--local_device_ids={','.join(map(str, ids))} must be distinct device numbers "
            "separated by commas, e.g. --local_device_ids=0,1,2,3"
        )
    return tuple(numbers)


def _pick(flag_value, name: str, environ: Mapping[str, str], as_int: bool):
    """(value, where it came from): the flag, else its environment variable, else None."""
    if flag_value is not None:
        return flag_value, f"--{name}"
    env = ENV[name]
    if as_int:
        return _env_int(environ, env), env
    return environ.get(env, "").strip() or None, env


def resolve(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    local_device_ids: Sequence[str | int] | None = None,
    environ: Mapping[str, str] = os.environ,
) -> Launch:
    """The launch settings: each flag, else its environment variable; checked, so that a bad
    value is one ValueError line (naming the flag or variable it came from) rather than a
    hang or a traceback inside jax."""
    address, _ = _pick(coordinator_address or None, "coordinator_address", environ, False)
    n, n_from = _pick(num_processes, "num_processes", environ, True)
    i, i_from = _pick(process_id, "process_id", environ, True)
    if address is not None:
        _check_address(address)
    if n is not None and n < 1:
        raise ValueError(f"{n_from}={n} must be >= 1 (the number of processes)")
    if i is not None and (i < 0 or (n is not None and i >= n)):
        upper = f" and < {n_from}={n}" if n is not None else ""
        raise ValueError(f"{i_from}={i} must be >= 0{upper}: processes are numbered 0, 1, ..., N-1")
    return Launch(address, n, i, _device_ids(local_device_ids))


def check_config(launch: Launch, distributed: bool) -> None:
    """Launch flags without ``config.distributed=True`` would be silently ignored: refuse.
    ``launch`` holds the flags only (``resolve(..., environ={})``): the environment variables
    are neither checked nor read unless the run is distributed, since a cluster may set them
    for other programs."""
    if launch.given() and not distributed:
        raise ValueError(
            "--coordinator_address/--num_processes/--process_id/--local_device_ids only apply "
            "to a multi-process run; add --config.distributed=True"
        )


# jax's messages when a setting is missing and no cluster supplies it (jax/_src/distributed.py)
_MISSING = ("coordinator_address should be defined", "must be defined")


def initialize(launch: Launch) -> None:
    """``jax.distributed.initialize`` with what ``launch`` sets, before jax starts its backend.

    On CPU, cross-process collectives need an implementation: gloo, jax's default in recent
    versions; where it is unset (older jax), the first cross-process all-reduce would fail, so
    a CPU run of the README's command needs no jax setting from its user."""
    import jax

    if getattr(jax.config, "jax_cpu_collectives_implementation", "gloo") is None:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    ids = None if launch.local_device_ids is None else list(launch.local_device_ids)
    try:
        if launch.given():
            jax.distributed.initialize(
                coordinator_address=launch.coordinator_address,
                num_processes=launch.num_processes,
                process_id=launch.process_id,
                local_device_ids=ids,
            )
        else:  # TPU pods, SLURM, Open MPI: jax finds everything itself
            jax.distributed.initialize()
    except ValueError as e:
        if not any(m in str(e) for m in _MISSING):
            raise
        raise ValueError(_nothing_to_join(launch)) from None


def _nothing_to_join(launch: Launch) -> str:
    """The one line for ``distributed=True`` when neither the flags, the environment nor a
    detected cluster (TPU pod, SLURM, Open MPI) say how to reach the other processes."""
    unset = [f"--{name} (or {env})" for name, env in ENV.items() if getattr(launch, name) is None]
    return (
        f"config.distributed=True but {', '.join(unset)} {'is' if len(unset) == 1 else 'are'} "
        "not set and no TPU pod or SLURM/Open MPI cluster was detected to supply them: "
        f"start every process with {FLAGS_HINT}"
    )


def is_main_process() -> bool:
    """Process 0 writes the files and console lines that should appear once: every process
    runs the same program on the same values, so the others' copies would be duplicates."""
    import jax

    return jax.process_index() == 0


# How long a process that failed in the training loop waits for the others to fail too before
# it leaves alone. Every step's collectives keep the processes within milliseconds of each other
# there, so processes that fail together (a non-finite loss) arrive at once.
ERROR_WAIT_S = 10.0
# How long the processes that follow one that left alone wait for each other (their clean-up,
# e.g. closing a checkpoint or a wandb run) before they leave, process 0 taking the coordinator.
FOLLOW_WAIT_S = 60.0
_LEFT = "grpo_jax/left_alone/"  # key-value directory: {process: its error}, who left alone
# How the error that left ``training_loop`` ends: None (none, or one process), "together",
# "alone" or "follow" (another process left alone first).
_outcome: str | None = None


@contextlib.contextmanager
def training_loop():
    """The training loop, where the processes are in step: an error that leaves it is decided
    here, at once, as every process's or this one's alone (``leave_on_error`` acts on it after
    the clean-up, which may take one process much longer than another). Outside it (building the
    task, restoring, the start-of-run evaluation, ``--mode=eval``, after the run) processes need
    not be in step, so an error there exits as before, through jax's shutdown barrier. A
    ``SystemExit`` (a user's function calling ``sys.exit``) counts as an error: on one process
    alone it would hold every process in that barrier too."""
    global _outcome
    _outcome = None
    try:
        yield
    except (Exception, SystemExit):
        if joined():
            _outcome = _decide()
        raise


class HeldError:
    """An error in process 0's own work in the training loop (a task's hook, the metric
    writers: a disk, W&B's network; a ``sys.exit`` in a hook too), held to the end of the
    step's collectives so that every process stops on it together. Raised at once, it would
    end process 0 alone, and process 0 runs jax's coordination service: jax aborts the others
    when it goes (SIGABRT). Held, process 0 finishes the step's evaluation, whose collectives
    the others are in; then ``check`` (one gather of a flag) raises on every process, before
    the step's checkpoint, as one process raises before it: process 0 its error, the others a
    RuntimeError naming it. With one process it raises at once.

    Every process enters the same ``hold`` blocks (process 1 around its no-op writer), so
    every process knows whether this step held anything: ``check`` gathers only after a step
    that did, not at every step boundary (where ``interrupts.agreed`` gathers already)."""

    def __init__(self):
        self.error: BaseException | None = None
        self.armed = False  # a hold() since the last check: the same on every process

    @contextlib.contextmanager
    def hold(self):
        self.armed = True
        try:
            yield
        except (Exception, SystemExit) as e:
            if not _several():
                raise
            if self.error is None:  # the step's first: what went wrong, not what followed
                self.error = e

    def check(self, step: int) -> None:
        """Raises if any process holds an error at this step (every process calls it at the
        same boundary). One process: nothing to gather, nothing is ever held; a step with no
        hold(): nothing to gather either."""
        armed, self.armed = self.armed, False
        if not (armed and _several()):
            return
        import numpy as np
        from jax.experimental import multihost_utils

        held = np.int32(self.error is not None)
        if not np.any(multihost_utils.process_allgather(held)):
            return
        if self.error is not None:
            raise self.error
        raise RuntimeError(
            f"process 0 stopped on an error at step {step} (a hook or a metric writer); its "
            "output shows it"
        )


def _several() -> bool:
    """A joined run of more than one process (a one-process distributed run holds nothing)."""
    return joined() and sys.modules["jax"].process_count() > 1


def _jax_state():
    """jax's distributed state (its client, process id and count): no public accessor."""
    from jax._src import distributed as jax_distributed

    return jax_distributed.global_state


def _decide() -> str:
    """ "follow" if a process already left alone (this one's collective broke when it left);
    else "together" if every process reaches this barrier within ERROR_WAIT_S, "alone" if not."""
    client = _jax_state().client
    if client.key_value_dir_get(_LEFT):
        return "follow"
    try:
        client.wait_at_barrier("grpo_jax/failed_together", int(ERROR_WAIT_S * 1000))
        return "together"
    except Exception:  # jax raises a bare JaxRuntimeError (DEADLINE_EXCEEDED)
        return "alone"


def joined() -> bool:
    """Whether this process joined a multi-process run (``initialize`` ran). Read from
    ``sys.modules``: the CLI's early errors come before jax is imported, and importing it just
    to ask would cost them a second."""
    jax = sys.modules.get("jax")
    return jax is not None and jax.distributed.is_initialized()


def fails_fast() -> bool:
    """Whether this process's error ends through ``leave_on_error`` rather than jax's shutdown:
    a multi-process run's error, raised in its training loop, that was not every process's
    (``training_loop`` decides only in a joined run)."""
    return _outcome in ("alone", "follow")


def leave_on_error(message: str) -> None:
    """Ends this process (exit status 1) now if ``fails_fast()``; else returns, for the caller's
    normal exit.

    jax's exit handler shuts the distributed client down through a barrier every process must
    reach. A process whose error was its own (a reward function, a hook or a disk failing on one
    host) waited there 300 s while the others waited for it in the next collective, and then
    all of them aborted. Instead, a process that failed alone (``training_loop``) records its
    message and exits without jax's shutdown. On CPU the others' gloo collective then fails at
    once ("Connection closed by peer") and they follow (``_follow``); over NCCL they wait for
    jax's heartbeat time-out. When process 0 leaves alone, the coordinator goes with it and jax
    aborts the others. Checkpoints: the trainer's ``finally`` closes the manager, which waits
    for orbax's cross-process commit, before the error reaches here."""
    if not fails_fast():
        return
    state = _jax_state()
    if _outcome == "alone":
        state.client.key_value_set(f"{_LEFT}{state.process_id}", message)
        _exit_now()
    _follow(state.client, state.num_processes)


def _follow(client, num_processes: int) -> NoReturn:
    """Leaves after a process that left alone, naming it. The survivors leave together:
    process 0's exit takes the coordinator with it, and jax would abort a survivor still
    cleaning up before it printed its line."""
    gone = {int(k.rsplit("/", 1)[-1]): message for k, message in client.key_value_dir_get(_LEFT)}
    first = min(gone)
    print(f"process {first} ended on its own error: {gone[first]}", file=sys.stderr)
    survivors = [i for i in range(num_processes) if i not in gone]
    with contextlib.suppress(Exception):  # a survivor stuck elsewhere: leave anyway
        client.wait_at_barrier("grpo_jax/followed", int(FOLLOW_WAIT_S * 1000), survivors)
    _exit_now()


def _exit_now() -> NoReturn:
    """Exit status 1 without jax's exit handler (its shutdown barrier), output flushed."""
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(1)
