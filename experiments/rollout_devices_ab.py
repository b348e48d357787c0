"""Does a 2-core CPU decode faster as several host devices? One config's step two ways in one
process, timed in alternating rounds (measure.alternate):

  A: the rollout on a data mesh of ``--rollout_devices`` CPU devices (each decodes its share
     of the prompts on its own thread), its batch copied to device 0, the update there on one
     device (which already keeps every core busy), the new state copied back to the rollout's
     mesh for the next step: two programs a step;
  B: the whole step as one program on device 0 (what the trainer runs with mesh.data=1).

Each side steps its own copy of one state (measure.stepping_round). XLA_FLAGS gets
``--xla_force_host_platform_device_count`` (at least ``--rollout_devices``) before jax
starts. Prints each side's median step and the ratio A ÷ B (below 1:
the split is faster), then a JSON record with every timed step and one step taken both ways
from one state (same_step: the two rollouts' batches compared, both losses, the new params'
largest difference beside the step's largest update):

  python experiments/rollout_devices_ab.py --config=configs/shakespeare.py:sampled \\
      --config.group.size=8 --config.reference.kind=policy --config.grpo.kl_estimator=k3 \\
      --config.reward.terms=match --config.grpo.beta=0.04 --config.train.batch_size=8 \\
      --config.grpo.num_iterations=1

Not built into the trainer: it wins only where one device's decode matmuls are too small for
two threads (README, Benchmarks: "Tried on this step and not adopted").
"""

import json
import os
import re
import statistics
import sys

from absl import app, flags
from ml_collections import config_flags

FLAGS = flags.FLAGS
config_flags.DEFINE_config_file("config", None, "Config file (path[:variant,...]).")
flags.DEFINE_integer("rollout_devices", 2, "CPU devices of the rollout's data mesh.", lower_bound=2)
flags.DEFINE_integer("warmup", 2, "Untimed steps a side after compilation.", lower_bound=0)
flags.DEFINE_integer("rounds", 6, "Alternating rounds (A then B, then B then A, ...).")
flags.DEFINE_integer("calls", 4, "Timed steps of each side per round.", lower_bound=1)


def host_devices(n: int) -> None:
    """At least ``n`` CPU devices, set in XLA_FLAGS before jax starts its backend."""
    xla = os.environ.get("XLA_FLAGS", "")
    have = re.search(r"--xla_force_host_platform_device_count=(\d+)", xla)
    if have is None:
        os.environ["XLA_FLAGS"] = f"{xla} --xla_force_host_platform_device_count={n}".strip()
    elif int(have.group(1)) < n:
        sys.exit(f"error: XLA_FLAGS asks for {have.group(1)} CPU devices; --rollout_devices={n}")


def sides(config) -> tuple[dict, dict]:
    """The two sides, {"split": side, "fused": side}, as measure.stepping_round takes them
    (run, state, inputs), each stepping its own copy of one state, warmed up by --warmup
    steps; and each way's rollout alone (state -> batch on device 0), by the same names."""
    import jax
    import jax.numpy as jnp
    from measure import build_step, run_steps

    one, split = config.copy_and_resolve_references(), config.copy_and_resolve_references()
    for c, data in ((one, 1), (split, FLAGS.rollout_devices)):
        c.mesh.data, c.mesh.member = data, 1
    _, two_step, _, two_state, two_inputs, _, _ = build_step(split)
    _, one_step, fused, state, inputs, _, _ = build_step(one)
    rollout, update = jax.jit(two_step.rollout), jax.jit(one_step.update, donate_argnums=0)
    on_two = jax.tree.map(lambda a: a.sharding, two_state)
    on_one = jax.sharding.SingleDeviceSharding(jax.devices()[0])

    def split_rollout(state):
        return jax.device_put(rollout(jax.device_put(state, on_two), two_inputs), on_one)

    def split_step(state, inputs):
        return update(state, inputs, split_rollout(state), None)

    out = {}
    for name, run in (("split", split_step), ("fused", fused)):
        copy = jax.tree.map(jnp.copy, state)  # both donate their state
        copy, _, _ = run_steps(run, copy, inputs, FLAGS.warmup, 0)  # compiles, then warms up
        out[name] = {"run": run, "state": copy, "inputs": inputs}
    one_rollout = jax.jit(one_step.rollout)
    return out, {"split": split_rollout, "fused": lambda state: one_rollout(state, inputs)}


def same_step(sides: dict, rollouts: dict) -> dict:
    """One step both ways from copies of one state (the fused side's). The rollouts' batches:
    how many integer entries (tokens, lengths) differ and the largest float difference. The
    steps: both losses, the largest difference between the two new params, and the largest
    change the one-program step made to a param. Adam's update is about the learning rate
    wherever a gradient is not tiny against its running scale, so two programs that round
    one near-zero gradient differently can differ there by a fraction of the update."""
    import jax
    import jax.numpy as jnp

    start, inputs = sides["fused"]["state"], sides["fused"]["inputs"]
    pairs = zip(*(jax.tree.leaves(rollouts[k](start)) for k in ("split", "fused")), strict=True)
    ints, floats = 0, 0.0
    for x, y in pairs:
        if jnp.issubdtype(x.dtype, jnp.floating):
            floats = max(floats, float(jnp.max(jnp.abs(x - y), initial=0.0)))
        else:
            ints += int(jnp.sum(x != y))
    (a, ma), (b, mb) = (
        s["run"](jax.tree.map(jnp.copy, start), inputs) for s in (sides["split"], sides["fused"])
    )

    def largest(t, u) -> float:
        return float(max(jax.tree.leaves(jax.tree.map(lambda x, y: jnp.max(jnp.abs(x - y)), t, u))))

    return {"batch_ints_differ": ints, "batch_max_diff": floats,
            "loss_split": float(ma["loss"]), "loss_fused": float(mb["loss"]),
            "max_param_diff": largest(a.params, b.params),
            "max_update": largest(b.params, start.params)}  # fmt: skip


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    host_devices(FLAGS.rollout_devices)  # measure imports jax; its backend starts later
    from measure import alternate, configure_host, stepping_round

    configure_host(FLAGS.config)
    both, rollouts = sides(FLAGS.config)
    agree = same_step(both, rollouts)
    rounds = {name: stepping_round(s, FLAGS.calls) for name, s in both.items()}
    times = alternate(rounds, FLAGS.rounds)
    med = {k: statistics.median(v) for k, v in times.items()}
    ratio = med["split"] / med["fused"]
    print(f"split ({FLAGS.rollout_devices} rollout devices) median {med['split']:.4f} s, "
          f"fused (one device) median {med['fused']:.4f} s, ratio {ratio:.3f}")  # fmt: skip
    sides_out = {k: {"times_s": v, "median_step_s": med[k]} for k, v in times.items()}
    rec = {"rollout_devices": FLAGS.rollout_devices, "sides": sides_out, "ratio": ratio, **agree}
    print(json.dumps(rec))


if __name__ == "__main__":
    flags.mark_flags_as_required(["config"])
    app.run(main)
