"""Measurement helpers shared by experiments/benchmark.py and experiments/scaling.py."""

import resource
import time

import jax


def timed(fn, *args, runs=1):
    """Calls fn(*args) `runs` times with block_until_ready; returns (last output, times)."""
    times, out = [], None
    for _ in range(runs):
        t0 = time.perf_counter()
        out = jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return out, times


def time_train_step(jitted_step, state, inputs, warmup: int, steps: int):
    """Compiles a jitted (donating) train step, runs `warmup` untimed and `steps` timed steps.

    ``jitted_step`` is a ``jax.jit`` function (e.g. ``jax.jit(step.fused, donate_argnums=0)``
    or sharding.jit_step's run of a fused step), compiled ahead of time here. A step that is
    not one program (sharding.jit_step's run of an engine.Step with a Python reward: jitted
    rollout, host rewards, jitted update) has no ``lower``: its first call, compilations
    included, is timed as the compile instead, and ``compiled`` is None.

    Returns (compiled, state, last metrics, compile seconds, per-step seconds)."""
    t0 = time.perf_counter()
    if hasattr(jitted_step, "lower"):
        compiled = jitted_step.lower(state, inputs).compile()
    else:
        compiled = None
        state, _ = jax.block_until_ready(jitted_step(state, inputs))
    run = compiled if compiled is not None else jitted_step
    compile_s = time.perf_counter() - t0
    for _ in range(warmup):
        state, _ = jax.block_until_ready(run(state, inputs))
    times, metrics = [], None
    for _ in range(steps):  # one call per timing: each step consumes the state it is given
        (state, metrics), t = timed(run, state, inputs)
        times += t
    return compiled, state, metrics, compile_s, times


def memory(compiled):
    """Device peak if the backend reports one, else the step executable's own estimate
    (argument + output + temp - aliased, from XLA), else the process peak RSS."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    out = {"process_peak_rss_bytes": int(rss)}
    try:
        ma = None if compiled is None else compiled.memory_analysis()
    except Exception:  # not every backend implements it
        ma = None
    if ma is not None:
        names = ("argument", "output", "temp", "alias", "generated_code")
        sizes = {n: int(getattr(ma, f"{n}_size_in_bytes", 0)) for n in names}
        out["executable_memory"] = sizes
        out["executable_bytes"] = sizes["argument"] + sizes["output"] + sizes["temp"]
        out["executable_bytes"] -= sizes["alias"]
    stats = jax.devices()[0].memory_stats()
    if stats and "peak_bytes_in_use" in stats:
        out["peak_memory_bytes"] = int(stats["peak_bytes_in_use"])
        out["peak_memory_source"] = "device.memory_stats()[peak_bytes_in_use]"
    elif "executable_bytes" in out:
        out["peak_memory_bytes"] = out["executable_bytes"]
        out["peak_memory_source"] = "compiled.memory_analysis() argument+output+temp-alias"
    else:
        out["peak_memory_bytes"] = out["process_peak_rss_bytes"]
        out["peak_memory_source"] = "process peak RSS (ru_maxrss)"
    return out
