"""Compile a config's GRPO step for one or several GPUs on a machine without any, and read
what XLA would run there: whether it compiles (the Triton kernels of ``model.decode_kernel``
included, which only a compile for the GPU checks), XLA's buffer plan for it (the device
memory the step needs, per device), the collectives one step runs across the devices, and
the decode loop's kernels, per decode step and per layer.

XLA compiles ahead of time for GPUs it is only told about (a "deviceless" compile: jax's
``topologies.get_topology_desc`` with a target description, gpu_compile_parts.TARGETS)
through jax's CUDA plugin. No GPU, driver or timing is involved. The step is built as the
trainer builds it, on ``config.mesh`` over ``--devices`` GPUs (measure.abstract_step). The
program is the one XLA would run there, except for its autotuner's choices (GEMM tilings,
split-K), which a compile without the device makes by XLA's defaults; some GEMM shapes then
find no Triton tiling, and ``--notriton_gemm`` compiles every GEMM as a cuBLAS call instead.
The plugin must match this interpreter's jax; on a machine with PyPI, in a venv of its own
(about 5 GB):

  python -m venv /work/gpu_venv && /work/gpu_venv/bin/pip install -e . \\
      "jax[cuda13]==$(python -c 'import jax; print(jax.__version__)')"
  GRPO_JAX_DATA=/work/shared/data/tinyshakespeare.txt /work/gpu_venv/bin/python \\
      experiments/gpu_compile.py --config=configs/shakespeare.py:sampled --large \\
      --config.model.decode_kernel=flash --name=large_flash

(``--large`` applies gpu_suite_plan.LARGE, the suite's large model, under the command
line's own overrides). Writes ``--out_dir/<name>.json`` and ``.md`` (``--hlo``: also the
optimised HLO). On 2026-11-28 jax 0.10.2 compiled the large model's step for an H100 in
about 30 s on a 2-core CPU; its buffer plan, 23.46 GiB, is near the 23.04 GiB peak one H100
measured for that step (2026-11-28, jax 0.11.2). jax's cuDNN attention
(``model.attention=cudnn``) does not lower this way (jax looks for its rule on the CPU
platform). A step with a Python reward (two programs around a host call) is refused with an
error line.
"""

import functools
import os
import sys
import time

import jax
from absl import app, flags
from gpu_compile_parts import GPUS, TARGETS, TRITON, layer_kernels, loop_summary, markdown
from gpu_suite_plan import LARGE
from measure import abstract_step, executable_memory
from ml_collections import config_flags
from xla_profile import collectives, decode_loops, parse_hlo, write_results

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
flags.DEFINE_integer(
    "devices", 1, "GPUs in the topology; the step runs on config.mesh over them.", lower_bound=1
)
flags.DEFINE_bool(
    "triton_gemm",
    True,
    "XLA's Triton GEMMs (its default); --notriton_gemm compiles GEMMs as cuBLAS calls, for "
    "shapes whose default Triton tiling fails without the device's autotuner.",
)
flags.DEFINE_string("out_dir", "experiments/results", "Where the JSON and markdown go.")
flags.DEFINE_string("name", "gpu_compile", "Basename of the results files.")
flags.DEFINE_bool("hlo", False, "Also write the optimised HLO text (<name>.hlo.txt).")


def gpu_devices(gpu: str, n: int) -> list:
    """The ``n`` devices of a deviceless topology of ``gpu``s; exits with an error line where
    this interpreter has no jax CUDA plugin to compile with."""
    from jax.experimental import topologies

    try:
        topology = topologies.get_topology_desc(
            platform="cuda", target_config=TARGETS[gpu], topology=f"1x1x{n}"
        )
    except (NotImplementedError, RuntimeError) as e:
        fix = f"pip install 'jax[cuda13]=={jax.__version__}' (no GPU or driver needed)"
        sys.exit(f"error: --gpu={gpu} needs jax's CUDA plugin in this interpreter: {fix} ({e})")
    return list(topology.devices)


def for_the_gpu():
    """This process builds the step for the GPU it compiles for, not for its own CPU: the
    config checks see a CUDA runtime (specs.gpu_runtime), and the Pallas decode kernels lower
    to Triton instead of JAX's interpreter, which they choose on a CPU backend."""
    specs.gpu_runtime = lambda: "cuda (deviceless compile)"
    for name, kernel in list(decode_kernel.KERNELS.items()):
        decode_kernel.KERNELS[name] = functools.partial(kernel, interpret=False)


def compile_step(config, devices):
    """The config's fused step on ``config.mesh`` over ``devices`` (state donated, as the
    trainer runs it), lowered and compiled: (compiled, seconds, mesh, params); an error line
    where the config cannot be built so or XLA's Triton GEMM emitter finds no tiling."""
    try:
        jstep, state, inputs, mesh, n_params = abstract_step(config, devices)
    except ValueError as e:
        sys.exit(f"error: {e}")
    t0 = time.perf_counter()
    try:
        compiled = jstep.lower(state, inputs).compile()
    except jax.errors.JaxRuntimeError as e:
        if "Couldn't find output tile sizes" not in str(e):
            raise
        # without the device XLA cannot autotune, and its default Triton tilings miss some
        # GEMM shapes (the update's, at several devices); cuBLAS takes any
        sys.exit("error: XLA's Triton GEMM emitter found no tiling for a GEMM without the "
                 "device's autotuner; rerun with --notriton_gemm (cuBLAS GEMMs)")  # fmt: skip
    return compiled, time.perf_counter() - t0, mesh, n_params


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    config = FLAGS.config
    # before jax's backends start: no device is used (a GPU that is present is hidden), and
    # the plugin's check of the CUDA libraries' versions would ask a driver there is none of
    os.environ["CUDA_VISIBLE_DEVICES"] = "-1"
    os.environ["JAX_SKIP_CUDA_CONSTRAINTS_CHECK"] = "1"
    if not FLAGS.triton_gemm:
        flag = "--xla_gpu_enable_triton_gemm=false"
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flag}".strip()
    devices = gpu_devices(FLAGS.gpu, FLAGS.devices)
    if FLAGS.large:  # under the command line's own --config.* overrides
        overridden = config_flags.get_override_values(FLAGS["config"])
        for key, value in LARGE.items():
            if key not in overridden:
                *path, last = key.split(".")
                functools.reduce(lambda node, k: node[k], path, config)[last] = value
    for_the_gpu()
    compiled, compile_s, mesh, n_params = compile_step(config, devices)
    hlo = compiled.as_text()
    instrs = parse_hlo(hlo)
    loops = decode_loops(instrs)
    res = {
        "name": FLAGS.name,
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "device": GPUS[FLAGS.gpu][0],
        "devices": FLAGS.devices,
        "mesh": dict(mesh.shape),
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "jax": jax.__version__,
        "dtype": config.model.get("dtype", "float32"),
        "command": "python experiments/gpu_compile.py " + " ".join(sys.argv[1:]),
        "params": n_params,
        "compile_s": compile_s,
        "memory": executable_memory(compiled),
        "triton_kernels": sum(1 for i in instrs.values() if i["target"] == TRITON),
        "collectives": collectives(instrs),
        "decode_loops": loop_summary(loops),
        "layer_kernels": layer_kernels(loops),
    }
    write_results(FLAGS.out_dir, FLAGS.name, res, markdown(res), hlo if FLAGS.hlo else None)
    print(markdown(res))


if __name__ == "__main__":
    flags.mark_flags_as_required(["config"])
    app.run(main)
