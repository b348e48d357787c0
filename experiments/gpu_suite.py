"""The GPU suite in one call (issue 15): the GRPO step, TRL beside it, exhaustive groups at
large V, and a larger model, written as one JSON and one markdown table.

  GRPO_JAX_DATA=/work/shared/data/tinyshakespeare.txt python experiments/gpu_suite.py

Parts, each measured in its own subprocess (so ``memory_stats()`` peaks are each part's own;
a part that fails or times out is recorded as such and the others still run):

- ``probe``: the device (device_kind, platform, count), jax / jaxlib versions, the float32
  matmul precision (``jax_default_matmul_precision``: unset = DEFAULT, under which XLA runs
  float32 matmuls on TF32 tensor cores on NVIDIA GPUs since Ampere; the nominal float32 peak
  is then TF32's), the measured matmul peak in float32 and bfloat16
  at large shapes (``measure.matmul_peak``), and the matmul FLOPs of each benchmarked step's
  two halves, ``step.rollout`` and ``step.update`` (``measure.step_flops`` on the same config).
- ``step``: the TRL-comparable GRPO step (4 x 4 x 128 char GPT, 8 prompts x G = 8, context
  100, horizon 70, mu = 1, beta = 0.04, frozen-policy reference with k3, reward ``match``),
  ``experiments/benchmark.py`` in float32 and bfloat16 compute (params float32): s/step,
  steps/s, generated tokens/s, peak memory, and MFU from benchmark.py's ``roofline``
  (matmul FLOPs per step).
- ``trl``: the same work in TRL's GRPOTrainer on the same device
  (``experiments/trl_grpo.py``'s ``run``, float32 and bf16 autocast), in ``--trl_python``;
  where torch / transformers / trl / datasets do not import it records
  ``{"skipped": reason}``.
- ``exhaustive``: exhaustive GRPO iterations at the guide's settings (B = 8, context 100,
  horizon 70) for V = 65, 256, 1,000 and 50,000 (``experiments/scaling.py --one_run``, one
  subprocess per V, chunks chosen for an 80 GB GPU), with the frozen-policy KL reference and
  k3: time per iteration, peak bytes, MFU, and the guide's 6 s / 12 GB, 24 s / 48 GB,
  95 s / 190 GB and "infeasible" beside them.
- ``large``: a 12-layer x 768 x 12-head char GPT, context 256, horizon 128, 16 prompts x
  G = 16 (8 prompts if that runs out of memory), bfloat16 compute, through benchmark.py:
  MFU of the rollout and of the update separately (benchmark.py's ``breakdown`` times; the
  probe's FLOPs of each half).

MFU = matmul FLOPs (every dot_general executed, loops and the backward pass's recomputation
included) / time / peak, against both the device's nominal dense peak for the dtype (a table
by device_kind: H100 SXM and H200 989 TFLOP/s bf16, 494 TF32, 67 fp32; A100 312 / 156 /
19.5; none on a CPU) and the peak measured here. Targets (one H100): the step >= 20x TRL's;
exhaustive V <= 1,000 >= 20x faster and >= 5x less memory than the guide; V = 50,000 in
<= 60 s per iteration within 80 GB; rollout MFU >= 20 % on the large model; the whole suite
in under 8 minutes. Each is reported as value, threshold and met (true / false / "n/a").

Writes ``<out_dir>/gpu_suite_<device>.json`` and ``.md`` (``--name`` overrides the
basename), rewritten after every measurement (``"complete": false`` until the end, so a run
cut off by a time limit leaves what it measured); exits 1 when a part failed (after writing
both). ``--parts`` runs a subset (the probe always runs).

``--smoke``: every part at tiny sizes on the CPU (JAX_PLATFORMS=cpu, XLA's cheap compiles)
through the same functions, two measurements at a time (``--jobs``; a GPU run takes them one
at a time), into a fresh temporary directory unless --out_dir is given; the step part in
float32 only (benchmark.py in bfloat16 runs in the large part), V = 65 and 256 (chunked) on a
1-layer model, the large part on a 2-layer x 64 one; targets are reported as "n/a (smoke)".
tests/test_gpu_suite.py runs it (about 95 s of CPU time, under a minute on 2 idle cores).

On a GPU machine lent to a session (/work/.library/device/README.md: one call runs at most
600 s, 30 minutes of device time a session): its image has jax, flax, optax, orbax, torch,
transformers, accelerate, tokenizers, absl, but not ml_collections, tensorboardX, trl or
datasets (nor datasets' dill and multiprocess). Here, in the repo root, once:

  echo /.whl/ >> .git/info/exclude; echo /shared/ >> .git/info/exclude
  python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
      --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
      --platform manylinux2014_x86_64 -d .whl ml_collections==1.1.0 tensorboardX==2.6.5 \
      trl==1.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19
  mkdir -p shared/data && cp "$GRPO_JAX_DATA" shared/data/   # the corpus, never committed

then one device run (carry [".whl", "shared"], timeout_s 600):

  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit; \
  export GRPO_JAX_DATA=$PWD/shared/data/tinyshakespeare.txt PYTHONUNBUFFERED=1; \
  python3 experiments/gpu_suite.py --out_dir=$OUT 2>&1 | tee $OUT/gpu_suite.log

(datasets 5.2 wants pyarrow >= 24: where the image's is older, the trl part records the
import error and the rest runs; carry a pyarrow wheel too to fix it; a second call with
``--parts=trl`` then adds nothing to the other parts' file, so name it ``--name=...``.) Back
here the files lie under the reply's files_at: copy ``gpu_suite_<device>.json`` and ``.md``
into experiments/results/ and commit those two paths (``git add`` each; nothing else).
"""

from __future__ import annotations

import json
import math
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from absl import app, flags

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))  # measure.py, trl_grpo.py beside this file

FLAGS = flags.FLAGS
PARTS = ("step", "trl", "exhaustive", "large")
flags.DEFINE_bool("smoke", False, "Every part at tiny sizes on the CPU (seconds, not minutes).")
flags.DEFINE_list("parts", list(PARTS), f"Parts to run, of {', '.join(PARTS)} (probe always).")
flags.DEFINE_string(
    "out_dir",
    "",
    "Where the JSON and markdown go ('': experiments/results, "
    "or a new temporary directory with --smoke).",
)
flags.DEFINE_string("name", "", "Basename of the outputs ('': gpu_suite_<device>[_smoke]).")
flags.DEFINE_string("trl_python", sys.executable, "The Python that runs TRL (torch, trl).")
flags.DEFINE_integer(
    "jobs", 0, "Measurements at a time (0: 1, or 2 with --smoke; on a GPU keep 1).", lower_bound=0
)
flags.DEFINE_float("time_scale", 1.0, "Multiplies every part's time limit.", lower_bound=0.1)
flags.DEFINE_string("child", "", "Internal: run one measurement here (probe) and print JSON.")
flags.DEFINE_string("child_spec", "", "Internal: the child's JSON argument.")

SUITE_BUDGET_S = 480  # the "under 8 minutes on one H100"
# device_kind substring -> nominal dense peak FLOP/s (bf16, tf32, fp32 without tensor cores);
# the first match wins (so "H100 PCIe" before "H100"). None: no nominal figure (a CPU).
NOMINAL_PEAKS = (
    ("H200", {"bfloat16": 989e12, "tf32": 494e12, "float32": 67e12}),
    ("H100 PCIe", {"bfloat16": 756e12, "tf32": 378e12, "float32": 51e12}),
    ("H100", {"bfloat16": 989e12, "tf32": 494e12, "float32": 67e12}),  # SXM, "80GB HBM3"
    ("A100", {"bfloat16": 312e12, "tf32": 156e12, "float32": 19.5e12}),
)
# jax_default_matmul_precision values under which float32 matmuls run on tensor cores
TF32_PRECISIONS = (None, "", "default", "fastest", "tensorfloat32", "high", "bfloat16")
# the exhaustive-GRPO guide's figures: V -> (seconds per iteration, bytes); None = infeasible
GUIDE = {65: (6.0, 12e9), 256: (24.0, 48e9), 1000: (95.0, 190e9), 50000: None}
GPU_MEMORY_TARGET = 80e9  # "within 80 GB"
CHILD_ENV_KEYS = (
    "JAX_PLATFORMS",
    "JAX_DISABLE_MOST_OPTIMIZATIONS",
    "XLA_PYTHON_CLIENT_MEM_FRACTION",
)

# The TRL-comparable GRPO step (experiments/benchmark.py's docstring; versus_trl.py's work)
STEP = {
    "group.size": 8,
    "reference.kind": "policy",
    "grpo.kl_estimator": "k3",
    "reward.terms": "match",
    "grpo.beta": 0.04,
    "train.batch_size": 8,
    "grpo.num_iterations": 1,
}
LARGE = {
    **STEP,
    "model.num_layers": 12,
    "model.num_heads": 12,
    "model.d_model": 768,
    "model.dtype": "bfloat16",
    "data.context_len": 256,
    "data.horizon": 128,
    "group.size": 16,
    # 16 prompts x 16 members (256 rows per decode step): XLA's CPU buffer plan for this step
    # is 52 GiB (103 GiB at 32 prompts; the sampled loss is not chunked); out of memory, the
    # part runs again at LARGE_FALLBACK_BATCH prompts (27 GiB)
    "train.batch_size": 16,
}
LARGE_FALLBACK_BATCH = 8
OOM = ("RESOURCE_EXHAUSTED", "Out of memory", "out of memory", "OOM")


def plan(smoke: bool) -> dict:
    """Every part's sizes: the issue's for a GPU, tiny ones (same code paths) for --smoke."""
    if not smoke:
        return {
            "dtypes": ("float32", "bfloat16"),
            "peak_shapes": ((8192, 8192, 8192), (16384, 4096, 4096)),
            "step": {
                "variant": "sampled",
                "overrides": STEP,
                "dtypes": ("float32", "bfloat16"),
                "args": ("--warmup=2", "--steps=5", "--breakdown_runs=3"),
                "timeout": 300,
            },
            "trl": {"kwargs": {"steps": 5, "warmup": 2, "device": "auto"}, "timeout": 300},
            "exhaustive": {
                "variant": "exhaustive",
                "args": ("--batch_size=8", "--context_len=100", "--horizon=70"),
                # (V, rollout chunk, loss chunk, warmup, steps); 0 = all members at once
                "runs": (
                    (65, 0, 0, 1, 3),
                    (256, 0, 0, 1, 3),
                    (1000, 0, 250, 1, 2),  # CPU buffer plan 12.2 GiB (all at once: 54)
                    (50000, 2500, 25, 0, 1),
                ),
                "timeout": 300,
            },
            "large": {
                "variant": "sampled",
                "overrides": LARGE,
                "fallback_batch": LARGE_FALLBACK_BATCH,
                "args": ("--warmup=1", "--steps=3", "--breakdown_runs=2"),
                "timeout": 420,
            },
            "probe_timeout": 300,
        }
    tiny = {"train.batch_size": 2}
    return {
        "dtypes": ("float32", "bfloat16"),
        "peak_shapes": ((256, 256, 256),),
        "step": {
            "variant": "tiny,sampled",
            "overrides": {**STEP, **tiny},
            # float32 only: benchmark.py in bfloat16 runs in the large part (a CI budget)
            "dtypes": ("float32",),
            "args": ("--warmup=1", "--steps=2", "--breakdown_runs=1"),
            "timeout": 240,
        },
        "trl": {
            "kwargs": {
                "steps": 1,
                "warmup": 1,
                "device": "cpu",
                "batch_prompts": 2,
                "group": 2,
                "context": 16,
                "horizon": 8,
                "layers": 1,
                "heads": 2,
                "width": 32,
            },
            "timeout": 240,
        },
        "exhaustive": {
            "variant": "exhaustive,tiny",
            "args": ("--batch_size=2", "--context_len=16", "--horizon=8", "--corpus_len=4000"),
            "runs": ((65, 0, 0, 0, 1), (256, 32, 32, 0, 1)),
            "timeout": 240,
        },
        "large": {
            "variant": "tiny,sampled",
            "overrides": {
                **LARGE,
                **tiny,
                "model.num_layers": 2,
                "model.num_heads": 2,
                "model.d_model": 64,
                "data.context_len": 32,
                "data.horizon": 16,
                "group.size": 4,
            },
            "args": ("--warmup=1", "--steps=2", "--breakdown_runs=1"),
            "timeout": 240,
        },
        "probe_timeout": 240,
    }


# ---------------------------------------------------------------------------------------
# children (each in its own process)


def load_config(variant: str, overrides: dict):
    """The packaged Shakespeare config (what ``--config=configs/shakespeare.py:<variant>``
    loads) with ``overrides`` ({"a.b": value}) applied, as benchmark.py's flags apply them."""
    from grpo_jax.configs.shakespeare import get_config

    config = get_config(variant)
    config.update_from_flattened_dict(dict(overrides))
    return config


def half_flops(variant: str, overrides: dict) -> dict:
    """Matmul FLOPs of ``step.rollout`` and ``step.update`` (on the rollout's batch) of the
    task benchmark.py builds from the same config (one device, plain jit: the same program)."""
    import jax
    import jax.numpy as jnp
    from measure import step_flops

    from grpo_jax import trainer
    from grpo_jax.tasks import build_task

    config = load_config(variant, overrides)
    # its held-out evaluation is no part of the step: keep it small, fit no n-gram baselines
    config.eval.num_windows = min(config.eval.num_windows, 8)
    config.eval.ngram_baselines = ()
    task = build_task(config, "train")
    # the FLOPs depend on shapes alone: zeros of trainer.initial_params's shapes (no eager
    # init, which costs seconds per model on a CPU)
    shapes = jax.eval_shape(lambda: trainer.initial_params(config, task))
    params = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
    step, inputs = task.build(params)
    state = task.make_state(params)
    batch = jax.eval_shape(step.rollout, state, inputs)  # shapes suffice for the count
    return {
        "rollout_matmul_flops": step_flops(step.rollout, state, inputs)["matmul_flops"],
        "update_matmul_flops": step_flops(step.update, state, inputs, batch, None)["matmul_flops"],
        "tokens_per_step": int(task.tokens_per_step),
    }


def probe(spec: dict) -> dict:
    """The device, versions, matmul precision, measured peaks and the halves' FLOPs."""
    import jax
    import jaxlib
    from measure import matmul_peak

    dev = jax.devices()[0]
    precision = jax.config.jax_default_matmul_precision
    out = {
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
        "measured_peak": {},
        "halves": {},
    }
    for dtype in spec["dtypes"]:
        by_shape, best = matmul_peak([tuple(s) for s in spec["peak_shapes"]], dtype)
        out["measured_peak"][dtype] = {"flops_per_s": best * 1e9, "gflops_by_shape": by_shape}
    for name, (variant, overrides) in spec["halves"].items():
        try:
            out["halves"][name] = half_flops(variant, overrides)
        except Exception as e:  # recorded (the suite then exits 1), the device info kept
            out["halves"][name] = {"error": f"{type(e).__name__}: {e}"[:300]}
    return out


# ---------------------------------------------------------------------------------------
# the parent: subprocesses, figures, targets, outputs

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


def shown(cmd: list) -> str:
    """A child's command as a person runs it from the repo root."""
    parts = ["python" if c in (sys.executable, FLAGS.trl_python) else c for c in cmd]
    parts = [str(Path(c).relative_to(ROOT)) if c.startswith(str(ROOT)) else c for c in parts]
    return shlex.join(parts)


def child_env(smoke: bool) -> dict:
    env = dict(os.environ)
    if smoke:  # the CPU, and XLA's cheap compiles: the smoke checks the code, not the speed
        env.update(JAX_PLATFORMS="cpu", JAX_DISABLE_MOST_OPTIMIZATIONS="1")
    else:  # let one part's step use most of the GPU (JAX's default preallocates 75 %)
        env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.92")
    return env


def run_child(job: dict, env: dict) -> dict:
    """Runs one measurement; returns its last JSON line (plus wall_s and command), or an
    {"error": ...} record: a failing child never stops the suite."""
    cmd, timeout = job["cmd"], job["timeout"] * FLAGS.time_scale
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(
            cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired:
        res = {"error": f"timed out after {timeout:.0f} s"}
    else:
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
        if proc.returncode == 0 and lines:
            res = json.loads(lines[-1])
        else:
            tail = (proc.stderr.strip() or proc.stdout.strip() or "no output").splitlines()
            err = next((ln for ln in reversed(tail) if "Error" in ln), tail[-1])
            res = {"error": f"exit {proc.returncode}: {err[:400]}"}
            if any(s in proc.stderr for s in OOM):
                res["out_of_memory"] = True
    res["wall_s"] = time.perf_counter() - t0
    res["command"] = job.get("shown") or shown(cmd)
    status = res.get("error") or res.get("skipped") or "ok"
    print(f"{job['part']} {job['key']}: {status} ({res['wall_s']:.1f} s)", flush=True)
    print(f"  $ {res['command']}", flush=True)
    return res


def config_args(variant: str, overrides: dict) -> list:
    args = [f"--config=configs/shakespeare.py:{variant}"]
    return args + [f"--config.{k}={v}" for k, v in overrides.items()]


def nominal_peak(device_kind: str, dtype: str, precision) -> float | None:
    for key, peaks in NOMINAL_PEAKS:
        if key in device_kind:
            if dtype == "float32":
                return peaks["tf32" if precision in TF32_PRECISIONS else "float32"]
            return peaks.get(dtype)
    return None


def nominal_of(info: dict, dtype: str) -> float | None:
    return nominal_peak(info.get("device_kind", ""), dtype, info.get("default_matmul_precision"))


def utilisation(flops, seconds, dtype: str, info: dict) -> dict:
    """MFU against the nominal and the measured peak (None where either is unknown)."""
    if not flops or not seconds:
        return {"mfu_nominal": None, "mfu_measured": None}
    rate = flops / seconds
    nominal = nominal_of(info, dtype)
    measured = info.get("measured_peak", {}).get(dtype, {}).get("flops_per_s")
    return {
        "achieved_flops_per_s": rate,
        "nominal_peak_flops_per_s": nominal,
        "measured_peak_flops_per_s": measured,
        "mfu_nominal": rate / nominal if nominal else None,
        "mfu_measured": rate / measured if measured else None,
    }


# ---- the jobs: one child process each ({part, key, cmd, timeout[, shown]})


def bench_job(part: str, cfg: dict, dtype: str) -> dict:
    overrides = {**cfg["overrides"], "model.dtype": dtype}
    cmd = [sys.executable, str(HERE / "benchmark.py"), *config_args(cfg["variant"], overrides)]
    return {"part": part, "key": dtype, "cmd": [*cmd, *cfg["args"]], "timeout": cfg["timeout"]}


def jobs_of(p: dict, parts) -> list:
    """Every child of the run, in the order a GPU runs them (the probe first)."""
    halves = {}
    if "step" in parts:
        for d in p["step"]["dtypes"]:
            halves[f"step_{d}"] = (
                p["step"]["variant"],
                {**p["step"]["overrides"], "model.dtype": d},
            )
    if "large" in parts:
        halves["large"] = (p["large"]["variant"], p["large"]["overrides"])
        if p["large"].get("fallback_batch"):
            fallback = {**p["large"]["overrides"], "train.batch_size": p["large"]["fallback_batch"]}
            halves["large_fallback"] = (p["large"]["variant"], fallback)
    spec = {"dtypes": p["dtypes"], "peak_shapes": p["peak_shapes"], "halves": halves}
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child=probe"]
    jobs = [
        {
            "part": "probe",
            "key": "device",
            "cmd": [*cmd, f"--child_spec={json.dumps(spec)}"],
            "timeout": p["probe_timeout"],
        }
    ]
    if "step" in parts:
        jobs += [bench_job("step", p["step"], d) for d in p["step"]["dtypes"]]
    if "trl" in parts:
        for d in p["dtypes"]:
            kwargs = {**p["trl"]["kwargs"], "dtype": d}
            run = [FLAGS.trl_python, str(HERE / "trl_grpo.py")]  # the same run, by its CLI
            jobs.append(
                {
                    "part": "trl",
                    "key": d,
                    "timeout": p["trl"]["timeout"],
                    "cmd": [FLAGS.trl_python, "-c", TRL_CHILD, str(HERE), json.dumps(kwargs)],
                    "shown": shown(run) + " " + " ".join(f"--{k}={v}" for k, v in kwargs.items()),
                }
            )
    if "exhaustive" in parts:
        cfg = p["exhaustive"]
        base = [
            sys.executable,
            str(HERE / "scaling.py"),
            "--reference=policy",
            "--kl_estimator=k3",
            f"--config=configs/shakespeare.py:{cfg['variant']}",
            *cfg["args"],
        ]
        for v, chunk, loss_chunk, warmup, steps in cfg["runs"]:
            one = [
                f"--warmup={warmup}",
                f"--steps={steps}",
                f"--one_run={v}:{chunk}:{loss_chunk}@run",
            ]
            jobs.append(
                {
                    "part": "exhaustive",
                    "key": str(v),
                    "cmd": [*base, *one],
                    "timeout": cfg["timeout"],
                }
            )
    if "large" in parts:
        cfg = p["large"]
        job = bench_job("large", cfg, cfg["overrides"]["model.dtype"])
        if cfg.get("fallback_batch"):  # run only if the first runs out of memory
            overrides = {**cfg["overrides"], "train.batch_size": cfg["fallback_batch"]}
            job["fallback"] = bench_job("large", {**cfg, "overrides": overrides}, job["key"])
        jobs.append(job)
    return jobs


def run_jobs(jobs: list, env: dict, workers: int, done=lambda: None) -> list:
    """The children one at a time (a GPU: each alone on the device, its memory peak its own),
    or ``workers`` at a time (--smoke on a CPU: they are independent); ``done()`` after each."""
    for job in jobs:  # a Python that is not there skips TRL without starting anything
        if job["part"] == "trl" and not (
            Path(FLAGS.trl_python).exists() or shutil.which(FLAGS.trl_python)
        ):
            job["result"] = {"skipped": f"--trl_python={FLAGS.trl_python} not found"}
    todo = [j for j in jobs if "result" not in j]

    def run(job):
        res = run_child(job, env)
        if res.get("out_of_memory") and job.get("fallback"):
            print("  out of memory: the smaller fallback", flush=True)
            first = res
            res = run_child(job["fallback"], env)
            res["fallback_after"] = {"command": first["command"], "error": first["error"]}
            res["wall_s"] += first["wall_s"]
        job["result"] = res
        done()
        return res

    if workers <= 1:
        for job in todo:
            run(job)
    else:
        with ThreadPoolExecutor(workers) as pool:
            list(pool.map(run, todo))
    return jobs


# ---- figures from the children's records


def bench_figures(r: dict, dtype: str, halves: dict | None, info: dict) -> dict:
    """A benchmark.py record's figures: s/step, tokens/s, memory, MFU (step, halves)."""
    if "error" in r:
        return r
    med, roof, bd = r["median_step_s"], r.get("roofline") or {}, r["breakdown"]
    out = {
        "dtype": dtype,
        "params": r["params"],
        "median_step_s": med,
        "steps_per_s": 1 / med,
        "generated_tokens_per_step": r["tokens_per_step"],
        "tokens_per_s": r["tokens_per_s"],
        "compile_s": r["compile_s"],
        "step_times_s": r["step_times_s"],
        "peak_memory_bytes": r["peak_memory_bytes"],
        "peak_memory_source": r["peak_memory_source"],
        "matmul_flops": roof.get("matmul_flops"),
        "xla_flops": roof.get("xla_flops"),
        "matmul_peak_at_model_shapes_flops_per_s": roof.get("matmul_peak_gflops", 0) * 1e9 or None,
        "step": utilisation(roof.get("matmul_flops"), med, dtype, info),
        "rollout_s": bd["rollout_s"],
        "update_s": bd["update_s"],
        "benchmark_device": r["device"],
        "wall_s": r["wall_s"],
        "command": r["command"],
    }
    if halves and "error" not in halves:
        out.update(halves)
        out["rollout"] = utilisation(halves["rollout_matmul_flops"], bd["rollout_s"], dtype, info)
        out["update"] = utilisation(halves["update_matmul_flops"], bd["update_s"], dtype, info)
    return out


def exhaustive_figures(r: dict, v: int, info: dict) -> dict:
    """A scaling.py run's record with MFU and the guide's figures beside it."""
    if "error" in r:
        return r
    dtype = r["model"].split()[-1]
    r["utilisation"] = utilisation(r.get("matmul_flops"), r["median_step_s"], dtype, info)
    guide = GUIDE.get(v)  # (at --smoke's tiny sizes the ratios mean nothing)
    r["guide"] = {"s_per_iteration": guide[0], "bytes": guide[1]} if guide else "infeasible"
    if guide:
        r["speedup_vs_guide"] = guide[0] / r["median_step_s"]
        r["memory_vs_guide"] = guide[1] / r["peak_memory_bytes"]
    return r


def assemble(jobs: list) -> tuple[dict, dict]:
    """(results by part, each part's summed child wall time) of the jobs done so far."""
    by_part: dict = {}
    for j in jobs:
        if "result" in j:
            by_part.setdefault(j["part"], {})[j["key"]] = j["result"]
    info = by_part.get("probe", {}).get("device", {"error": "not run yet"})
    if "error" in info:  # the parts are still reported; MFU and the device are then unknown
        info = {**info, "halves": {}, "measured_peak": {}}
    halves = info.get("halves", {})
    results = {"probe": info}
    if "step" in by_part:
        results["step"] = {
            d: bench_figures(r, d, halves.get(f"step_{d}"), info)
            for d, r in by_part["step"].items()
        }
    if "trl" in by_part:
        results["trl"] = by_part["trl"]
    if "exhaustive" in by_part:
        results["exhaustive"] = {
            v: exhaustive_figures(r, int(v), info) for v, r in by_part["exhaustive"].items()
        }
    if "large" in by_part:
        ((d, r),) = by_part["large"].items()
        key = "large_fallback" if "fallback_after" in r else "large"
        results["large"] = bench_figures(r, d, halves.get(key), info)
        if "fallback_after" in r:
            results["large"]["fallback_after"] = r["fallback_after"]
    wall = {part: sum(r.get("wall_s", 0.0) for r in rs.values()) for part, rs in by_part.items()}
    return results, wall


# ---- targets


def target(value, threshold, op: str, gpu: bool, why: str = "") -> dict:
    """One check: met is True/False on a GPU run, "n/a (...)" otherwise or without a value."""
    t = {"value": value, "threshold": f"{op} {threshold:g}"}
    if FLAGS.smoke:
        t["met"] = "n/a (smoke)"
    elif value is None:
        t["met"] = f"n/a ({why or 'not measured'})"
    elif not gpu:
        t["met"] = "n/a (not a GPU)"
    else:
        t["met"] = bool(value >= threshold if op == ">=" else value <= threshold)
    return t


def targets(results: dict, gpu: bool, wall_s: float) -> dict:
    out = {}
    step, trl = results.get("step", {}), results.get("trl", {})
    for dtype in ("float32", "bfloat16"):
        ours, theirs = step.get(dtype, {}), trl.get(dtype, {})
        ratio, why = None, theirs.get("skipped") or theirs.get("error") or ours.get("error")
        if "median_step_s" in ours and "median_step_s" in theirs:
            ratio = theirs["median_step_s"] / ours["median_step_s"]
        out[f"step {dtype}: TRL s/step ÷ grpo_jax s/step"] = target(ratio, 20, ">=", gpu, why)
    exh = results.get("exhaustive", {})
    for v in (65, 256, 1000):
        r = exh.get(str(v), {})
        why = r.get("error", "not run")
        out[f"exhaustive V={v}: guide time ÷ measured"] = target(
            r.get("speedup_vs_guide"), 20, ">=", gpu, why
        )
        out[f"exhaustive V={v}: guide memory ÷ peak bytes"] = target(
            r.get("memory_vs_guide"), 5, ">=", gpu, why
        )
    r = exh.get("50000", {})
    why = r.get("error", "not run")
    out["exhaustive V=50,000 (KL reference): s / iteration"] = target(
        r.get("median_step_s"), 60, "<=", gpu, why
    )
    out["exhaustive V=50,000 (KL reference): peak GB"] = target(
        r["peak_memory_bytes"] / 1e9 if "peak_memory_bytes" in r else None,
        GPU_MEMORY_TARGET / 1e9,
        "<=",
        gpu,
        why,
    )
    large = results.get("large", {})
    mfu = (large.get("rollout") or {}).get("mfu_nominal")
    out["large model: rollout MFU (nominal peak)"] = target(
        mfu, 0.20, ">=", gpu, large.get("error", "no nominal peak for this device")
    )
    out["large model: rollout MFU (nominal peak)"]["threshold"] = ">= 20 %"
    out["suite wall time (s)"] = target(wall_s, SUITE_BUDGET_S, "<=", gpu)
    return out


# ---- markdown


def fmt(x, spec=".3g", none="–"):
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return none
    return format(x, spec)


def pct(x):
    return fmt(None if x is None else 100 * x, ".1f") + ("" if x is None else " %")


def times(x):
    return "–" if x is None else f"{x:.1f}×"


def gib(b):
    if b is None:
        return "–"
    return f"{b / 2**30:.2f} GiB" if b >= 2**28 else f"{b / 2**20:.1f} MiB"


def markdown(raw: dict) -> str:
    info, res = raw["device"], raw["results"]
    lines = [
        f"# GPU suite: {info.get('device_kind', '?')}" + (" (smoke)" if raw["smoke"] else ""),
        "",
        f"- Device: **{info.get('device_kind', '?')}** ({info.get('platform', '?')}) × "
        f"{info.get('device_count', '?')}; jax {info.get('jax', '?')}, jaxlib "
        f"{info.get('jaxlib', '?')}; float32 matmuls: {info.get('float32_matmuls', '?')}.",
        f"- Dtypes: compute {', '.join(raw['dtypes'])} (params float32); the large model "
        f"and the exhaustive rows as stated below.",
        "- Peaks (FLOP/s): measured "
        + ", ".join(
            f"{d} {fmt(v['flops_per_s'], '.3e')}" for d, v in info.get("measured_peak", {}).items()
        )
        + "; nominal "
        + ", ".join(f"{d} {fmt(nominal_of(info, d), '.3e')}" for d in raw["dtypes"])
        + " (dense, by device_kind; – on a CPU).",
        "- MFU = matmul FLOPs executed (loops and the backward pass's recomputation included) "
        "/ time / peak, against the nominal and the measured peak.",
        f"- Total wall time {raw['wall_s']:.0f} s (budget {SUITE_BUDGET_S} s on one H100); "
        f"{raw['workers']} measurement(s) at a time, each in its own process; per part (its "
        "processes' wall times added): "
        + ", ".join(f"{k} {v:.0f} s" for k, v in raw["part_wall_s"].items())
        + ".",
        *(
            []
            if raw["complete"]
            else ["- **Partial**: written after each measurement; this run had not finished."]
        ),
        "",
        "## Targets",
        "",
        "| target | value | threshold | met |",
        "|---|---|---|---|",
    ]
    for name, t in raw["targets"].items():
        value = pct(t["value"]) if "MFU" in name else fmt(t["value"])
        met = {True: "**yes**", False: "no"}.get(t["met"], t["met"])
        lines.append(f"| {name} | {value} | {t['threshold']} | {met} |")

    step = res.get("step")
    if step is not None:
        lines += [
            "",
            "## GRPO step (8 prompts × G = 8, context 100, horizon 70, μ = 1, β = 0.04, "
            "frozen-policy k3, reward match; 4×4×128 char GPT)"
            if not raw["smoke"]
            else "## GRPO step (smoke sizes)",
            "",
            "| compute dtype | s / step | steps / s | generated tokens / s | peak memory "
            "| GFLOP / step | MFU (nominal / measured) | rollout s (MFU) | update s (MFU) "
            "| compile s |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for d, r in step.items():
            if "error" in r:
                lines.append(f"| {d} | {r['error']} | | | | | | | | |")
                continue
            u = r["step"]
            lines.append(
                f"| {d} | {r['median_step_s']:.4f} | {r['steps_per_s']:.2f} | "
                f"{r['tokens_per_s']:,.0f} | {gib(r['peak_memory_bytes'])} | "
                f"{fmt(r['matmul_flops'] and r['matmul_flops'] / 1e9)} | "
                f"{pct(u['mfu_nominal'])} / {pct(u['mfu_measured'])} | "
                f"{r['rollout_s']:.4f} ({pct((r.get('rollout') or {}).get('mfu_measured'))}) | "
                f"{r['update_s']:.4f} ({pct((r.get('update') or {}).get('mfu_measured'))}) | "
                f"{r['compile_s']:.1f} |"
            )
        lines.append("(rollout / update MFU in brackets: against the measured peak.)")
    trl = res.get("trl")
    if trl is not None:
        lines += [
            "",
            "## TRL GRPOTrainer, the same work on the same device",
            "",
            "| dtype | s / step | generated tokens / s | TRL ÷ grpo_jax (s / step) | versions |",
            "|---|---|---|---|---|",
        ]
        for d, r in trl.items():
            if "median_step_s" not in r:
                lines.append(f"| {d} | {r.get('skipped') or r.get('error')} | | | |")
                continue
            ours = (step or {}).get(d, {}).get("median_step_s")
            lines.append(
                f"| {d} | {r['median_step_s']:.4f} | {r['tokens_per_s']:,.0f} | "
                f"{fmt(ours and r['median_step_s'] / ours)} | torch {r.get('torch')}, "
                f"transformers {r.get('transformers')}, trl {r.get('trl')} ({r.get('device')}) |"
            )
    exh = res.get("exhaustive")
    if exh is not None:
        any_r = next((r for r in exh.values() if "model" in r), {})
        lines += [
            "",
            f"## Exhaustive GRPO iterations (B = {any_r.get('batch_size', '?')}, context "
            f"{any_r.get('context_len', '?')}, horizon {any_r.get('horizon', '?')}, model "
            f"{any_r.get('model', '?')}, μ = {any_r.get('num_iterations', '?')}, KL reference "
            f"{any_r.get('reference', '?')} + {any_r.get('kl_estimator', '?')}, β = "
            f"{any_r.get('beta', '?')})",
            "",
            "| V | chunks (rollout / loss) | guide: s / iteration | guide: memory "
            "| s / iteration | peak bytes | faster than guide | less memory than guide "
            "| TFLOP / iteration | MFU (nominal / measured) | compile s |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for v, r in exh.items():
            if "error" in r:
                lines.append(f"| {v} | {r['error']} | | | | | | | | | |")
                continue
            g, u = r["guide"], r["utilisation"]
            gt, gm = (
                ("infeasible", "–")
                if g == "infeasible"
                else (f"{g['s_per_iteration']:g}", f"{g['bytes'] / 1e9:g} GB")
            )
            lines.append(
                f"| {v} | {r['vocab_chunk'] or 'all'} / {r['loss_chunk'] or 'same'} | {gt} | "
                f"{gm} | {r['median_step_s']:.3f} | {gib(r['peak_memory_bytes'])} | "
                f"{times(r.get('speedup_vs_guide'))} | {times(r.get('memory_vs_guide'))} | "
                f"{fmt(r.get('matmul_flops') and r['matmul_flops'] / 1e12)} | "
                f"{pct(u['mfu_nominal'])} / {pct(u['mfu_measured'])} | {r['compile_s']:.1f} |"
            )
        lines.append(f"(peak bytes: {any_r.get('peak_memory_source', '?')}.)")
    large = res.get("large")
    if large is not None:
        lines += ["", "## Larger model: where the framework stands when the GPU is busy", ""]
        if "error" in large:
            lines.append(f"failed: {large['error']}")
        else:
            lines += [
                f"{large['params']:,} params, {large['dtype']} compute, "
                f"{large['generated_tokens_per_step']:,} generated tokens / step "
                f"({large['tokens_per_s']:,.0f} / s); `{large['command']}`",
                "",
                "| half | s | GFLOP | MFU nominal | MFU measured |",
                "|---|---|---|---|---|",
            ]
            for half, secs, fl in (
                ("rollout", large["rollout_s"], large.get("rollout_matmul_flops")),
                ("update", large["update_s"], large.get("update_matmul_flops")),
                ("whole step", large["median_step_s"], large.get("matmul_flops")),
            ):
                u = large.get("step" if half == "whole step" else half) or {}
                lines.append(
                    f"| {half} | {secs:.4f} | {fmt(fl and fl / 1e9)} | "
                    f"{pct(u.get('mfu_nominal'))} | {pct(u.get('mfu_measured'))} |"
                )
    lines += ["", "## Commands", ""]
    lines += [f"- `{c}`" for c in raw["commands"]]
    if raw.get("child_env"):
        lines.append(f"- children's environment: {raw['child_env']}")
    return "\n".join(lines) + "\n"


def slug(device_kind: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", device_kind.lower()).strip("-") or "unknown"


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    if FLAGS.child == "probe":
        print(json.dumps(probe(json.loads(FLAGS.child_spec))), flush=True)
        return
    if FLAGS.child:
        raise app.UsageError(f"--child={FLAGS.child}: only probe")
    unknown = set(FLAGS.parts) - set(PARTS)
    if unknown:
        raise app.UsageError(f"--parts: unknown {sorted(unknown)}; known {PARTS}")
    t0 = time.perf_counter()
    smoke, p = FLAGS.smoke, plan(FLAGS.smoke)
    env = child_env(smoke)
    workers = FLAGS.jobs or (2 if smoke else 1)
    out_dir = Path(
        FLAGS.out_dir
        or (tempfile.mkdtemp(prefix="gpu_suite_smoke_") if smoke else ROOT / "experiments/results")
    )
    jobs = jobs_of(p, FLAGS.parts)
    print(f"{len(jobs)} measurements, {workers} at a time", flush=True)
    lock = threading.Lock()

    def write(final: bool):
        """Both outputs from the jobs done so far (each job rewrites them, so a run cut off
        by a time limit leaves what it measured), once the probe has named the device."""
        with lock:
            probe_job = jobs[0]
            if not final and "result" not in probe_job:
                return None
            results, part_wall = assemble(jobs)
            info, wall = results["probe"], time.perf_counter() - t0
            raw = {
                "suite": "experiments/gpu_suite.py (issue 15)",
                "smoke": smoke,
                "complete": final,
                "command": "python experiments/gpu_suite.py "
                + " ".join(shlex.quote(a) for a in sys.argv[1:]),
                "device": {k: v for k, v in info.items() if k not in ("halves", "command")},
                "dtypes": list(p["dtypes"]),
                "child_env": {k: env[k] for k in CHILD_ENV_KEYS if k in env},
                "workers": workers,
                "plan": p,
                "part_wall_s": part_wall,
                "wall_s": wall,
                "targets": targets(results, info.get("platform") == "gpu", wall),
                "results": results,
                "commands": [
                    j["result"]["command"] for j in jobs if "command" in j.get("result", {})
                ],
            }
            name = FLAGS.name or f"gpu_suite_{slug(info.get('device_kind', 'unknown'))}" + (
                "_smoke" if smoke else ""
            )
            out_dir.mkdir(parents=True, exist_ok=True)
            (out_dir / f"{name}.json").write_text(json.dumps(raw, indent=1, default=str))
            (out_dir / f"{name}.md").write_text(markdown(raw))
            return raw, out_dir / name

    run_jobs(jobs, env, workers, done=lambda: write(final=False))
    raw, path = write(final=True)
    print(markdown(raw))
    print(f"wrote {path}.json and .md in {raw['wall_s']:.0f} s")
    failed = [k for k, v in raw["results"].items() if has_error(v)]
    if failed:
        print(f"failed parts: {', '.join(failed)}", file=sys.stderr)
        sys.exit(1)


def has_error(x) -> bool:
    if isinstance(x, dict):
        return "error" in x or any(has_error(v) for v in x.values())
    return False


if __name__ == "__main__":
    app.run(main)
