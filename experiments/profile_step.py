"""Where one GRPO step's time goes: a jax.profiler trace of the jitted step, summed per kind
of work and per stage of the step.

The step is built as experiments/benchmark.py builds it (measure.build_step: the task's own
``task.build`` on ``config.mesh``), jitted once (rollout, rewards and update in one program,
the state donated), warmed up, then ``--steps`` steps run under ``jax.profiler.trace`` (no
Python tracer). XLA:CPU executes a program as thunks, one per HLO instruction (a fusion, a
matmul, a copy), and the trace times each one (its ``hlo_op``); this script maps every thunk to
its instruction in the compiled HLO and classifies it (on a GPU or TPU only the device tracks'
kernels count, each named by the ``hlo_op`` it runs). XLA:GPU launches runs of kernels as CUDA
graphs (command buffers), whose kernels the trace names by the graph's thunk, no instruction:
on one H100 (2026-11-26) 15.6 of the step's 19.9 ms went to ``command_buffer_*`` and none was
attributed. This script turns them off (``--xla_gpu_enable_command_buffer=`` in XLA_FLAGS,
recorded in ``xla_flags``; a no-op elsewhere), so its GPU wall time includes launches a graph
would save: the attribution is the point, benchmark.py's time the step's. With them off, one
H100 (2026-11-27) attributed 388.50 of the large step's 388.63 kernel-ms to instructions.

- kind: ``matmul`` (a dot, a YNNPACK or Triton fusion holding one: such a fusion may hold
  several matmuls and the elementwise work between them, or a cuBLAS GEMM custom-call),
  ``batched matmul`` (the same with batch dimensions: attention's scores and values; and
  cuDNN's fused attention), ``layout`` (copies, transposes, pads,
  slices, broadcasts, dynamic-update-slice: moving data, computing nothing), ``reduction``,
  ``gather/scatter``, ``elementwise`` (every other fusion). A dot that XLA rewrote as a
  reduction (XLA:GPU does so for the decode step's one-query attention) is a reduction here,
  while its FLOPs stay in the batched matmul's count;
- stage, from the instruction's op_name (the engine's named scopes and JAX's transformations):
  ``rollout: decode loop`` (the model's decode steps and the sampler), ``rollout: prefill``,
  ``rollout: reference`` (π_ref on the completions), ``rollout: other`` (rewards), ``update:
  forward``, ``update: backward``, ``update: reference`` (exact KL estimators), ``update:
  optimizer``, ``update: other``; ``other``: what XLA left unnamed.

Figures are thunk-ms per step: the sum of the thunks' own durations (on a mesh of several
devices, summed over the devices: each runs its own shard's thunks). Independent thunks run
concurrently on the CPU's threads (the sum can exceed the wall time; both are reported) and one
thunk may use several threads, so a share is a share of the program's busy time, not of cores.
Beside them, the step's matmul FLOPs (flop_count.matmul_flops_of, dense and batched apart) give
each matmul kind's FLOP rate per thunk-second. Control flow (while, conditional, call)
is not summed: its time is its body's. Writes ``--out_dir/<name>.json`` and ``.md``; with
``--hlo``, also the compiled HLO text beside them (an XLA dump of the one program). The last
line printed is the JSON (``--out_dir=`` prints only: experiments/gpu_suite.py's profile part).

  GRPO_JAX_DATA=/work/shared/data/tinyshakespeare.txt python experiments/profile_step.py \\
      --config=configs/shakespeare.py:sampled --config.group.size=8 \\
      --config.reference.kind=policy --config.grpo.kl_estimator=k3 \\
      --config.reward.terms=match --config.grpo.beta=0.04 --config.train.batch_size=8 \\
      --config.grpo.num_iterations=1            # the TRL-comparable step
"""

import json
import os
import platform
import shutil
import sys
import time

import device_lock
import jax
from absl import app, flags
from flop_count import matmul_flops_of, merged_uncounted
from measure import build_step, configure_host
from ml_collections import config_flags
from xla_profile import (
    KIND_BATCHED,
    markdown,
    module_name,
    parse_hlo,
    summarise,
    thunk_times,
    traced,
    write_results,
)

FLAGS = flags.FLAGS
config_flags.DEFINE_config_file("config", None, "Config file (path[:variant,...]).")
flags.DEFINE_integer("warmup", 2, "Untimed steps after compilation.", lower_bound=0)
flags.DEFINE_integer("steps", 3, "Steps traced (figures are per step).", lower_bound=1)
flags.DEFINE_string(
    "out_dir", "experiments/results", "Where the JSON and markdown go ('': print only)."
)
flags.DEFINE_string("name", "profile_cpu", "Basename of the results files.")
flags.DEFINE_bool("hlo", False, "Also write the compiled HLO text (<name>.hlo.txt).")
NO_COMMAND_BUFFERS = "--xla_gpu_enable_command_buffer="
flags.DEFINE_integer("top", 15, "Instructions listed in the markdown.", lower_bound=0)


def trace_step(config, steps: int, warmup: int):
    """Builds (on config.mesh, as benchmark.py does), compiles and traces the step; returns
    (compiled HLO text, trace dir, wall s per step, matmul FLOPs per step by kind)."""
    _, step, jstep, state, inputs, _, _ = build_step(config)
    if step.host is not None:
        raise app.UsageError(
            "a Python reward splits the step in two programs: profile the device part with a "
            "jittable reward (--config.reward.terms)"
        )
    state = [state]  # each step consumes (donates) the state it is given
    jaxpr = jax.make_jaxpr(step.fused)(state[0], inputs).jaxpr
    uncounted = []  # matmul work the count cannot size (a Pallas decode kernel's): reported
    flops = {k: matmul_flops_of(jaxpr, b, []) for k, b in KIND_BATCHED.items()}
    matmul_flops_of(jaxpr, uncounted=uncounted)
    flops = (flops, merged_uncounted(uncounted))
    with device_lock.shared():
        compiled = jstep.lower(state[0], inputs).compile()

    def run():
        state[0] = jax.block_until_ready(compiled(state[0], inputs))[0]

    with device_lock.timed():
        for _ in range(warmup):
            run()
        return (compiled.as_text(), *traced(run, steps), flops)


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    config = FLAGS.config
    # before the backend starts (see the docstring): each kernel names its own instruction
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {NO_COMMAND_BUFFERS}".strip()
    cpu_buffers = configure_host(config)
    hlo, trace_dir, wall, flops = trace_step(config, FLAGS.steps, FLAGS.warmup)
    instrs = parse_hlo(hlo)
    res = {
        "cpu_buffers": cpu_buffers,
        "name": FLAGS.name,
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{platform.machine()}, {jax.local_devices()[0].device_kind}",
        "device": f"{jax.device_count()} x {jax.devices()[0].platform}",
        "jax": jax.__version__,
        "dtype": config.model.get("dtype", "float32"),
        "command": "python experiments/profile_step.py " + " ".join(sys.argv[1:]),
        "xla_flags": os.environ["XLA_FLAGS"],
        "steps": FLAGS.steps,
        **summarise(
            instrs, thunk_times(trace_dir, instrs, module_name(hlo), FLAGS.steps), wall, FLAGS.top
        ),
        "matmul_gflop_per_step": {k: f / 1e9 for k, f in flops[0].items()},
        **({"matmul_uncounted": flops[1]} if flops[1] else {}),
        **device_lock.report(),
    }
    shutil.rmtree(trace_dir)  # tens of MB per traced step
    if FLAGS.out_dir:
        write_results(FLAGS.out_dir, FLAGS.name, res, markdown(res), hlo if FLAGS.hlo else None)
    print(markdown(res))
    print(json.dumps(res))  # the last line: what gpu_suite.py's profile part reads


if __name__ == "__main__":
    flags.mark_flags_as_required(["config"])
    app.run(main)
