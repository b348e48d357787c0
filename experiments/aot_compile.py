"""Compile a config's GRPO step for GPUs or TPUs on a machine without any ("ahead of
time"), and read what XLA would run there: whether it compiles (the Triton kernels of
``model.decode_kernel`` included, which only a compile for the GPU checks), XLA's buffer plan
for it (the device memory the step needs, per device, beside the device's own), the
collectives one step runs across the devices, and on a GPU the decode loop's kernels, per
decode step and per layer.

XLA compiles for devices it is only told about (a "deviceless" compile: jax's
``topologies.get_topology_desc``): a GPU from a target description (aot_targets.TARGETS)
through jax's CUDA plugin, a TPU slice by its topology name (aot_targets.TPUS, ``--devices``
picks the slice) through libtpu. No device, driver or timing is involved. The step is built
as the trainer builds it, on ``config.mesh`` over the ``--devices`` (measure.abstract_step),
a slice of several hosts included (the v5e's 16 devices are four hosts'). The program is the
one XLA would run there, except, on a GPU, for its autotuner's choices (GEMM tilings,
split-K), which a compile without the device makes by XLA's defaults; some GEMM shapes then
find no Triton tiling, and ``--notriton_gemm`` compiles every GEMM as a cuBLAS call instead.
The plugin must match this interpreter's jax; on a machine with PyPI, in a venv of its own
(about 5 GB with CUDA's, 0.7 GB more with libtpu):

  python -m venv /work/aot_venv && /work/aot_venv/bin/pip install -e . \\
      "jax[cuda13]==$(python -c 'import jax; print(jax.__version__)')"    # or jax[tpu]==...
  GRPO_JAX_DATA=/work/shared/data/tinyshakespeare.txt /work/aot_venv/bin/python \\
      experiments/aot_compile.py --config=configs/shakespeare.py:sampled --large \\
      --config.model.decode_kernel=flash --name=large_flash

(``--large`` applies gpu_suite_plan.LARGE, the suite's large model, under the command
line's own overrides). Writes ``--out_dir/<name>.json`` and ``.md`` (``--hlo``: also the
optimised HLO). On 2026-11-28 jax 0.10.2 compiled the large model's step for an H100 in
about 30 s on a 2-core CPU; its buffer plan, 23.46 GiB, is near the 23.04 GiB peak one H100
measured for that step (2026-11-28, jax 0.11.2). jax's cuDNN attention
(``model.attention=cudnn``) does not lower this way (jax looks for its rule on the CPU
platform). A step with a Python reward (two programs around a host call) is refused with an
error line. A TPU's program is one program, not kernel launches: the report counts no
kernels there. Until 2026-11-28 this script was gpu_compile.py, whose ``--gpu`` (default
h100) is now ``--target``.
"""

import functools
import os
import sys
import time

import jax
from absl import app, flags
from aot_targets import (
    GPUS,
    SINGLE_CHIP,
    TARGETS,
    TPUS,
    TRITON,
    device_memory,
    layer_kernels,
    loop_summary,
    markdown,
    tpu_topology,
)
from gpu_suite_plan import LARGE
from hlo_collectives import collectives
from measure import abstract_step, executable_memory
from ml_collections import config_flags
from xla_profile import decode_loops, parse_hlo, write_results

from grpo_jax import decode_kernel, specs

FLAGS = flags.FLAGS
config_flags.DEFINE_config_file("config", None, "Config file (path[:variant,...]).")
flags.DEFINE_enum(
    "target", "h100", sorted(TARGETS) + sorted(TPUS), "The GPU or TPU to compile for."
)
flags.DEFINE_bool(
    "large",
    False,
    "The suite's large model: gpu_suite_plan.LARGE's overrides, where the "
    "command line sets no other value.",
)
flags.DEFINE_integer(
    "devices",
    1,
    "Devices of the --target (a TPU's: a slice aot_targets.TPUS names); the step runs on "
    "config.mesh over them.",
    lower_bound=1,
)
flags.DEFINE_bool(
    "triton_gemm",
    True,
    "XLA's Triton GEMMs (its default); --notriton_gemm compiles GEMMs as cuBLAS calls, for "
    "shapes whose default Triton tiling fails without the device's autotuner.",
)
flags.DEFINE_string("out_dir", "experiments/results", "Where the JSON and markdown go.")
flags.DEFINE_string("name", "aot_compile", "Basename of the results files.")
flags.DEFINE_bool("hlo", False, "Also write the optimised HLO text (<name>.hlo.txt).")


def target_devices(target: str, n: int) -> list:
    """The ``n`` devices of a deviceless topology of ``target``s; exits with an error line
    where the TPU has no such slice, or this interpreter lacks the plugin to compile with."""
    from jax.experimental import topologies

    if target in GPUS:
        plugin, extra = "jax's CUDA plugin", "cuda13"
        kwargs = dict(platform="cuda", target_config=TARGETS[target], topology=f"1x1x{n}")
    else:
        plugin, extra = "libtpu", "tpu"
        try:
            name = tpu_topology(target, n)
        except ValueError as e:
            sys.exit(f"error: {e}; name one of them")
        one = dict(chips_per_host_bounds=(1, 1, 1)) if name.split(":")[1] in SINGLE_CHIP else {}
        kwargs = dict(platform="tpu", topology_name=name, **one)
    try:
        topology = topologies.get_topology_desc(**kwargs)
    except (NotImplementedError, RuntimeError) as e:
        if "lockfile" in str(e):  # libtpu serves one process a machine
            sys.exit("error: another process on this machine holds libtpu; run one TPU compile "
                     "at a time")  # fmt: skip
        fix = f"pip install 'jax[{extra}]=={jax.__version__}' (no device or driver needed)"
        sys.exit(f"error: --target={target} needs {plugin} in this interpreter: {fix} ({e})")
    return list(topology.devices)


def for_the_target(target: str):
    """This process builds the step for the device it compiles for, not for its own CPU: the
    config checks see its runtime (specs.gpu_runtime: a GPU kernel's setting is refused on a
    TPU as on a CPU), and on a GPU the Pallas decode kernels lower to Triton instead of JAX's
    interpreter, which they choose on a CPU backend."""
    if target in TPUS:
        specs.gpu_runtime = lambda: "tpu (deviceless compile)"
        return
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
    config, target = FLAGS.config, FLAGS.target
    if target in TPUS and not FLAGS.triton_gemm:
        sys.exit(f"error: --notriton_gemm chooses a GPU's GEMMs; drop it for --target={target}")
    # before jax's backends start: no device is used (a GPU that is present is hidden), and
    # the plugin's check of the CUDA libraries' versions would ask a driver there is none of
    os.environ["CUDA_VISIBLE_DEVICES"] = "-1"
    os.environ["JAX_SKIP_CUDA_CONSTRAINTS_CHECK"] = "1"
    if target in TPUS:  # jax's own backend stays the CPU's, and libtpu asks no cloud metadata
        jax.config.update("jax_platforms", "cpu")
        os.environ["TPU_SKIP_MDS_QUERY"] = "1"
        os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    if not FLAGS.triton_gemm:
        flag = "--xla_gpu_enable_triton_gemm=false"
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flag}".strip()
    devices = target_devices(target, FLAGS.devices)
    if FLAGS.large:  # under the command line's own --config.* overrides
        overridden = config_flags.get_override_values(FLAGS["config"])
        for key, value in LARGE.items():
            if key not in overridden:
                *path, last = key.split(".")
                functools.reduce(lambda node, k: node[k], path, config)[last] = value
    for_the_target(target)
    compiled, compile_s, mesh, n_params = compile_step(config, devices)
    hlo = compiled.as_text()
    res = report(target, config, compiled, parse_hlo(hlo), mesh, n_params)
    res["compile_s"] = compile_s
    write_results(FLAGS.out_dir, FLAGS.name, res, markdown(res), hlo if FLAGS.hlo else None)
    print(markdown(res))


def report(target: str, config, compiled, instrs: dict, mesh, n_params: int) -> dict:
    """The record of one compile (aot_targets.markdown renders it). On a TPU, no Triton
    kernels or decode-step kernel counts: its program is not kernel launches."""
    gpu = target in GPUS
    loops = decode_loops(instrs)
    in_loops = collectives(instrs, within=[loop["name"] for loop in loops])
    loops = loops if gpu else []  # a TPU's fusions are not launches: no kernels to count
    res = {
        "name": FLAGS.name,
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "device": (GPUS if gpu else TPUS)[target][0],
        "platform": "gpu" if gpu else "tpu",
        "devices": FLAGS.devices,
        "device_memory_bytes": device_memory(target),
        "mesh": dict(mesh.shape),
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "jax": jax.__version__,
        "dtype": config.model.get("dtype", "float32"),
        "command": "python experiments/aot_compile.py " + " ".join(sys.argv[1:]),
        "params": n_params,
        "memory": executable_memory(compiled),
        "collectives": collectives(instrs),
        "decode_loop_collectives": in_loops,
        "decode_loops": loop_summary(loops),
        "layer_kernels": layer_kernels(loops),
    }
    if gpu:
        res["triton_kernels"] = sum(1 for i in instrs.values() if i["target"] == TRITON)
    return res


if __name__ == "__main__":
    flags.mark_flags_as_required(["config"])
    app.run(main)
