"""Does a 2-core CPU decode faster as several host devices? One config's step two ways in one
process, timed in alternating rounds (measure.alternate):

  A: the rollout on a data mesh of ``--rollout_devices`` CPU devices (each decodes its share
     of the prompts on its own thread), its batch copied to device 0, the update there on one
     device (which already keeps every core busy), the new state copied back to the rollout's
     mesh for the next step: two programs a step;
  B: the whole step as one program on device 0 (what the trainer runs with mesh.data=1).

Both sides carry one state (B's output feeds A's next round and the other way round), so they
step the same run. XLA_FLAGS gets ``--xla_force_host_platform_device_count`` before jax starts
(at least ``--rollout_devices``). Prints each side's median step and the ratio A ÷ B (below 1:
the split is faster), then a JSON record with every timed step and one step taken both ways
from one state (both losses, the largest difference of the new params):

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
flags.DEFINE_integer("rounds", 6, "Alternating rounds (A then B, then B then A, ...).")
flags.DEFINE_integer("calls", 4, "Timed steps of each side per round.", lower_bound=1)


def host_devices(n: int) -> None:
    """At least ``n`` CPU devices, set in XLA_FLAGS before jax reads it."""
    xla = os.environ.get("XLA_FLAGS", "")
    have = re.search(r"--xla_force_host_platform_device_count=(\d+)", xla)
    if have is None:
        os.environ["XLA_FLAGS"] = f"{xla} --xla_force_host_platform_device_count={n}".strip()
    elif int(have.group(1)) < n:
        sys.exit(f"error: XLA_FLAGS asks for {have.group(1)} CPU devices; --rollout_devices={n}")


def sides(config):
    """{"split": round(), "fused": round()} over one shared state (see the module docstring)."""
    import jax
    from measure import build_step, timed

    one, split = config.copy_and_resolve_references(), config.copy_and_resolve_references()
    for c, data in ((one, 1), (split, FLAGS.rollout_devices)):
        c.mesh.data, c.mesh.member = data, 1
    _, two_step, _, two_state, two_inputs, _, _ = build_step(split)
    _, one_step, fused, state, inputs, _, _ = build_step(one)
    rollout, update = jax.jit(two_step.rollout), jax.jit(one_step.update, donate_argnums=0)
    on_two = jax.tree.map(lambda a: a.sharding, two_state)
    on_one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    box = {"state": state}

    def split_step(state):
        batch = jax.device_put(rollout(jax.device_put(state, on_two), two_inputs), on_one)
        return update(state, inputs, batch, None)

    def fused_step(state):
        return fused(state, inputs)

    def round_of(fn):
        def run() -> list:
            times = []
            for _ in range(FLAGS.calls):
                (box["state"], _), (t,) = timed(fn, box["state"])
                times.append(t)
            return times

        return run

    for fn in (split_step, fused_step) * 2:  # compiles, then one untimed step each
        box["state"], _ = jax.block_until_ready(fn(box["state"]))
    agree = same_step(split_step, fused_step, box["state"])
    return {"split": round_of(split_step), "fused": round_of(fused_step)}, agree


def same_step(split_step, fused_step, state) -> dict:
    """One step both ways from copies of one state: both losses and the largest difference
    between the two new params (the split must train as the one program does)."""
    import jax
    import jax.numpy as jnp

    (a, ma), (b, mb) = (f(jax.tree.map(jnp.copy, state)) for f in (split_step, fused_step))
    diffs = jax.tree.leaves(jax.tree.map(lambda x, y: jnp.max(jnp.abs(x - y)), a.params, b.params))
    return {"loss_split": float(ma["loss"]), "loss_fused": float(mb["loss"]),
            "max_param_diff": float(max(diffs))}  # fmt: skip


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    from measure import alternate, configure_host

    configure_host(FLAGS.config)
    rounds, agree = sides(FLAGS.config)
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
    given = [a.split("=", 1)[1] for a in sys.argv if a.startswith("--rollout_devices=")]
    host_devices(int(given[-1]) if given else 2)
    app.run(main)
