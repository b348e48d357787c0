"""The host process around XLA:CPU: reuse each step's scratch memory instead of faulting it in.

XLA:CPU gives every execution of a program one temp buffer (the TRL-comparable step's update
alone: 350 MiB) and frees it when the call returns. glibc serves a block that large with a fresh
``mmap`` and unmaps it on ``free``, so every step page-faults its whole scratch back in, one
zeroed 4 KiB page at a time: about 97,000 minor faults per update call, a quarter of its time
on a 2-core CPU. Telling glibc to keep freed memory is not enough by itself: with jax's
asynchronous CPU dispatch the program runs on a worker thread, and a worker thread's malloc
arena cannot hold a block over 64 MiB, which glibc then mmaps whatever it is told.

``retain_cpu_buffers()`` (``config.cpu_buffers="retain"``, the default) changes both, once, in
the process's entry point before jax starts its CPU backend:

  * ``jax_cpu_enable_async_dispatch=False``: a single-device program runs on the calling
    thread, whose allocations come from glibc's main arena (a multi-device program, e.g. a
    mesh of CPU devices, is still dispatched asynchronously);
  * ``mallopt(M_MMAP_MAX, 0)`` and ``mallopt(M_TRIM_THRESHOLD, 2 GiB - 1)``: the main arena
    serves large blocks from its heap and keeps up to 2 GiB of freed memory, so the next call
    reuses the pages the last one mapped.

Measured on a 2-core CPU (experiments/results/roofline_cpu.md, ``release`` and ``retain``
alternating in one run, medians of 3 rounds): the TRL-comparable step 0.528 -> 0.482 s, the
plain exhaustive step 1.334 -> 1.223 s, the plain sampled step 0.125 -> 0.116 s. Whether a
process faults without these settings depends on where glibc happens to place the scratch: the
main job's trainer at c2b650e did not (7 min 39 s for 300 steps, 7 min 22 s now). The costs:
the process keeps its peak heap instead of returning it between steps, and the host
cannot queue a step while the previous one runs (the trainer reads every step's loss before
the next anyway). On a GPU or TPU the accelerator's memory is unaffected; the settings touch
only host allocations and the CPU client. Without glibc (macOS, musl) only the dispatch
setting applies, and it alone does not remove the faults.
"""

import ctypes
import ctypes.util
import platform

from absl import logging

from grpo_jax.run_spec import cpu_buffers

_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4  # glibc's mallopt parameter numbers (malloc.h)
_KEEP_FREED = 2**31 - 1  # bytes of freed memory glibc keeps (mallopt takes an int)


def _glibc():
    """glibc as a ctypes library, or None on another C library."""
    if platform.libc_ver()[0] != "glibc":
        return None
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")


def retain_cpu_buffers() -> list[str]:
    """Run single-device programs on the calling thread and keep freed memory in glibc's main
    arena (see the module docstring). Call once, before jax creates its CPU backend; returns
    what it set. Later calls change nothing jax has already read (the dispatch setting is read
    when the backend starts), so the function refuses them instead of doing half of it."""
    import jax
    from jax._src import xla_bridge

    if xla_bridge.backends_are_initialized():
        raise RuntimeError(
            "cpu_buffers=retain must be set before jax starts its backends; call "
            "host.retain_cpu_buffers() before the first jax computation, or set "
            "config.cpu_buffers='release'"
        )
    jax.config.update("jax_cpu_enable_async_dispatch", False)
    done = ["jax_cpu_enable_async_dispatch=False"]
    libc = _glibc()
    if libc is not None:
        if libc.mallopt(_M_MMAP_MAX, 0) != 1 or libc.mallopt(_M_TRIM_THRESHOLD, _KEEP_FREED) != 1:
            raise RuntimeError("glibc refused mallopt(M_MMAP_MAX / M_TRIM_THRESHOLD)")
        done.append(f"glibc mallopt M_MMAP_MAX=0 M_TRIM_THRESHOLD={_KEEP_FREED}")
    return done


def configure(config) -> list[str]:
    """Applies ``config.cpu_buffers`` in an entry point (absent: "release", jax's and glibc's
    defaults); returns what it set, for the caller to log once it knows which process it is
    (process 0 alone logs). In a process where jax already runs (a notebook, a test calling
    the CLI) the settings can no longer take effect: one warning says so and the run goes on
    unchanged."""
    if cpu_buffers(config) != "retain":
        return []
    from jax._src import xla_bridge

    if xla_bridge.backends_are_initialized():
        logging.warning(
            "cpu_buffers=retain not applied: jax's backends already started in this process "
            "(call grpo_jax.host.retain_cpu_buffers() before any jax computation)"
        )
        return []
    return retain_cpu_buffers()
