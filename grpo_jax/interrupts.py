"""SIGINT and SIGTERM during training: finish the step, save, exit with one line.

A preempted TPU VM or a cluster's time limit sends SIGTERM; a user presses Ctrl-C. Python's
defaults lose every step since the last periodic checkpoint (SIGTERM) or unwind from wherever
the KeyboardInterrupt lands, inside XLA's compiler included (a segmentation fault once in a
few tries). ``deferred()`` instead only records the signal; the loop checks ``requested()``
between steps, saves, and raises ``Interrupted``, which the CLI turns into one line and
exit status 128 + signum. A second signal exits at once. The handlers are installed only for
the duration of a training run and restored afterwards, so importing the library in a
notebook or another program changes no signal handling.

On several processes the loop stops on ``agreed()`` instead: one process's signal stops every
process at the same step. A scheduler signals each host at its own moment, or only one host
when one is preempted; a process that stopped on its own signal would save alone while the
others waited in the next step's collectives until jax's time-outs aborted them all, without
the checkpoint.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading

SIGNALS = (signal.SIGINT, signal.SIGTERM)
_pending: list[int] = []  # the signals received while a run's handlers are installed
_depth = 0  # nested runs (the warm-up's pretraining inside a train run) share the handlers


class Interrupted(KeyboardInterrupt):
    """Training stopped on a signal at ``step``, saved unless ``saved`` is False (a damaged
    folder of that step that could not be set aside); ``exit_code`` = 128 + signum."""

    def __init__(self, signum: int, step: int, saved: bool = True):
        self.signum, self.step, self.exit_code = signum, step, 128 + signum
        what = (
            "checkpoint saved, rerun the same command to resume"
            if saved
            else f"not saved (checkpoint step {step} is damaged: move its folder aside), "
            "rerun the same command to resume from the latest intact checkpoint"
        )
        super().__init__(f"interrupted by {signal.Signals(signum).name} at step {step}: {what}")


def requested() -> int | None:
    """The first signal received since the run started, or None."""
    return _pending[0] if _pending else None


def agreed() -> int | None:
    """The signal every process stops on at this step boundary, or None; every process calls
    it at the same boundaries. One process: ``requested()``. Several: the first process's
    signal in a gather of every process's, one int each, so all of them stop together (the
    processes that received none stop on it too). That gather is the boundary's one extra
    cross-process collective, on multi-process runs only."""
    import jax
    import numpy as np
    from jax.experimental import multihost_utils

    local = requested()
    if jax.process_count() == 1:
        return local
    seen = np.ravel(multihost_utils.process_allgather(np.int32(local or 0)))
    return next((int(s) for s in seen if s), None)


def _handler(signum, frame):
    if _pending:  # the second one: the user (or the scheduler) will not wait for the save
        name = signal.Signals(signum).name
        sys.stderr.write(f"{name} again: exiting at once, without saving\n")
        sys.stderr.flush()
        os._exit(128 + signum)
    _pending.append(signum)


@contextlib.contextmanager
def deferred():
    """Defers SIGINT/SIGTERM to ``requested()`` for the duration of the block."""
    global _depth
    if threading.current_thread() is not threading.main_thread():
        yield  # signal handlers can only be set from the main thread: leave them alone
        return
    # A signal the parent set to be ignored stays ignored: a shell starts background jobs with
    # SIGINT ignored, and Ctrl-C in that terminal is not meant for them.
    watched = [s for s in SIGNALS if signal.getsignal(s) is not signal.SIG_IGN]
    previous = {} if _depth else {s: signal.signal(s, _handler) for s in watched}
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1
        if not _depth:
            for s, handler in previous.items():
                signal.signal(s, handler)
            _pending.clear()
