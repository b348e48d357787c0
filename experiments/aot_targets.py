"""The flag-free parts of experiments/aot_compile.py (tests import them): the GPUs and TPUs
it compiles for, and its report of a compiled step (counts and markdown)."""

import collections

# XLA's description of each GPU (its GpuTargetConfig proto, text form): what the compiler
# reads of a device. The H100's figures are NVIDIA's for the SXM part; the H200's differ in
# its memory (139 GiB as the device tool reports it) and bandwidth (4.8 TB/s).
_HOPPER = """gpu_device_info {{
  threads_per_block_limit: 1024 threads_per_warp: 32 shared_memory_per_block: 49152
  shared_memory_per_core: 233472 threads_per_core_limit: 2048 core_count: 132
  fpus_per_core: 128 block_dim_limit_x: 2147483647 block_dim_limit_y: 65535
  block_dim_limit_z: 65535 memory_bandwidth: {bandwidth} l2_cache_size: 52428800
  clock_rate_ghz: 1.98 device_memory_size: {memory} shared_memory_per_block_optin: 232448
  cuda_compute_capability {{ major: 9 minor: 0 }}
  registers_per_core_limit: 65536 registers_per_block_limit: 65536
}}
platform_name: "CUDA"
dnn_version_info {{ major: 9 minor: 8 }}
runtime_version {{ major: 13 minor: 0 }}
device_description_str: "{name}"
"""
GPUS = {  # --target: (device name, memory bytes, bandwidth bytes/s)
    "h100": ("NVIDIA H100 80GB HBM3", 84929347584, 3352320000000),
    "h200": ("NVIDIA H200", 149250000000, 4800000000000),
}
TARGETS = {
    gpu: _HOPPER.format(name=name, memory=memory, bandwidth=bandwidth)
    for gpu, (name, memory, bandwidth) in GPUS.items()
}
TRITON = "__gpu$xla.gpu.triton"

GIB = 2**30
# --target: (device kind as jax names it, HBM per device, {devices: libtpu's topology}).
# HBM is Google's figure per chip; v2 and v3 chips are two devices (cores) of half each. The
# sizes are the slices one host or a few hold (Colab's v5e-1, v6e-1 and v2-8, Kaggle's v3-8);
# libtpu builds a single chip's topology only with chips_per_host_bounds 1x1x1 (SINGLE_CHIP).
TPUS = {
    "v2": ("TPU v2", 8 * GIB, {2: "1x1", 8: "2x2", 32: "4x4"}),
    "v3": ("TPU v3", 16 * GIB, {2: "1x1", 8: "2x2", 32: "4x4"}),
    "v5e": ("TPU v5 lite", 16 * GIB, {1: "1x1", 4: "2x2", 8: "2x4", 16: "4x4"}),
    "v5p": ("TPU v5", 95 * GIB, {1: "1x1x1", 4: "2x2x1", 8: "2x2x2", 16: "2x2x4"}),
    "v6e": ("TPU v6 lite", 32 * GIB, {1: "1x1", 4: "2x2", 8: "2x4", 16: "4x4"}),
}
SINGLE_CHIP = {"1x1", "1x1x1"}


def device_memory(target: str) -> int:
    """One device's memory, in bytes, for --target."""
    return GPUS[target][1] if target in GPUS else TPUS[target][1]


def tpu_topology(target: str, devices: int) -> str:
    """libtpu's topology name for ``devices`` devices of a TPU --target ("v5e:2x4"); a
    ValueError naming the sizes there are where the table has no such slice."""
    sizes = TPUS[target][2]
    if devices not in sizes:
        have = ", ".join(map(str, sorted(sizes)))
        raise ValueError(f"--devices={devices}: a {target} slice here has {have} devices")
    return f"{target}:{sizes[devices]}"


def loop_summary(loops: list) -> list:
    """Per decode loop: its trip count, kernels per decode step, per layer (least and most
    over the layers) and outside the layers (with those whose op names no layer: XLA drops
    some names in a loop body)."""
    rows = []
    for loop in loops:
        per_layer = collections.Counter(k[2] for k in loop["kernels"] if k[2] is not None)
        outside = sum(1 for k in loop["kernels"] if k[2] is None)
        counts = list(per_layer.values()) or [0]
        rows.append(dict(loop=loop["name"], trip=loop["trip"], kernels=len(loop["kernels"]),
                         layers=len(per_layer), per_layer=(min(counts), max(counts)),
                         outside_layers=outside))  # fmt: skip
    return rows


def layer_kernels(loops: list, layer: int = 1) -> list:
    """The longest decode loop's kernels of one layer (by default the second: the first can
    hold more; a one-layer model's only one) and those outside the layers, as (name, kind,
    layer, source op, shape)."""
    if not loops:
        return []
    longest = max(loops, key=lambda lp: lp["trip"] or 0)
    layers = {k[2] for k in longest["kernels"] if k[2] is not None}
    layer = layer if layer in layers else min(layers, default=None)
    return [k for k in longest["kernels"] if k[2] in (layer, None)]


def collectives_line(rows: dict) -> str:
    """One step's collectives as a sentence: count and bytes per kind, or none."""
    if not rows:
        return "none"
    mb = lambda b: f"{b / 1e6:,.1f} MB"
    return ", ".join(f"{k} {r['count']:,} ({mb(r['bytes'])})" for k, r in sorted(rows.items()))


NO_KERNELS = (
    "A TPU runs the step as one program: its fusions are not kernel launches, so this report "
    "counts none per decode step."
)


def fits_words(res: dict) -> str:
    """`` of the device's N GiB: fits`` (or ``: does not fit``) where the record names its
    device's memory (records before 2026-11-28's TPU targets do not)."""
    if "device_memory_bytes" not in res:
        return ""
    have, need = res["device_memory_bytes"], res["memory"]["executable_bytes"]
    verdict = "fits" if need <= have else "does not fit"
    return f" of the device's {have / 2**30:.0f} GiB: {verdict}"


def markdown(res: dict) -> str:
    mem = res["memory"]
    shown = next((k[2] for k in res["layer_kernels"] if k[2] is not None), "-")
    gib = lambda b: f"{b / 2**30:.2f} GiB"
    mesh = " x ".join(f"{k} {v}" for k, v in res["mesh"].items())
    lines = [
        f"# {res['name']}: the step compiled for {res['devices']} x {res['device']}, without one",
        "",
        f"{res['when']}; jax {res['jax']}; compute dtype {res['dtype']}; {res['params']:,} params; "
        f"mesh {mesh}; XLA_FLAGS `{res['xla_flags']}`. Command: `{res['command']}`.",
        "",
        f"- compiled in {res['compile_s']:.1f} s"
        + (
            f"; Triton kernels in the program: {res['triton_kernels']}"
            if "triton_kernels" in res
            else ""
        ),  # fmt: skip
        f"- XLA's buffer plan per device: {gib(mem['executable_bytes'])} (arguments "
        f"{gib(mem['executable_memory']['argument'])}, temporaries "
        f"{gib(mem['executable_memory']['temp'])}){fits_words(res)}",
        f"- collectives per step (each device): {collectives_line(res['collectives'])}",
    ]
    if "decode_loop_collectives" in res:
        lines.append(f"  - of them in the decode loops: "
                     f"{collectives_line(res['decode_loop_collectives'])}")  # fmt: skip
    lines.append("")
    if res.get("platform") == "tpu":
        return "\n".join(lines + [NO_KERNELS]) + "\n"
    lines += [
        "| decode loop | steps | kernels per step | per layer | outside the layers, unnamed |",
        "| --- | --- | --- | --- | --- |",
    ]
    for r in res["decode_loops"]:
        lo, hi = r["per_layer"]
        per = f"{lo}" if lo == hi else f"{lo}-{hi}"
        lines.append(f"| {r['loop']} | {r['trip']} | {r['kernels']} | {per} ({r['layers']} "
                     f"layers) | {r['outside_layers']} |")  # fmt: skip
    lines += [
        "",
        f"The longest decode loop's kernels of layer {shown}, and those outside the layers:",
        "",
        "| instruction | kind | layer | source op | shape |",
        "| --- | --- | --- | --- | --- |",
    ]
    for name, kind, layer, op, shape in res["layer_kernels"]:
        where = "-" if layer is None else str(layer)
        lines.append(f"| {name} | {kind} | {where} | `{op}` | `{shape[:70]}` |")
    return "\n".join(lines) + "\n"
