"""Compile a config's GRPO step for a GPU on a machine without one, and read what XLA would
run there: whether it compiles (the Triton kernels of ``model.decode_kernel`` included, which
only a compile for the GPU checks), XLA's buffer plan for it (the device memory the step
needs), and the decode loop's kernels, per decode step and per layer.

XLA compiles ahead of time for a GPU it is only told about (a "deviceless" compile: jax's
``topologies.get_topology_desc`` with a target description, TARGETS below), through jax's
CUDA plugin. No GPU, driver or timing is involved: the program is the one XLA would run
there, except for its autotuner's choices (GEMM tilings, split-K), which a compile without
the device makes by XLA's defaults. The plugin must match this interpreter's jax; on a
machine with PyPI, in a venv of its own (about 5 GB):

  python -m venv /work/gpu_venv && /work/gpu_venv/bin/pip install -e . \\
      "jax[cuda13]==$(python -c 'import jax; print(jax.__version__)')"
  GRPO_JAX_DATA=/work/shared/data/tinyshakespeare.txt /work/gpu_venv/bin/python \\
      experiments/gpu_compile.py --config=configs/shakespeare.py:sampled \\
      --config.model.num_layers=12 ... --config.model.decode_kernel=flash --name=large_flash

(``--large`` applies gpu_suite_plan.LARGE, the suite's large model, under the command
line's own overrides). Writes ``--out_dir/<name>.json`` and ``.md`` (``--hlo``: also the
optimised HLO). On 2026-11-28 jax 0.10.2 compiled the large model's step for an H100 in
about 28 s on a 2-core CPU; its buffer plan, 23.46 GiB, is near the 23.04 GiB peak one H100
measured for that step (2026-11-28, jax 0.11.2). jax's cuDNN attention (``model.attention=cudnn``) does not lower this
way (jax looks for its rule on the CPU platform). A step with a Python reward (two programs
around a host call) is refused with an error line.
"""

import functools
import os
import sys
import time

import jax
from absl import app, flags
from gpu_compile_parts import TARGETS, TRITON, layer_kernels, loop_summary, markdown
from gpu_suite_plan import LARGE
from measure import build_step, executable_memory
from ml_collections import config_flags
from xla_profile import decode_loops, parse_hlo, write_results

from grpo_jax import decode_kernel, specs

FLAGS = flags.FLAGS
config_flags.DEFINE_config_file("config", None, "Config file (path[:variant,...]).")
flags.DEFINE_enum("gpu", "h100", sorted(TARGETS), "The GPU to compile for (TARGETS).")
flags.DEFINE_bool(
    "large",
    False,
    "The suite's large model: gpu_suite_plan.LARGE's overrides, where the "
    "command line sets no other value.",
)
flags.DEFINE_string("out_dir", "experiments/results", "Where the JSON and markdown go.")
flags.DEFINE_string("name", "gpu_compile", "Basename of the results files.")
flags.DEFINE_bool("hlo", False, "Also write the optimised HLO text (<name>.hlo.txt).")


def gpu_device(gpu: str):
    """The one device of a deviceless topology for ``gpu``; exits with an error line where
    this interpreter has no jax CUDA plugin to compile with."""
    from jax.experimental import topologies

    try:
        topology = topologies.get_topology_desc(
            platform="cuda", target_config=TARGETS[gpu], topology="1x1x1"
        )
    except (NotImplementedError, RuntimeError) as e:
        fix = f"pip install 'jax[cuda13]=={jax.__version__}' (no GPU or driver needed)"
        sys.exit(f"error: --gpu={gpu} needs jax's CUDA plugin in this interpreter: {fix} ({e})")
    return topologies.make_mesh(topology, (1,), ("x",))


def for_the_gpu():
    """This process builds the step for the GPU it compiles for, not for its own CPU: the
    config checks see a CUDA runtime (specs.gpu_runtime), and the Pallas decode kernels lower
    to Triton instead of JAX's interpreter, which they choose on a CPU backend."""
    specs.gpu_runtime = lambda: "cuda (deviceless compile)"
    for name, kernel in list(decode_kernel.KERNELS.items()):
        decode_kernel.KERNELS[name] = functools.partial(kernel, interpret=False)


def compile_step(config, mesh):
    """The config's fused step (state donated, as benchmark.py runs it) lowered on ``mesh``'s
    device and compiled: (compiled, seconds, params)."""
    _, step, _, state, inputs, _, n_params = build_step(config, on_mesh=False)
    if step.host is not None:
        sys.exit("error: a Python reward splits the step into two programs around a host call; "
                 "compile a step with a jittable reward (--config.reward.terms)")  # fmt: skip
    one = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    spec = lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=one)
    t0 = time.perf_counter()
    lowered = jax.jit(step.fused, donate_argnums=0).lower(
        jax.tree.map(spec, state), jax.tree.map(spec, inputs)
    )
    compiled = lowered.compile()
    return compiled, time.perf_counter() - t0, n_params


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    config = FLAGS.config
    # before jax's backends start: no device is used (a GPU that is present is hidden), and
    # the plugin's check of the CUDA libraries' versions would ask a driver there is none of
    os.environ["CUDA_VISIBLE_DEVICES"] = "-1"
    os.environ["JAX_SKIP_CUDA_CONSTRAINTS_CHECK"] = "1"
    mesh = gpu_device(FLAGS.gpu)
    if FLAGS.large:  # under the command line's own --config.* overrides
        for key, value in LARGE.items():
            if not any(a.startswith(f"--config.{key}=") for a in sys.argv[1:]):
                *path, last = key.split(".")
                functools.reduce(lambda node, k: node[k], path, config)[last] = value
    for_the_gpu()
    compiled, compile_s, n_params = compile_step(config, mesh)
    hlo = compiled.as_text()
    instrs = parse_hlo(hlo)
    loops = decode_loops(instrs)
    res = {
        "name": FLAGS.name,
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "device": TARGETS[FLAGS.gpu].split('device_description_str: "')[1].split('"')[0],
        "jax": jax.__version__,
        "dtype": config.model.get("dtype", "float32"),
        "command": "python experiments/gpu_compile.py " + " ".join(sys.argv[1:]),
        "params": n_params,
        "compile_s": compile_s,
        "memory": executable_memory(compiled),
        "triton_kernels": sum(1 for i in instrs.values() if i["target"] == TRITON),
        "decode_loops": loop_summary(loops),
        "layer_kernels": layer_kernels(loops),
    }
    write_results(FLAGS.out_dir, FLAGS.name, res, markdown(res), hlo if FLAGS.hlo else None)
    print(markdown(res))


if __name__ == "__main__":
    flags.mark_flags_as_required(["config"])
    app.run(main)
