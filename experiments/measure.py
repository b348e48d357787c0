"""Measurement helpers shared by experiments/benchmark.py and experiments/scaling.py."""

import math
import resource
import time

import device_lock
import jax
import jax.numpy as jnp


def configure_host(config) -> str:
    """The run's ``cpu_buffers`` setting applied as the CLI applies it (grpo_jax/host.py),
    before anything starts jax; returns it for the results. A config without the field (a
    checkout from before it, e.g. roofline.py's --before side) keeps jax's and glibc's
    defaults, "release"."""
    if "cpu_buffers" not in config:
        return "release"
    from grpo_jax import host

    applied = host.configure(config)
    return config.cpu_buffers if applied or config.cpu_buffers == "release" else "not applied"


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

    The compile holds device_lock.shared(), the warm-up and timed steps device_lock.timed()
    (no-ops unless gpu_suite.py runs children side by side).

    Returns (compiled, state, last metrics, compile seconds, per-step seconds)."""
    with device_lock.shared():
        t0 = time.perf_counter()
        if hasattr(jitted_step, "lower"):
            compiled = jitted_step.lower(state, inputs).compile()
        else:
            compiled = None
            state, _ = jax.block_until_ready(jitted_step(state, inputs))
        compile_s = time.perf_counter() - t0
    run = compiled if compiled is not None else jitted_step
    times, metrics = [], None
    with device_lock.timed():
        for _ in range(warmup):
            state, _ = jax.block_until_ready(run(state, inputs))
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


def _sub_jaxprs(eqn):
    """(jaxpr, multiplier) of every sub-computation of one equation."""
    name, p = eqn.primitive.name, eqn.params
    if name == "cond":  # one branch runs: the most expensive one bounds it
        return [(max((br.jaxpr for br in p["branches"]), key=matmul_flops_of), 1)]
    times = p["length"] if name == "scan" else 1
    if name == "shard_map":  # the body sees one device's block; every device runs it
        times = p["mesh"].size
    out = []
    for v in p.values():
        for x in v if isinstance(v, (tuple, list)) else (v,):
            inner = getattr(x, "jaxpr", x)
            if hasattr(inner, "eqns"):
                out.append((inner, times))
    return out


def executed_dots(jaxpr, times: int = 1):
    """(dot_general equation, how many times it runs) for every matmul a jaxpr executes: a
    scan's body runs ``length`` times, a while loop's once (its trip count is not static)."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            yield eqn, times
        for sub, n in _sub_jaxprs(eqn):
            yield from executed_dots(sub, times * n)


def matmul_flops_of(jaxpr, batched: bool | None = None) -> int:
    """Matmul FLOPs (2·M·N·K per dot_general) a jaxpr executes, loops included
    (executed_dots). ``batched``: None counts every dot_general, True only those with batch
    dimensions (attention's scores and values), False only those without (the dense layers)."""
    total = 0
    for eqn, times in executed_dots(jaxpr):
        (lc, _), (lb, _) = eqn.params["dimension_numbers"]
        if batched is None or batched == bool(lb):
            contracted = math.prod(eqn.invars[0].aval.shape[d] for d in lc)
            total += times * 2 * math.prod(eqn.outvars[0].aval.shape) * contracted
    return total


def step_flops(fn, *args, compiled=None):
    """The FLOPs of one call of ``fn(*args)``.

    ``matmul_flops``: every dot_general the traced program executes, each scan body counted
    ``length`` times (the rollout's decode loop, the μ updates, the member chunks) and the
    backward pass's recomputation included: the work the hardware does, the roofline's
    numerator. ``xla_flops``: XLA's own cost analysis of the compiled executable (all ops, but a
    loop body counted once, whatever its trip count: a lower bound for a step with loops)."""
    out = {"matmul_flops": int(matmul_flops_of(jax.make_jaxpr(fn)(*args).jaxpr))}
    if compiled is not None:
        ca = compiled.cost_analysis()
        ca = ca[0] if isinstance(ca, (list, tuple)) else ca
        if ca and "flops" in ca:
            out["xla_flops"] = int(ca["flops"])
    return out


def matmul_peak(shapes, dtype="float32", repeats=50, runs=5):
    """This device's achieved matmul GFLOP/s at each (M, K, N) in ``shapes``: ``repeats``
    matmuls in one jitted scan (each input shifted by the step index, so XLA cannot hoist them),
    best of ``runs``. Returns ({"MxKxN": GFLOP/s}, the best of them)."""
    rates = {}
    for m, k, n in shapes:
        x = jnp.ones((m, k), dtype)
        w = jnp.full((k, n), 0.01, dtype)

        def body(acc, i, x=x, w=w):
            # the barrier keeps the shift a kernel of its own, out of the matmul: without it an
            # H200 spent over 2 minutes compiling a GEMM fusion of this loop (the fix is
            # unverified on a GPU; gpu_suite's per-dtype time limit is the guarantee)
            return acc + jax.lax.optimization_barrier(x + i.astype(x.dtype)) @ w, None

        loop = jax.jit(lambda acc, x=x: jax.lax.scan(body, acc, jnp.arange(repeats))[0])
        acc = jnp.zeros((m, n), dtype)
        with device_lock.shared():
            timed(loop, acc)  # compiles
        with device_lock.timed():
            _, times = timed(loop, acc, runs=runs)
        rates[f"{m}x{k}x{n}"] = 2 * m * k * n * repeats / min(times) / 1e9
    return rates, max(rates.values())
