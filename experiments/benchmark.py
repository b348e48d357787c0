"""Benchmark one GRPO train step: compile time, step time, tokens/s, memory, and a breakdown.

Builds the task exactly as the trainer does, jits the step once (state donated), times it,
and separately times the group collection (rollout + reward) and one loss+grad evaluation.
The LAST printed line is one JSON object (also appended to --out when given).

  GRPO_JAX_DATA=/work/shared/data/tinyshakespeare.txt python experiments/benchmark.py \
      --config=configs/shakespeare.py:sampled --config.group.size=8 \
      --config.reference.kind=policy --config.grpo.kl_estimator=k3 --config.reward.terms=match \
      --config.grpo.beta=0.04 --config.train.batch_size=8 --config.grpo.num_iterations=1
  python experiments/benchmark.py --config=configs/shakespeare.py            # exhaustive
  python experiments/benchmark.py --config=configs/shakespeare.py:tiny --steps=3 --out=b.jsonl
"""

import json
import statistics

import jax
import jax.numpy as jnp
from absl import app, flags
from measure import memory, time_train_step, timed
from ml_collections import config_flags

from grpo_jax import data as data_lib
from grpo_jax import groups, reference, rewards, sharding, trainer
from grpo_jax import task as task_lib
from grpo_jax.loss import make_loss
from grpo_jax.model import make_model
from grpo_jax.train_step import parts_forced_flags

FLAGS = flags.FLAGS
config_flags.DEFINE_config_file("config", None, "Config file (path[:variant,...]).")
flags.DEFINE_integer("warmup", 2, "Untimed steps after compilation.", lower_bound=0)
flags.DEFINE_integer("steps", 5, "Timed steps (median reported).", lower_bound=1)
flags.DEFINE_integer("breakdown_runs", 3, "Runs per breakdown part (median).", lower_bound=1)
flags.DEFINE_string("out", "", "Also append the JSON line to this file.")
flags.DEFINE_bool("mesh", True, "Step on config.mesh as the trainer does (--nomesh: plain jit).")


def breakdown(config, params, inputs, runs):
    """Separately jitted collect (rollout + reward) and one loss+grad, rebuilt as task.build."""
    max_len = task_lib.validate(config, "train")
    corpus = data_lib.load_corpus(config.data)
    model = make_model(config.model, corpus.vocab.size, max_len)
    ref, _ = reference.make_reference(config.reference, corpus, model, params)
    reward_fn = rewards.make_reward_fn(config.reward)
    collect = groups.make_collect(config, model, corpus.vocab.size, ref, reward_fn)
    loss_fn = make_loss(config, model, has_reference=ref is not None)
    flags_ = parts_forced_flags(config)
    b, c, h = config.train.batch_size, config.data.context_len, config.data.horizon
    key_data, key_roll = jax.random.split(jax.random.PRNGKey(config.seed + 1))
    context, target = data_lib.sample_windows(key_data, inputs.train_tokens, b, c, h)
    jcollect = jax.jit(collect)
    (parts, _), _ = timed(jcollect, params, inputs.ref_state, context, target, key_roll)
    parts = jax.lax.stop_gradient(parts)
    old = tuple(p.logp_old for p in parts)
    grad = jax.jit(
        lambda p, pa, o: jax.value_and_grad(loss_fn, has_aux=True)(
            p, pa, o, jnp.asarray(True), flags_
        )
    )
    timed(grad, params, parts, old)  # compile
    _, t_collect = timed(jcollect, params, inputs.ref_state, context, target, key_roll, runs=runs)
    _, t_grad = timed(grad, params, parts, old, runs=runs)
    return {
        "collect_s": statistics.median(t_collect),
        "loss_grad_s": statistics.median(t_grad),
        "collect_runs_s": t_collect,
        "loss_grad_runs_s": t_grad,
    }


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    config = FLAGS.config
    task = task_lib.build_task(config, "train")
    params0 = trainer.initial_params(config, task)
    n_params = sum(x.size for x in jax.tree.leaves(params0))
    mesh = sharding.make_mesh(config.get("mesh")) if FLAGS.mesh else None
    if mesh is not None:  # the trainer's path: sharded state/inputs, member shard_map
        sharding.check_batch(config.train.batch_size, mesh)
        step_fn, inputs = task.build(params0, mesh=mesh)
        fsdp = bool(config.mesh.shard_params)
        jstep, state, inputs, _ = sharding.jit_step(
            step_fn, mesh, task.make_state(params0), inputs, fsdp
        )
    else:
        step_fn, inputs = task.build(params0)
        state = task.make_state(params0)
        jstep = jax.jit(step_fn, donate_argnums=0)

    compiled, state, metrics, compile_s, times = time_train_step(
        jstep, state, inputs, FLAGS.warmup, FLAGS.steps
    )
    med = statistics.median(times)
    mem = memory(compiled)  # before the breakdown allocates anything else
    per_dev_peak = [(d.memory_stats() or {}).get("peak_bytes_in_use") for d in jax.devices()]
    bd = breakdown(config, state.params, inputs, FLAGS.breakdown_runs)

    dev = jax.devices()[0]
    res = {
        "config_variant": config_flags.get_config_filename(FLAGS["config"]),
        "overrides": config_flags.get_override_values(FLAGS["config"]),
        "device": f"{dev.device_kind} / {dev.platform}",
        "num_devices": jax.device_count(),
        "group_mode": config.group.mode,
        "params": int(n_params),
        "tokens_per_step": task.tokens_per_step,
        "compile_s": compile_s,
        "median_step_s": med,
        "tokens_per_s": task.tokens_per_step / med,
        "step_times_s": times,
        **mem,
        "breakdown": bd,
        "loss": float(metrics["loss"]),
        "params_sharding": str(jax.tree.leaves(state.params)[0].sharding),
    }
    res["mesh"] = sharding.describe(mesh) if mesh is not None else "none (plain jit)"
    if mesh is not None and jax.device_count() > 1:
        members = task_lib.members_per_prompt(config, task.vocab.size)
        res["per_device"] = {
            "num_devices": mesh.size,
            **sharding.per_device_work(config, mesh, members),
            "peak_bytes_in_use": per_dev_peak,
        }
        pd = res["per_device"]
        print(
            f"{res['mesh']}: {pd['prompts_per_device']:g} prompts x "
            f"{pd['members_per_prompt_per_device']:g} members per device "
            f"(of {pd['global_batch']} x {pd['members_per_prompt']:g})"
        )
    print(
        f"device {res['device']} x{res['num_devices']}, params {n_params:,}, "
        f"group_mode {config.group.mode}, tokens/step {task.tokens_per_step}"
    )
    print(
        f"compile {compile_s:.2f}s; step median {med:.4f}s over {len(times)} "
        f"(after {FLAGS.warmup} warmup) -> {res['tokens_per_s']:.0f} tokens/s"
    )
    print(
        f"breakdown: collect {bd['collect_s']:.4f}s, loss+grad {bd['loss_grad_s']:.4f}s; "
        f"peak memory {res['peak_memory_bytes'] / 2**20:.1f} MiB ({res['peak_memory_source']})"
    )
    line = json.dumps(res)
    if FLAGS.out:
        with open(FLAGS.out, "a") as f:
            f.write(line + "\n")
    print(line)


if __name__ == "__main__":
    flags.mark_flags_as_required(["config"])
    app.run(main)
