"""The GPU suite's parts (experiments/gpu_suite.py runs them; their sizes are in
gpu_suite_plan.py): the child processes that measure them (benchmark.py, trl_grpo.py,
scaling.py --one_run, profile_step.py, and the probe and the matmul peaks, which
gpu_suite.py runs as ``--child=probe`` and ``--child=peak``), the nominal peak table by
device_kind and MFU."""

from __future__ import annotations

import json
import os
import shlex
import sys
from pathlib import Path

from gpu_suite_plan import LARGE_PARTS

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
SUITE = HERE / "gpu_suite.py"  # the CLI; its --child=probe / peak run probe() / peak() below

# device_kind substring -> nominal dense peak FLOP/s (bf16, tf32, fp32 without tensor cores);
# the first match wins (so "H100 PCIe" before "H100"). None: no nominal figure (a CPU).
NOMINAL_PEAKS = (
    ("H200", {"bfloat16": 989e12, "tf32": 494e12, "float32": 67e12}),
    ("H100 PCIe", {"bfloat16": 756e12, "tf32": 378e12, "float32": 51e12}),
    ("H100", {"bfloat16": 989e12, "tf32": 494e12, "float32": 67e12}),  # SXM, "80GB HBM3"
    ("A100", {"bfloat16": 312e12, "tf32": 156e12, "float32": 19.5e12}),
)
# device_kind substring -> nominal HBM bandwidth in bytes/s, the first match wins
NOMINAL_BANDWIDTH = (
    ("H200", 4.8e12),
    ("H100 PCIe", 2.0e12),
    ("H100", 3.35e12),  # SXM, "80GB HBM3"
    ("A100-SXM4-80GB", 2.039e12),
    ("A100", 1.555e12),
)
# jax_default_matmul_precision values under which float32 matmuls run on tensor cores
TF32_PRECISIONS = (None, "", "default", "fastest", "tensorfloat32", "high", "bfloat16")

# ---------------------------------------------------------------------------------------
# the probe: gpu_suite.py --child=probe, in its own process


def progress(what: str) -> None:
    """A line on stderr, which the suite's log shows if the probe runs out of time."""
    print(f"probe: {what}", file=sys.stderr, flush=True)


def probe() -> dict:
    """The device, versions and matmul precision (no step is built here: benchmark.py counts
    each step's FLOPs, halves included, in its own process; the matmul peaks are measured
    by peak(), each dtype in its own time-limited process)."""
    import jax
    import jaxlib

    progress("starting the backend")
    dev = jax.devices()[0]
    precision = jax.config.jax_default_matmul_precision
    return {
        "device_kind": dev.device_kind,
        "platform": dev.platform,
        "device_count": jax.device_count(),
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "default_matmul_precision": precision,
        "float32_matmuls": (
            f"jax_default_matmul_precision={precision} (DEFAULT: XLA may run float32 "
            "matmuls on TF32 tensor cores; the measured float32 peak shows whether it does)"
            if dev.platform == "gpu" and precision in TF32_PRECISIONS
            else f"jax_default_matmul_precision={precision}"
        ),
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "memory_bytes_limit": (dev.memory_stats() or {}).get("bytes_limit"),
    }


def peak(spec: dict) -> dict:
    """The measured matmul peak of one dtype at large shapes (gpu_suite.py --child=peak). Its
    own process, so a slow compile costs its time limit and nothing else: on one H200 the
    probe that measured both dtypes in one process timed out at 300 s, compiling an earlier
    peak loop's fused bfloat16 matmul, and took the device's record with it."""
    import device_lock
    import jax
    from measure import matmul_peak

    progress(f"{jax.devices()[0].device_kind}: the {spec['dtype']} matmul peak")
    by_shape, best = matmul_peak([tuple(s) for s in spec["peak_shapes"]], spec["dtype"])
    return {"flops_per_s": best * 1e9, "gflops_by_shape": by_shape, **device_lock.report()}


# ---------------------------------------------------------------------------------------
# MFU


def nominal_peak(device_kind: str, dtype: str, precision) -> float | None:
    for key, peaks in NOMINAL_PEAKS:
        if key in device_kind:
            if dtype == "float32":
                return peaks["tf32" if precision in TF32_PRECISIONS else "float32"]
            return peaks.get(dtype)
    return None


def nominal_of(info: dict, dtype: str) -> float | None:
    return nominal_peak(info.get("device_kind", ""), dtype, info.get("default_matmul_precision"))


def utilisation(flops, seconds, dtype: str, info: dict, devices: int = 1) -> dict:
    """MFU against the nominal and the measured peak (None where either is unknown).
    ``flops`` is the whole program's (flop_count counts a partitioned step's global work), so
    on a mesh of ``devices`` the peaks are one device's times that many."""
    if not flops or not seconds:
        return {"mfu_nominal": None, "mfu_measured": None}
    rate = flops / seconds
    nominal = nominal_of(info, dtype)
    measured = info.get("measured_peak", {}).get(dtype, {}).get("flops_per_s")
    nominal, measured = (devices * x if x else x for x in (nominal, measured))
    return {
        "achieved_flops_per_s": rate,
        "nominal_peak_flops_per_s": nominal,
        "measured_peak_flops_per_s": measured,
        "mfu_nominal": rate / nominal if nominal else None,
        "mfu_measured": rate / measured if measured else None,
    }


def decode_bytes(overrides: dict, params: int) -> float | None:
    """The least memory traffic of a sampled rollout's decode loop (rollout.decode_members)
    for a benchmark.py record's config ``overrides`` (None where they do not name the model's
    sizes): each of its H - 1 steps reads every weight in the compute dtype, the prompts'
    keys and values (L x 2 x [B, P, D]) and the member cache at that step's segment length
    (L x 2 x [B, G, S, D]; rollout.cache_segments). With ``model.decode_kernel`` ``pallas``
    or ``flash`` a step reads only the cache chunks holding its written slots
    (decode_kernel.BLOCK each) and the prompt padded as the kernel pads it
    (decode_kernel.PROMPT_ALIGN). What a step writes (one cache slot) and its activations are rows,
    not matrices, and are left out."""
    import jax.numpy as jnp

    from grpo_jax.decode_kernel import BLOCK, PROMPT_ALIGN
    from grpo_jax.rollout import cache_segments

    keys = ("model.num_layers", "model.d_model", "train.batch_size", "group.size")
    keys += ("data.context_len", "data.horizon", "model.dtype")
    if not all(k in overrides for k in keys):
        return None
    n_l, d, b, g, p, h, dtype = (overrides[k] for k in keys)
    size = jnp.dtype(dtype).itemsize
    kernel = overrides.get("model.decode_kernel", "xla")
    pallas = kernel != "xla"
    ends = cache_segments(h - 1)  # XLA's steps read their segment's whole cache
    p = -(-p // PROMPT_ALIGN[kernel]) * PROMPT_ALIGN[kernel] if pallas else p
    total = 0
    for t in range(h - 1):
        slots = (t // BLOCK + 1) * BLOCK if pallas else next(e for e in ends if t < e)
        total += (params + n_l * 2 * b * p * d + n_l * 2 * b * g * slots * d) * size
    return total


def rollout_floor(flops, loop_flops, seconds, nbytes, dtype: str, info: dict) -> dict | None:
    """The rollout's floor on the device's nominal figures. Its phases run one after another
    (the prompt prefill, then the decode loop, then the reference's pass over the sampled
    tokens), so the floor is their sum: the matmuls outside the loop (``flops`` less
    ``loop_flops``: benchmark.flop_counts' rollout_loop_matmul_flops) at the peak, plus the
    decode loop's larger of its matmuls at the peak and its least traffic (decode_bytes) at
    the HBM bandwidth. ``mfu_ceiling`` is then the most MFU the rollout can reach as built.
    (Until 2026-11-29 the floor was max(all FLOPs / peak, traffic / bandwidth), as if the
    phases overlapped: 31.1 % where this gives 26.5 % for the H100's large model.)"""
    kind = info.get("device_kind", "")
    bandwidth = next((bw for key, bw in NOMINAL_BANDWIDTH if key in kind), None)
    peak = nominal_of(info, dtype)
    if not (flops and loop_flops and seconds and nbytes and bandwidth and peak):
        return None
    outside_s, loop_s, memory_s = (flops - loop_flops) / peak, loop_flops / peak, nbytes / bandwidth
    floor_s = outside_s + max(loop_s, memory_s)
    return {
        "decode_bytes": nbytes,
        "bandwidth_bytes_per_s": bandwidth,
        "compute_s": flops / peak,
        "outside_loop_compute_s": outside_s,
        "loop_compute_s": loop_s,
        "memory_s": memory_s,
        "floor_s": floor_s,
        "times_floor": seconds / floor_s,
        "mfu_ceiling": flops / floor_s / peak,
    }


# ---------------------------------------------------------------------------------------
# the jobs: one child process each ({part, key, cmd, timeout[, shown]})

TRL_CHILD = """
import json, sys
sys.path.insert(0, sys.argv[1])
try:
    import datasets, torch, transformers, trl  # noqa: F401
except ImportError as e:  # not installed here: the part is skipped, not failed
    print(json.dumps({"skipped": f"{type(e).__name__}: {e}"}))
    raise SystemExit(0)
from trl_grpo import run
print(json.dumps(run(**json.loads(sys.argv[2]))))
"""


def shown(cmd: list, trl_python: str) -> str:
    """A child's command as a person runs it from the repo root."""
    parts = ["python" if c in (sys.executable, trl_python) else c for c in cmd]
    parts = [str(Path(c).relative_to(ROOT)) if c.startswith(str(ROOT)) else c for c in parts]
    return shlex.join(parts)


def config_args(variant: str, overrides: dict) -> list:
    args = [f"--config=configs/shakespeare.py:{variant}"]
    return args + [f"--config.{k}={v}" for k, v in overrides.items()]


def bench_job(part: str, cfg: dict, dtype: str, key: str = "") -> dict:
    """benchmark.py on ``cfg``'s workload in ``dtype``, keyed by ``key`` (default: the dtype)."""
    overrides = {**cfg["overrides"], "model.dtype": dtype}
    cmd = [sys.executable, str(HERE / "benchmark.py"), *config_args(cfg["variant"], overrides)]
    job = {"part": part, "key": key or dtype, "cmd": [*cmd, *cfg["args"]]}
    return {**job, "timeout": cfg["timeout"]}


def jobs_of(p: dict, parts, trl_python: str) -> list:
    """Every child of the run, in the order a GPU runs them (the probe and the peaks first);
    the TRL part's in ``trl_python``."""
    jobs = probe_jobs(p)
    if "step" in parts:
        jobs += [bench_job("step", p["step"], d) for d in p["step"]["dtypes"]]
    if "trl" in parts:
        jobs += trl_jobs(p, trl_python)
    if "exhaustive" in parts:
        jobs += exhaustive_jobs(p["exhaustive"])
    for part in LARGE_PARTS:
        if part in parts and part in p:  # the smoke plan has no pallas part
            jobs += large_jobs(p[part], part)
    if "profile" in parts:
        jobs += profile_jobs(p["profile"])
    for job in jobs:  # the scheduler's hints (gpu_suite_plan.schedule)
        hint = p.get("expect", {}).get(f"{job['part']} {job['key']}")
        if hint:
            job["expect_s"], job["expect_bytes"] = hint
    return jobs


def profile_jobs(cfg: dict) -> list:
    """profile_step.py on each of the plan's workloads, keyed by the workload's name."""
    jobs = []
    for name, (variant, overrides) in cfg["runs"].items():
        cmd = [sys.executable, str(HERE / "profile_step.py")]
        cmd += [*config_args(variant, overrides), "--out_dir=", *cfg["args"]]
        jobs.append({"part": "profile", "key": name, "cmd": cmd, "timeout": cfg["timeout"]})
    return jobs


def probe_jobs(p: dict) -> list:
    """The probe (gpu_suite.py --child=probe: the device), then each dtype's matmul peak
    (--child=peak), every one a process of its own with its own time limit."""
    jobs = [
        {
            "part": "probe",
            "key": "device",
            "cmd": [sys.executable, str(SUITE), "--child=probe"],
            "timeout": p["probe_timeout"],
        }
    ]
    for d in p["dtypes"]:
        spec = json.dumps({"dtype": d, "peak_shapes": p["peak_shapes"]})
        cmd = [sys.executable, str(SUITE), "--child=peak", f"--child_spec={spec}"]
        jobs.append({"part": "peak", "key": d, "cmd": cmd, "timeout": p["peak_timeout"]})
    return jobs


def trl_jobs(p: dict, trl_python: str) -> list:
    jobs = []
    for d in p["dtypes"]:
        kwargs = {**p["trl"]["kwargs"], "dtype": d}
        run = [trl_python, str(HERE / "trl_grpo.py")]  # the same run, by its CLI
        jobs.append(
            {
                "part": "trl",
                "key": d,
                "timeout": p["trl"]["timeout"],
                "cmd": [trl_python, "-c", TRL_CHILD, str(HERE), json.dumps(kwargs)],
                "shown": shown(run, trl_python)
                + " "
                + " ".join(f"--{k}={v}" for k, v in kwargs.items()),
            }
        )
    return jobs


def exhaustive_jobs(cfg: dict) -> list:
    base = [
        sys.executable,
        str(HERE / "scaling.py"),
        "--reference=policy",
        "--kl_estimator=k3",
        f"--config=configs/shakespeare.py:{cfg['variant']}",
        *cfg["args"],
    ]
    jobs = []
    for v, chunk, loss_chunk, warmup, steps, *dtype in cfg["runs"]:
        one = [f"--warmup={warmup}", f"--steps={steps}", f"--one_run={v}:{chunk}:{loss_chunk}@run"]
        one += [f"--config.model.dtype={d}" for d in dtype if d != "float32"]
        jobs.append(
            {"part": "exhaustive", "key": str(v), "cmd": [*base, *one], "timeout": cfg["timeout"]}
        )
    return jobs


def large_jobs(cfg: dict, part: str = "large") -> list:
    """benchmark.py on the large model at each of the plan's prompts per step, keyed by it."""
    jobs = []
    for batch in cfg["batches"]:
        overrides = {**cfg["overrides"], "train.batch_size": batch}
        cfg_b = {**cfg, "overrides": overrides}
        jobs.append(bench_job(part, cfg_b, overrides["model.dtype"], key=str(batch)))
    return jobs
