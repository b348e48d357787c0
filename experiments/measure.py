"""Measurement helpers shared by experiments/benchmark.py, profile_step.py and scaling.py: the
step built as the trainer builds it, timing, memory, and the matmul peak and floor (the FLOP
count itself is flop_count.py)."""

import functools
import re
import resource
import time

import device_lock
import jax
import jax.numpy as jnp
from flop_count import dot_flops, executed_dots, is_batched, merged_uncounted

from grpo_jax import sharding, trainer
from grpo_jax.tasks import build_task


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


def _task(config):
    """The train task, its initial params and their count, as the trainer makes them."""
    task = build_task(config, "train")
    params0 = trainer.initial_params(config, task)
    return task, params0, int(sum(x.size for x in jax.tree.leaves(params0)))


def abstract_step(config, devices):
    """The config's step as the trainer builds it on ``config.mesh`` over ``devices``, which
    this process need not have (a deviceless topology's): (jitted fused step, abstract state,
    abstract inputs, mesh, params count). The state and inputs are ShapeDtypeStructs on their
    shardings, ready to lower; nothing is placed on a device."""
    task, params0, n_params = _task(config)
    mesh = sharding.make_mesh(config.get("mesh"), devices)
    sharding.check_batch(config.train.batch_size, mesh)
    step, inputs = task.build(params0, mesh=mesh)
    if step.host is not None:
        raise ValueError(
            "a Python reward splits the step into two programs around a host call; use a "
            "jittable reward (--config.reward.terms)"
        )
    state = task.make_state(params0)
    state_sh = sharding.state_shardings(mesh, state, bool(config.mesh.shard_params))
    rep = sharding.replicated(mesh)
    spec = lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh)
    state = jax.tree.map(spec, state, state_sh)
    inputs = jax.tree.map(lambda a: spec(a, rep), inputs)
    return sharding.jit_fused(step.fused, state_sh, rep), state, inputs, mesh, n_params


def build_step(config, on_mesh: bool = True):
    """(task, step, jitted step, state, inputs, mesh, params count) as the trainer builds
    them: on config.mesh (sharded state and inputs, member shard_map) or, not ``on_mesh``,
    plain jit (mesh None)."""
    task, params0, n_params = _task(config)
    mesh = sharding.make_mesh(config.get("mesh")) if on_mesh else None
    if mesh is not None:
        sharding.check_batch(config.train.batch_size, mesh)
        step, inputs = task.build(params0, mesh=mesh)
        fsdp = bool(config.mesh.shard_params)
        jstep, state, inputs, _ = sharding.jit_step(
            step, mesh, task.make_state(params0), inputs, fsdp
        )
    else:
        step, inputs = task.build(params0)
        state = task.make_state(params0)
        if step.host is None:  # one program: rollout, rewards and update, state donated
            jstep = jax.jit(step.fused, donate_argnums=0)
        else:  # a Python reward splits the step: sharding.jit_step on one device
            one = sharding.make_mesh(None, jax.devices()[:1])
            jstep, state, inputs, _ = sharding.jit_step(step, one, state, inputs)
    return task, step, jstep, state, inputs, mesh, n_params


def timed(fn, *args, runs=1):
    """Calls fn(*args) `runs` times with block_until_ready; returns (last output, times)."""
    times, out = [], None
    for _ in range(runs):
        t0 = time.perf_counter()
        out = jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return out, times


def alternate(sides: dict, rounds: int) -> dict:
    """{name: [seconds]} of ``rounds`` alternating rounds over two sides (A B, then B A, ...:
    with an even number of rounds, each side as often first as second), where
    ``sides[name]()`` runs one round of its side and returns that round's seconds."""
    first, second = sides
    times = {first: [], second: []}
    for r in range(rounds):
        for name in (first, second) if r % 2 == 0 else (second, first):
            times[name] += sides[name]()
    return times


def alternate_calls(progs: dict, rounds: int, calls: int) -> dict:
    """{side: [seconds per call]} of two programs on fixed arguments (``progs[side]`` is
    (fn, args)): one untimed call a side, then ``rounds`` alternating rounds (alternate) of
    ``calls`` calls a side."""
    for fn, args in progs.values():
        jax.block_until_ready(fn(*args))

    def round_of(fn, args) -> list:
        return timed(fn, *args, runs=calls)[1]

    return alternate({side: functools.partial(round_of, *p) for side, p in progs.items()}, rounds)


def compile_halves(step, state, inputs, batch):
    """The task's own step in its two halves, ``step.rollout`` and ``step.update`` (on the
    rollout's batch, whose shapes ``batch`` holds), each compiled ahead of time on its own,
    not donating (the state survives every run): (rollout, update). The update is lowered on
    those shapes with the rollout's output shardings; with a Python reward the host rewards
    need a real batch, so one rollout runs here, untimed."""
    rollout = jax.jit(step.rollout).lower(state, inputs).compile()
    if step.host is None:
        host = None
        batch = jax.tree.map(
            lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh),
            batch,
            rollout.output_shardings,
        )
    else:
        batch = rollout(state, inputs)
        host = step.host(batch)
    return rollout, jax.jit(step.update).lower(state, inputs, batch, host).compile()


def compile_step(jitted_step, state, inputs):
    """Compiles a jitted (donating) train step ahead of time: (compiled, state, seconds).

    ``jitted_step`` is a ``jax.jit`` function (e.g. ``jax.jit(step.fused, donate_argnums=0)``
    or sharding.jit_step's run of a fused step). A step that is not one program
    (sharding.jit_step's run of an engine.Step with a Python reward: jitted rollout, host
    rewards, jitted update) has no ``lower``: its first call, compilations included, is timed
    as the compile instead (``state`` is then its output), and ``compiled`` is None."""
    t0 = time.perf_counter()
    if hasattr(jitted_step, "lower"):
        compiled = jitted_step.lower(state, inputs).compile()
    else:
        compiled = None
        state, _ = jax.block_until_ready(jitted_step(state, inputs))
    return compiled, state, time.perf_counter() - t0


def run_steps(run, state, inputs, warmup: int, steps: int):
    """``warmup`` untimed and ``steps`` timed calls of a (donating) step, each consuming the
    state the last returned: (state, last metrics, per-step seconds)."""
    times, metrics = [], None
    for _ in range(warmup):
        state, _ = jax.block_until_ready(run(state, inputs))
    for _ in range(steps):
        (state, metrics), t = timed(run, state, inputs)
        times += t
    return state, metrics, times


def stepping_round(side: dict, calls: int):
    """A round for ``alternate``: ``calls`` timed steps of ``side["run"]`` (run_steps), the
    state carried in ``side["state"]`` from step to step and from round to round."""

    def run() -> list:
        side["state"], _, times = run_steps(side["run"], side["state"], side["inputs"], 0, calls)
        return times

    return run


def time_train_step(jitted_step, state, inputs, warmup: int, steps: int):
    """compile_step under device_lock.shared(), then run_steps under device_lock.timed()
    (no-ops unless gpu_suite.py runs children side by side).

    Returns (compiled, state, last metrics, compile seconds, per-step seconds)."""
    with device_lock.shared():
        compiled, state, compile_s = compile_step(jitted_step, state, inputs)
    with device_lock.timed():
        run = compiled if compiled is not None else jitted_step
        state, metrics, times = run_steps(run, state, inputs, warmup, steps)
    return compiled, state, metrics, compile_s, times


def executable_memory(compiled) -> dict:
    """XLA's buffer plan for a compiled program, where the backend gives one: its sizes
    (``executable_memory``) and ``executable_bytes`` = argument + output + temp - aliased,
    the device memory the program needs; {} where it gives none."""
    try:
        ma = None if compiled is None else compiled.memory_analysis()
    except Exception:  # not every backend implements it
        ma = None
    if ma is None:
        return {}
    names = ("argument", "output", "temp", "alias", "generated_code")
    sizes = {n: int(getattr(ma, f"{n}_size_in_bytes", 0)) for n in names}
    total = sizes["argument"] + sizes["output"] + sizes["temp"] - sizes["alias"]
    return {"executable_memory": sizes, "executable_bytes": total}


def memory(compiled):
    """Device peak if the backend reports one, else the step executable's own estimate
    (argument + output + temp - aliased, from XLA), else the process peak RSS."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    out = {"process_peak_rss_bytes": int(rss)}
    out.update(executable_memory(compiled))
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


def dot_program(lhs, rhs, params: dict, repeats: int = 8):
    """(jitted program, its arguments): ``repeats`` copies of one dot_general (operand avals
    ``lhs``, ``rhs``; the equation's own ``params``) and nothing else.

    The left operand is passed ``repeats`` times as separate arguments, so XLA can neither
    merge the matmuls (its parameters are opaque) nor hoist them, and no elementwise work
    (an input shift, an accumulator) shares their time: an earlier peak loop shifted its
    input and accumulated inside a scan, which cost XLA:CPU a quarter of the rate at
    [4480, 512] @ [512, 128] (240 vs 304 GFLOP/s) and so overstated every fraction of the
    peak. One call runs all of them, so the call's dispatch is spread over ``repeats``
    matmuls; the operands stay in cache: the best the matmul unit does at this shape."""
    x = jnp.full(lhs.shape, 0.01, lhs.dtype)
    w = jnp.full(rhs.shape, 0.01, rhs.dtype)
    one = lambda x, w: jax.lax.dot_general_p.bind(x, w, **params)
    return jax.jit(lambda xs, w: [one(x, w) for x in xs]), ([x] * repeats, w)


def matmul_program(m: int, k: int, n: int, dtype="float32", repeats: int = 8):
    """dot_program of ``repeats`` [m, k] @ [k, n] matmuls (the dot jnp.matmul traces)."""
    x, w = jax.ShapeDtypeStruct((m, k), dtype), jax.ShapeDtypeStruct((k, n), dtype)
    (eqn,) = jax.make_jaxpr(jnp.matmul)(x, w).jaxpr.eqns
    return dot_program(x, w, eqn.params, repeats)


def _best_call_s(program, args, runs: int) -> float:
    with device_lock.shared():
        timed(program, *args)  # compiles
    with device_lock.timed():
        return min(timed(program, *args, runs=runs)[1])


def matmul_peak(shapes, dtype="float32", repeats=8, runs=20):
    """This device's achieved matmul GFLOP/s at each (M, K, N) in ``shapes``: one call of
    ``matmul_program`` (``repeats`` matmuls) timed ``runs`` times, the best call. Returns
    ({"MxKxN": GFLOP/s}, the best of them)."""
    rates = {}
    for m, k, n in shapes:
        best = _best_call_s(*matmul_program(m, k, n, dtype, repeats), runs)
        rates[f"{m}x{k}x{n}"] = 2 * m * k * n * repeats / best / 1e9
    return rates, max(rates.values())


def matmul_floor(fn, *args, repeats=8, runs=10, top=12) -> dict:
    """What the matmuls of one call of ``fn(*args)`` cost at their own shapes: every distinct
    dot_general it executes (executed_dots: shapes, dtypes, dimension numbers) timed alone as
    dot_program's best call, times how often the call runs it. ``matmul_floor_s`` is the
    call's time if everything but its matmuls were free and each ran as fast as it does alone
    (a floor unless the step overlaps its matmuls better than dot_program's call does): how
    much of the gap to the peak the shapes themselves (decode's few rows, attention's small
    batched products) account for. ``matmul_floor_top``: the ``top`` distinct matmuls that
    take the most of it, each with the source op of its first occurrence (the engine's scopes
    and the model's layer; inside a loop, relative to the loop's body), its runs per call and
    its rate alone. A fused kernel's products (executed_dots: cuDNN attention's) are timed
    as the plain dot_generals they stand for; ``matmul_uncounted`` as in step_flops."""
    distinct, uncounted = {}, []
    for eqn, times in executed_dots(jax.make_jaxpr(fn)(*args).jaxpr, uncounted=uncounted):
        lhs, rhs = (v.aval for v in eqn.invars)
        key = (lhs.shape, str(lhs.dtype), rhs.shape, str(rhs.dtype), repr(eqn.params))
        distinct.setdefault(key, [0, eqn])[0] += times
    by_kind, rows = {"dense": 0.0, "batched": 0.0}, []  # the kinds as profile_step splits them
    for count, eqn in distinct.values():
        lhs, rhs = (v.aval for v in eqn.invars)
        kind = "batched" if is_batched(eqn.params) else "dense"
        call_s = _best_call_s(*dot_program(lhs, rhs, eqn.params, repeats), runs) / repeats
        by_kind[kind] += count * call_s
        rows.append({"op": str(eqn.source_info.name_stack), "kind": kind,
                     "lhs": list(lhs.shape), "rhs": list(rhs.shape), "runs": count,
                     "us_per_run": 1e6 * call_s, "gflops_alone": dot_flops(eqn) / call_s / 1e9,
                     "floor_ms": 1e3 * count * call_s})  # fmt: skip
    out = {
        "matmul_floor_s": sum(by_kind.values()),
        "matmul_floor_s_by_kind": by_kind,
        "distinct_matmuls": len(distinct),
        "matmul_floor_top": sorted(rows, key=lambda r: -r["floor_ms"])[:top],
    }
    return {**out, "matmul_uncounted": merged_uncounted(uncounted)} if uncounted else out


def canonical_hlo(hlo: str) -> str:
    """A compiled module's text without what changes when nothing runs differently: op
    metadata, the debug tables of source files and frames, and instruction names, renamed in
    order of first appearance (a second trace numbers its instructions on from the first's;
    the order keeps which operand is which)."""
    hlo = re.sub(r", metadata=\{[^}]*\}", "", hlo)
    hlo = "\n".join(line for line in hlo.splitlines() if not re.match(r"\s*\d+ ", line))
    names: dict = {}
    return re.sub(r"%[\w\-.]+", lambda m: names.setdefault(m[0], f"%v{len(names)}"), hlo)
