"""Benchmark one GRPO train step: compile time, step time, tokens/s, memory, and a breakdown.

Builds the task exactly as the trainer does (``build_task(config, "train")``, its init,
``task.build`` and ``task.make_state``; nothing is rebuilt here), jits the step once (the
fused rollout + update program, state donated), times it, and separately times the step's
two halves as the engine defines them: ``step.rollout`` (prompts, group collection, the
jittable rewards) and ``step.update`` (scoring, the grpo.num_iterations optimizer updates,
metrics). The LAST printed line is one JSON object (also appended to --out when given).

  GRPO_JAX_DATA=/work/shared/data/tinyshakespeare.txt python experiments/benchmark.py \
      --config=configs/shakespeare.py:sampled --config.group.size=8 \
      --config.reference.kind=policy --config.grpo.kl_estimator=k3 --config.reward.terms=match \
      --config.grpo.beta=0.04 --config.train.batch_size=8 --config.grpo.num_iterations=1
  python experiments/benchmark.py --config=configs/shakespeare.py            # exhaustive
  python experiments/benchmark.py --config=configs/shakespeare.py:tiny --steps=3 --out=b.jsonl

(Rows of experiments/results/benchmark_cpu.jsonl before the engine refactor carry the old
breakdown, ``collect_s`` (rollout + reward) and ``loss_grad_s`` (one loss + grad); rows now
carry ``rollout_s`` and ``update_s``, whose update includes the optimizer and all μ updates.)
"""

import json
import statistics

import device_lock
import jax
from absl import app, flags
from flop_count import step_flops
from measure import (
    build_step,
    compile_halves,
    compile_step,
    configure_host,
    matmul_floor,
    matmul_peak,
    memory,
    run_steps,
    timed,
)
from ml_collections import config_flags

from grpo_jax import sharding

FLAGS = flags.FLAGS
config_flags.DEFINE_config_file("config", None, "Config file (path[:variant,...]).")
flags.DEFINE_integer("warmup", 2, "Untimed steps after compilation.", lower_bound=0)
flags.DEFINE_integer("steps", 5, "Timed steps (median reported).", lower_bound=1)
flags.DEFINE_integer("breakdown_runs", 3, "Runs per breakdown part (median).", lower_bound=1)
flags.DEFINE_string("out", "", "Also append the JSON line to this file.")
flags.DEFINE_bool("mesh", True, "Step on config.mesh as the trainer does (--nomesh: plain jit).")
flags.DEFINE_bool("roofline", True, "Count the step's FLOPs and time matmuls at its shapes.")
flags.DEFINE_bool(
    "matmul_floor",
    False,
    "Roofline: also time every distinct matmul of the step alone at its own shape "
    "(measure.matmul_floor; tens of seconds on a CPU): the step's time if everything else "
    "were free.",
)
flags.DEFINE_bool(
    "flops_only", False, "Only count the step's matmul FLOPs by tracing (no compile, no run)."
)
flags.DEFINE_bool(
    "compile_only",
    False,
    "Only compile the step and print XLA's buffer plan (executable_bytes: arguments + outputs "
    "+ temporaries - aliased): whether a configuration fits, without running it.",
)


def breakdown(halves, step, state, inputs, runs):
    """compile_halves' programs, each run once untimed and then ``runs`` times."""
    rollout, update = halves
    batch = jax.block_until_ready(rollout(state, inputs))
    host = None if step.host is None else step.host(batch)
    jax.block_until_ready(update(state, inputs, batch, host))
    _, t_rollout = timed(rollout, state, inputs, runs=runs)
    _, t_update = timed(update, state, inputs, batch, host, runs=runs)
    return {
        "rollout_s": statistics.median(t_rollout),
        "update_s": statistics.median(t_update),
        "rollout_runs_s": t_rollout,
        "update_runs_s": t_update,
    }


def flop_counts(step, state, inputs, batch, compiled=None):
    """The step's matmul FLOPs (flop_count.step_flops) and each half's (the update on the
    rollout's ``batch`` shapes), for its MFU beside breakdown()'s times. Tracing only: the
    count is the traced program's, the same on any device (so a CPU counts a GPU run's work:
    --flops_only)."""
    counts = step_flops(step.fused, state, inputs, compiled=compiled)
    halves = {
        "rollout": (step.rollout, state, inputs),
        "update": (step.update, state, inputs, batch, None),
    }
    for half, (fn, *args) in halves.items():
        got = step_flops(fn, *args)
        counts[f"{half}_matmul_flops"] = got["matmul_flops"]
        if half == "rollout":  # its decode loop's share: gpu_suite_parts.rollout_floor
            counts["rollout_loop_matmul_flops"] = got["loop_matmul_flops"]
        if "matmul_uncounted" in got:  # e.g. a Pallas decode kernel's products: not in the MFU
            counts[f"{half}_matmul_uncounted"] = got["matmul_uncounted"]
    return counts


def roofline(config, task, step, state, inputs, batch, compiled, step_s):
    """flop_counts, the GFLOP/s the step achieves and, on a CPU, this machine's matmul peak at
    the model's own shapes (measure.matmul_peak): the roofline; with --matmul_floor, also
    what the step's own matmuls take alone (measure.matmul_floor). Not on a GPU: there
    gpu_suite's peak children (large shapes, each its own time limit) and the nominal peaks
    apply; on one H200 an earlier peak loop in bfloat16 at 8192^3 was still compiling when
    the suite's probe hit its 300 s limit."""
    counts = flop_counts(step, state, inputs, batch, compiled)
    achieved = counts["matmul_flops"] / step_s / 1e9
    out = {**counts, "achieved_gflops": achieved}
    if jax.default_backend() != "cpu":
        return {**out, "matmul_peak_gflops": None, "fraction_of_peak": None}
    d, hidden = config.model.d_model, config.model.mlp_ratio * config.model.d_model
    v = state.params["embed"]["embedding"].shape[0]  # the tied output head's V
    rows = (task.tokens_per_step, max(1, task.tokens_per_step // completion_length(batch)))
    shapes = [
        (r, k, n) for r in rows for k, n in ((d, 3 * d), (d, d), (d, hidden), (hidden, d), (d, v))
    ]
    per_shape, peak = matmul_peak(shapes, config.model.get("dtype", "float32"))
    out.update(matmul_peak_gflops=peak, matmul_gflops_by_shape=per_shape)
    out["fraction_of_peak"] = achieved / peak
    if FLAGS.matmul_floor:
        out.update(matmul_floor(step.fused, state, inputs))
        out["floor_gflops"] = counts["matmul_flops"] / out["matmul_floor_s"] / 1e9
    return out


def completion_length(batch) -> int:
    """The longest completion the step's groups generate (the rollout's ``batch``'s token
    axis), whatever the task calls it in its config."""
    return max(p.tokens.shape[-1] for p in batch.parts)


def per_device(config, mesh, peaks, batch) -> dict:
    """Each device's share of the step's work on a multi-device mesh, and its peak bytes;
    ``batch``: the rollout's output, whose parts' shapes are the rollouts the step runs."""
    parts = [p.tokens.shape[:2] for p in batch.parts]  # [rows, members] each, padding included
    return {
        "num_devices": mesh.size,
        **sharding.per_device_work(mesh, config.train.batch_size, parts),
        "peak_bytes_in_use": peaks,
    }


def record(config, task, state, batch, mesh, n_params, measured: dict) -> dict:
    """The JSON line: the run's identity and what main() ``measured`` (compile_s,
    step_times_s, memory, peaks, breakdown, loss, cpu_buffers, roofline or None); ``batch``:
    the rollout's output shapes."""
    dev = jax.devices()[0]
    med = statistics.median(measured["step_times_s"])
    res = {
        "config_variant": config_flags.get_config_filename(FLAGS["config"]),
        "overrides": config_flags.get_override_values(FLAGS["config"]),
        "device": f"{dev.device_kind} / {dev.platform}",
        "jax": jax.__version__,
        "num_devices": jax.device_count(),
        "group_mode": config.group.mode,
        "params": n_params,
        "tokens_per_step": task.tokens_per_step,
        "compile_s": measured["compile_s"],
        "median_step_s": med,
        "tokens_per_s": task.tokens_per_step / med,
        "step_times_s": measured["step_times_s"],
        **measured["memory"],
        "breakdown": measured["breakdown"],
        "loss": measured["loss"],
        "params_sharding": str(jax.tree.leaves(state.params)[0].sharding),
        "cpu_buffers": measured["cpu_buffers"],
        **device_lock.report(),
    }
    if measured["roofline"] is not None:
        res["roofline"] = measured["roofline"]
    res["mesh"] = sharding.describe(mesh) if mesh is not None else "none (plain jit)"
    if mesh is not None and jax.device_count() > 1:
        res["per_device"] = per_device(config, mesh, measured["peaks"], batch)
    return res


def report_roofline(roof: dict, med: float) -> None:
    peak, at_peak = roof["matmul_peak_gflops"], ""
    if peak is not None:  # a CPU's (on a GPU, gpu_suite measures the peaks)
        at_peak = (
            f" = {100 * roof['fraction_of_peak']:.0f}% of this machine's matmul peak at the "
            f"model's shapes ({peak:.1f} GFLOP/s)"
        )
    print(
        f"roofline: {roof['matmul_flops'] / 1e9:.2f} GFLOP matmul per step -> "
        f"{roof['achieved_gflops']:.1f} GFLOP/s{at_peak}"
    )
    if "matmul_floor_s" in roof:
        print(
            f"matmul floor: the step's {roof['distinct_matmuls']} distinct matmuls alone "
            f"take {roof['matmul_floor_s']:.4f} s per step ({roof['floor_gflops']:.1f} "
            f"GFLOP/s, {100 * roof['floor_gflops'] / peak:.0f}% of the peak): "
            f"{100 * roof['matmul_floor_s'] / med:.0f}% of the step's time; dense "
            f"{roof['matmul_floor_s_by_kind']['dense']:.4f} s, batched (attention) "
            f"{roof['matmul_floor_s_by_kind']['batched']:.4f} s"
        )
        for r in roof["matmul_floor_top"][:5]:
            print(
                f"  {r['floor_ms']:7.2f} ms: {r['runs']} x {r['lhs']} . {r['rhs']} at "
                f"{r['gflops_alone']:.0f} GFLOP/s alone ({r['op'] or 'unnamed'})"
            )


def report(res: dict) -> None:
    """The record's figures as lines for a reader (the JSON line follows them)."""
    if "per_device" in res:
        pd = res["per_device"]
        print(
            f"{res['mesh']}: {pd['prompts_per_device']:g} prompts x "
            f"{pd['members_per_prompt_per_device']:g} members per device "
            f"(of {pd['global_batch']} x {pd['members_per_prompt']:g})"
        )
    bd, med = res["breakdown"], res["median_step_s"]
    print(
        f"device {res['device']} x{res['num_devices']}, params {res['params']:,}, "
        f"group_mode {res['group_mode']}, tokens/step {res['tokens_per_step']}"
    )
    print(
        f"compile {res['compile_s']:.2f}s; step median {med:.4f}s over "
        f"{len(res['step_times_s'])} (after {FLAGS.warmup} warmup) -> "
        f"{res['tokens_per_s']:.0f} tokens/s"
    )
    print(
        f"breakdown: rollout {bd['rollout_s']:.4f}s, update {bd['update_s']:.4f}s; "
        f"peak memory {res['peak_memory_bytes'] / 2**20:.1f} MiB ({res['peak_memory_source']})"
    )
    if "roofline" in res:
        report_roofline(res["roofline"], med)


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    config = FLAGS.config
    cpu_buffers = configure_host(config)
    task, step, jstep, state, inputs, mesh, n_params = build_step(config, FLAGS.mesh)
    if FLAGS.compile_only:
        if not hasattr(jstep, "lower"):
            raise app.UsageError("--compile_only: a Python reward splits the step in two programs")
        with device_lock.shared():
            compiled, _, compile_s = compile_step(jstep, state, inputs)
        print(json.dumps({"params": n_params, "compile_s": compile_s, **memory(compiled)}))
        return
    batch = jax.eval_shape(step.rollout, state, inputs)  # its shapes, traced once
    if FLAGS.flops_only:
        counts = {"params": n_params, "tokens_per_step": task.tokens_per_step}
        print(json.dumps({**counts, **flop_counts(step, state, inputs, batch)}))
        return
    # one compile section and one timed section (device_lock: no-ops unless gpu_suite.py runs
    # children side by side): each timed section waits for the compiles already running
    with device_lock.shared():
        compiled, state, compile_s = compile_step(jstep, state, inputs)
        halves = compile_halves(step, state, inputs, batch)
    with device_lock.timed():
        run = compiled if compiled is not None else jstep
        state, metrics, times = run_steps(run, state, inputs, FLAGS.warmup, FLAGS.steps)
        measured = {
            "compile_s": compile_s,
            "step_times_s": times,
            "memory": memory(compiled),  # before the breakdown allocates anything else
            "peaks": [(d.memory_stats() or {}).get("peak_bytes_in_use") for d in jax.devices()],
            "loss": float(metrics["loss"]),
            "cpu_buffers": cpu_buffers,
            "roofline": None,
        }
        measured["breakdown"] = breakdown(halves, step, state, inputs, FLAGS.breakdown_runs)
    if FLAGS.roofline and step.host is None and compiled is not None:
        med = statistics.median(times)
        measured["roofline"] = roofline(config, task, step, state, inputs, batch, compiled, med)
    res = record(config, task, state, batch, mesh, n_params, measured)
    report(res)
    line = json.dumps(res)
    if FLAGS.out:
        with open(FLAGS.out, "a") as f:
            f.write(line + "\n")
    print(line)


if __name__ == "__main__":
    flags.mark_flags_as_required(["config"])
    app.run(main)
