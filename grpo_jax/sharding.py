"""Devices: the mesh, the shardings of the state and the batch, and the member shard_map.

This is the only module that names devices. Everything else is written for one device and
runs unchanged on a mesh ``("data", "member")`` built from ``config.mesh``:

* ``data``: the prompts of a step (``train.batch_size``, global) are split over it. The step
  samples its windows on device from the replicated corpus and constrains them to
  ``P("data")``, so each device (and each host) only gathers and rolls out its own prompts.
* ``member``: the members of every group (the K axis of ``first_tokens [B, K]`` and of the
  uniforms ``u [B, K, H]``: all V forced first actions, a guide's candidates, or G sampled
  members) are split over it by ``jax.shard_map`` around the rollout, the expensive part,
  and around the reference's per-token log-probs.
  K is padded to a multiple of the axis size with dummy members whose outputs are dropped
  before anything uses them, so any V (65 is prime to 2, 4, 8) works. The loss's member
  loop (the members' training forward and backward) runs in a second shard_map
  (``make_member_sum``) over ``data`` too, with the part's prompt prefill and a forced
  part's decision point: GSPMD alone kept that loop whole on every member device. Its one
  hand-written reduction sums the devices' shares of the loss; the params' gradient is
  summed by shard_map's own transpose, once per update.
* parameters and optimizer state are replicated (default) or, with ``mesh.shard_params``,
  sharded FSDP-style over ``data`` (each >= 2-D leaf along its largest divisible axis)
  between steps, the params gathered whole for the rollout (``step_hooks``) and inside the
  loss's map, whose transpose then reduce-scatters their gradient.

Everything else (the rollout's prefill, rewards, the group statistics over K such as
advantages, the optimizer update) stays one ``jit`` program with sharding annotations,
partitioned by XLA (GSPMD/Shardy). It inserts the other cross-device reductions (over K
across ``member``) itself, so the same program computes the same numbers on every mesh, up
to float summation order (the tests check 1e-5).

Randomness does not depend on the mesh: every uniform is drawn once per (prompt, member,
step) from the step key with the partitionable threefry PRNG (``jax_threefry_partitionable``,
on by default in this jax and asserted in ``make_mesh``), whose values do not depend on how
the output is sharded.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from jax.experimental import multihost_utils
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

AXES = ("data", "member")


def _axis_size(value, name: str) -> int:
    value = int(value)
    if value == 0 or value < -1:
        raise ValueError(f"mesh.{name}={value} must be a positive device count or -1 (the rest)")
    return value


def mesh_shape(mesh_cfg, num_devices: int) -> tuple[int, int]:
    """(data, member) sizes from ``config.mesh`` for ``num_devices``; -1 = all remaining."""
    data = _axis_size(mesh_cfg.get("data", -1) if mesh_cfg is not None else -1, "data")
    member = _axis_size(mesh_cfg.get("member", 1) if mesh_cfg is not None else 1, "member")
    if data == -1 and member == -1:
        raise ValueError("mesh.data and mesh.member cannot both be -1; set one of them")
    fixed = data if member == -1 else member
    if member == -1 or data == -1:
        if num_devices % fixed:
            raise ValueError(
                f"mesh.data={data} x mesh.member={member} does not divide the {num_devices} "
                "devices; choose axis sizes whose product divides the device count"
            )
        rest = num_devices // fixed
        data, member = (rest, member) if data == -1 else (data, rest)
    if num_devices % (data * member):
        raise ValueError(
            f"mesh.data={data} x mesh.member={member} = {data * member} does not divide the "
            f"{num_devices} devices; choose axis sizes whose product divides the device count"
        )
    return data, member


def make_mesh(mesh_cfg=None, devices=None) -> Mesh:
    """A ("data", "member") mesh sized by ``config.mesh`` (default: every device on data).

    When the product of the sizes is smaller than the device count (e.g. data=1, member=1 on
    8 devices), the mesh uses the first devices only; that is refused on several hosts,
    where every process must own part of the mesh."""
    if not jax.config.jax_threefry_partitionable:
        raise ValueError(
            "jax_threefry_partitionable is off: random draws would depend on the mesh; "
            "enable it (jax.config.update('jax_threefry_partitionable', True))"
        )
    devices = list(jax.devices() if devices is None else devices)
    data, member = mesh_shape(mesh_cfg, len(devices))
    n = data * member
    if n < len(devices):
        if jax.process_count() > 1:
            raise ValueError(
                f"mesh.data={data} x mesh.member={member} = {n} uses fewer than the "
                f"{len(devices)} devices of a {jax.process_count()}-process run; use them all"
            )
        logging.warning(
            "mesh (data=%d, member=%d) uses %d of %d devices", data, member, n, len(devices)
        )
        devices = devices[:n]
    try:  # topology-aware order on TPU/GPU; plain order elsewhere
        from jax.experimental import mesh_utils

        grid = mesh_utils.create_device_mesh((data, member), devices=devices)
    except Exception:
        grid = np.asarray(devices, dtype=object).reshape(data, member)
    return Mesh(grid, AXES, axis_types=(AxisType.Auto, AxisType.Auto))


def describe(mesh: Mesh) -> str:
    return f"mesh(data={mesh.shape['data']}, member={mesh.shape['member']})"


def check_batch(batch_size: int, mesh: Mesh, what: str = "train.batch_size") -> None:
    """The global batch must split evenly over the data axis."""
    d = mesh.shape["data"]
    if batch_size % d:
        raise ValueError(
            f"{what}={batch_size} is not divisible by the mesh's data axis ({d} devices); "
            f"use a multiple of {d} or set --config.mesh.data"
        )


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Leading (prompt) axis over ``data``."""
    return NamedSharding(mesh, P("data"))


def fsdp_spec(shape, data_size: int) -> P:
    """Shard the largest axis divisible by ``data_size`` of a >= 2-D leaf; else replicate."""
    if data_size <= 1 or len(shape) < 2:
        return P()
    order = sorted(range(len(shape)), key=lambda i: (-shape[i], i))
    for i in order:
        if shape[i] % data_size == 0:
            return P(*([None] * i + ["data"]))
    return P()


def state_shardings(mesh: Mesh, tree: Any, shard_params: bool = False) -> Any:
    """NamedSharding per leaf of ``tree`` (a TrainState, params, ...): replicated, or
    FSDP-style over ``data`` when ``shard_params`` (optimizer moments follow their params
    because they have the same shapes; scalars and the rng stay replicated)."""
    d = mesh.shape["data"]

    def one(x):
        spec = fsdp_spec(np.shape(x), d) if shard_params else P()
        return NamedSharding(mesh, spec)

    return jax.tree.map(one, tree)


def put(tree: Any, shardings: Any) -> Any:
    """Places host or device values onto ``shardings`` (a matching tree or one sharding).

    Single process: ``jax.device_put``. Several processes: every process holds the same
    full value (same seed, same corpus) and contributes the shards its devices own."""
    if jax.process_count() == 1:
        return jax.device_put(tree, shardings)
    if isinstance(shardings, jax.sharding.Sharding):
        shardings = jax.tree.map(lambda _: shardings, tree)

    def one(x, s):
        x = np.asarray(x)
        return jax.make_array_from_callback(x.shape, s, lambda idx: x[idx])

    return jax.tree.map(one, tree, shardings)


def fetch_global(tree: Any) -> Any:
    """Every array of ``tree`` whole, as numpy, on every process (``jax.device_get`` reads
    only arrays this process's devices hold all of); the Python rewards of a multi-process
    run score the whole batch on each process, which ``put`` then expects identical."""
    if jax.process_count() == 1:
        return jax.device_get(tree)
    return multihost_utils.process_allgather(tree, tiled=True)


def make_member_map(mesh: Mesh):
    """``member_map(fn, *member_args, shared=())``: ``fn(*shared, *member_slices)`` on each
    device's slice of the K members (axis 1 of each member arg; ``data`` stays automatic),
    its outputs per member, [B, K, ...]: the rollout (policy.rollout) and the reference's
    per-token log-probs (groups.make_reference_terms). ``shared`` is whole on every member
    device, as is what ``fn`` closes over (the rollout's params and prompt cache); indexing a
    closed-over array inside the map fails in jax 0.10 (its sharding's mesh is not the
    map's), so the n-gram reference's tables come in ``shared``. Padding: token 0, uniform 0."""

    def member_map(fn, *member_args, shared=()):
        run = lambda sh, _, *a: fn(*sh, *a)
        return _shard_members(mesh, run, (tuple(shared), ()), member_args, None)

    return member_map


def _shard_members(mesh: Mesh, fn, inputs, member_args: tuple, rows, summed=False, shared=None):
    """``fn(shared, per_prompt, *member_slices)`` under ``jax.shard_map`` over ``member``,
    and over ``data`` too when ``rows`` is "data" (else it stays automatic); its outputs per
    member, [B, K, ...] (``summed``: a sum, then those). ``inputs`` = (shared: whole, or as
    the specs ``shared`` say; per_prompt: axis 0 split over ``rows``); the member args' axis
    1 is zero-padded to a multiple of the member axis, split, and the padding cut off the
    outputs. Scans inside start their carry device-invariant (a zeroed cache) and end it per
    device; vma typing would demand pcasts there, and the outputs are as the specs say."""
    nv = mesh.shape["member"]
    padded = (
        jnp.pad(a, [(0, 0), (0, -a.shape[1] % nv)] + [(0, 0)] * (a.ndim - 2)) for a in member_args
    )
    per_member, shared = P(rows, "member"), P() if shared is None else shared
    out = jax.shard_map(
        fn,
        mesh=mesh,
        in_specs=(shared, P(rows), *(per_member for _ in member_args)),
        out_specs=(P(), per_member) if summed else per_member,
        axis_names=frozenset({"member"} if rows is None else AXES),
        check_vma=False,
    )(*inputs, *padded)
    cut = lambda tree: jax.tree.map(lambda x: x[:, : member_args[0].shape[1]], tree)
    return (out[0], cut(out[1])) if summed else cut(out)


def make_member_sum(mesh: Mesh, shard_params: bool = False):
    """``member_sum(fn, shared, per_prompt, *member_args)`` for the loss (loss.make_loss):
    ``fn(shared, per_prompt, *member_slices) -> (j, once, aux)`` on each device's prompts
    and members under ``jax.shard_map`` over ``data`` and ``member`` (``shared``: the params,
    the reference's state, whole; ``per_prompt`` and the member args' axis 0 split over
    ``data``), returning (Σ j, Σ once, aux [B, K, ...] whole). ``fn`` holds all of a part's
    differentiated loss, its prompts' prefill included, so the transpose sums the gradient
    once over the mesh (with ``data`` automatic: over ``member``, again over ``data``, and
    the prefill's apart). ``once`` (scalars: a forced part's decision point, summed over its
    rows) depends on the prompts alone: every member device of a row computes it alike,
    and it counts once. Padding members' zero weights add nothing. FSDP (``shard_params``):
    the params (``shared[0]``) come in sharded as the state holds them and are gathered
    inside the map, behind an optimization barrier (without it XLA:TPU moved the gathers
    into the loops: a v5e-8, 7,747 a step), so the transpose of that gather sums their
    gradient onto the sharded layout (a reduce-scatter), not into a whole copy on each.
    On one device: None (nothing to split; loss.make_loss runs ``fn`` directly)."""
    nv, d = mesh.shape["member"], mesh.shape["data"]

    def member_sum(fn, shared, per_prompt, *member_args):
        fsdp = jax.tree.map(lambda x: fsdp_spec(x.shape, d), shared[0]) if shard_params else None
        specs = P() if fsdp is None else (fsdp, *(P() for _ in shared[1:]))

        def run(shared, per_prompt, *slices):
            if fsdp is not None:
                params = jax.tree.map(_gather_data, shared[0], fsdp)
                shared = (jax.lax.optimization_barrier(params), *shared[1:])
            j, once, aux = fn(shared, per_prompt, *slices)
            once = jax.tree.map(lambda x: x / nv, once)
            return jax.lax.psum((j, once), AXES), aux

        inputs = (shared, per_prompt)
        (j, once), aux = _shard_members(mesh, run, inputs, member_args, "data", True, specs)
        return j, once, aux

    return member_sum if mesh.size > 1 else None  # one device: nothing to split


def _gather_data(x, spec: P):
    """A leaf whole from its shards over ``data`` (fsdp_spec's axis), inside a manual map."""
    axes = tuple(spec)
    return jax.lax.all_gather(x, "data", axis=axes.index("data"), tiled=True) if axes else x


def unsharded(tree: Any) -> Any:
    """``shard_batch`` and ``whole`` without a mesh."""
    return tree


class StepHooks(NamedTuple):
    """What task.build threads into a step for a mesh (without one: None, unsharded, None)."""

    member_map: Any  # per-member work over ``member``: the rollout and π_ref's log-probs
    shard_batch: Any  # tree -> tree with the prompt (row) axis constrained to P("data")
    member_sum: Any  # the loss's member loop (loss.make_loss); None: one device, no map
    # a sub-batch's prompt count (adaptive's forced part) is padded to a multiple of ``data``:
    # GSPMD's own padding of an uneven split leaked NaN into the gradients
    batch_multiple: int = 1
    # tree -> tree made whole on every device: the rollout's params
    whole: Any = unsharded


def _constrainer(target: NamedSharding):
    """tree -> tree with every leaf constrained to ``target`` (inside jit)."""
    return lambda tree: jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, target), tree)


def shards_params(config) -> bool:
    """Whether the run (None: no run) shards its params FSDP-style (``mesh.shard_params``)."""
    return config is not None and bool(config.get("mesh", {}).get("shard_params", False))


def step_hooks(mesh: Mesh | None, config=None) -> StepHooks:
    """The hooks a step takes for ``mesh`` and the run's ``config`` (its mesh.shard_params).
    ``whole`` gathers FSDP's params for the rollout, ``member_sum`` inside the loss's map:
    one copy on each device while the step runs. Left sharded, XLA partitioned their
    products by the weights' sharding (experiments/aot_compile.py, the 12 x 768 model): at
    every decode step (8 GPUs: 11,049 collectives a step in the decode loop), and the
    update's activations (a v5e-8: 1,062 all-gathers, 345 all-to-alls, 184 all-reduces)."""
    if mesh is None:
        return StepHooks(None, unsharded, None)
    shard_batch, whole = _constrainer(batch_sharding(mesh)), _constrainer(replicated(mesh))
    maps = make_member_map(mesh), shard_batch, make_member_sum(mesh, shards_params(config))
    return StepHooks(*maps, mesh.shape["data"], whole)


def jit_step(step, mesh: Mesh, state, inputs, shard_params: bool = False, wrap=None):
    """Places ``state`` (replicated or FSDP) and ``inputs`` (replicated) on ``mesh`` and jits
    the step with those shardings, the state donated and the metrics replicated. Returns
    (run(state, inputs) -> (state, metrics), state, inputs, state shardings).

    ``step`` is a plain ``step(state, inputs)`` function (supervised modes) or an
    engine.Step: one fused program when every reward is jittable; with Python rewards a
    jitted rollout, the host rewards and a jitted update. ``wrap`` (e.g. the trainer's
    trace_once) wraps each jitted function."""
    wrap = wrap or (lambda f: f)
    state_sh, rep = state_shardings(mesh, state, shard_params), replicated(mesh)
    inputs_sh = jax.tree.map(lambda _: rep, inputs)
    state, inputs = put(state, state_sh), put(inputs, inputs_sh)
    host = getattr(step, "host", None)
    if host is None:
        return jit_fused(getattr(step, "fused", step), state_sh, rep, wrap), state, inputs, state_sh
    rollout = jax.jit(wrap(step.rollout), in_shardings=(state_sh, inputs_sh))
    update = jax.jit(wrap(step.update), out_shardings=(state_sh, rep), donate_argnums=0)

    def run(state, inputs):
        batch = rollout(state, inputs)
        return update(state, inputs, batch, put(host(batch, fetch_global), rep))

    return run, state, inputs, state_sh


def jit_fused(fused, state_sh, rep: NamedSharding, wrap=None):
    """A one-program step ``fused(state, inputs) -> (state, metrics)`` jitted on a mesh: the
    state in and out on ``state_sh`` and donated, the inputs and metrics on ``rep``
    (replicated). Lowered on abstract values it compiles for devices this process need not
    have (experiments/aot_compile.py)."""
    wrap = wrap or (lambda f: f)
    return jax.jit(
        wrap(fused), in_shardings=(state_sh, rep), out_shardings=(state_sh, rep), donate_argnums=0
    )


def per_device_work(mesh: Mesh, batch_size: int, parts) -> dict:
    """Prompts and group members rolled out per step, in all and per device (benchmarks, logs).

    ``parts``: the rollout's group parts as ``(rows, members)`` (its tokens' leading axes),
    padding included: adaptive groups pad their forced sub-batch with unchosen prompts to
    whole rows per data device. The data axis splits each part's rows and the member axis its
    members, each padded to a multiple of its axis."""
    d, v = mesh.shape["data"], mesh.shape["member"]
    rollouts = sum(math.ceil(rows / d) * math.ceil(k / v) for rows, k in parts)
    return {
        "mesh_data": d,
        "mesh_member": v,
        "global_batch": batch_size,
        "prompts_per_device": batch_size / d,
        "members_per_prompt": sum(rows * k for rows, k in parts) / batch_size,
        "members_per_prompt_per_device": rollouts / (batch_size / d),
        "rollouts_per_device": rollouts,
    }


# ----------------------------------------------------------------------------- seeds


def stack_states(states) -> Any:
    """[state_0, ..., state_{N-1}] -> one state with a leading seed axis on every leaf."""
    return jax.tree.map(lambda *xs: jnp.stack(xs), *states)


def unstack_state(state, i: int) -> Any:
    return jax.tree.map(lambda x: x[i], state)


def seed_states(make_state, params, seeds, init_params=None) -> Any:
    """N TrainStates stacked on a leading axis: ``rng`` from each seed (``make_state``
    builds a state from params, e.g. ``task.make_state``); the same params for every seed,
    or ``init_params(PRNGKey(seed))`` per seed when given."""
    states = []
    for s in seeds:
        p = params if init_params is None else init_params(jax.random.PRNGKey(s))
        states.append(make_state(p)._replace(rng=jax.random.PRNGKey(s)))
    return stack_states(states)


def make_multi_seed_step(step_fn):
    """purejaxrl-style: the whole train step vmapped over a leading seed axis of the state
    (different rng, optionally different params); the inputs (corpus, reference) are shared.
    ``jax.jit(make_multi_seed_step(step), donate_argnums=0)`` trains N seeds in one program;
    metrics come back with a leading seed axis."""
    return jax.vmap(step_fn, in_axes=(0, None))
