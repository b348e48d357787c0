"""The GPU suite in one call (issue 15): the GRPO step, TRL beside it, exhaustive groups at
large V, and a larger model, written as one JSON and one markdown table.

  GRPO_JAX_DATA=/work/shared/data/tinyshakespeare.txt python experiments/gpu_suite.py

Parts, each measured in its own subprocess (so ``memory_stats()`` peaks are each part's own;
a part that fails or times out is recorded as such and the others still run), three at a
time by default (``--jobs``): the peaks first, then the longest expected first, a child whose
expected peak bytes would not fit beside the running ones' waiting (gpu_suite_plan.schedule,
with one H100's figures). Side by side, the children take turns on the device through
experiments/device_lock.py: a child's timed calls (warm-up included) hold it alone, its
compiles share it, so each timing sees an idle device while the next children compile
(the record's ``device_lock``: how long each kind held and waited; no timed section may
overlap another process's). JAX does not preallocate with several children (each may grow to
92 % of the device), and all of them share one compilation cache in the run's temporary
directory (the profiles compile their own: their XLA flags, command buffers off, are part of
the cache key). ``--jobs=1`` runs them one at a time.

- ``probe``: the device (device_kind, platform, count), jax / jaxlib versions and the float32
  matmul precision (``jax_default_matmul_precision``: unset = DEFAULT, under which XLA runs
  float32 matmuls on TF32 tensor cores on NVIDIA GPUs since Ampere; the nominal float32 peak
  is then TF32's). It builds no step: each benchmark.py child counts its own step's matmul
  FLOPs and its two halves' (``step.rollout``, ``step.update``) by tracing them.
- ``peak``: the measured matmul peak at large shapes (``measure.matmul_peak``: plain matmuls,
  nothing else in the program), one process per dtype with its own time limit (on one H200 a
  bfloat16 peak inside the probe outlasted its 300 s, and the record lost its device).
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
  horizon 70) for V = 65, 256, 1,000 and 50,000 (``scaling.py --one_run``, one process per V,
  chunks for an 80 GB GPU), with the frozen-policy KL reference and k3: time per iteration,
  peak bytes, MFU, beside the guide's 6 s / 12 GB, 24 s / 48 GB, 95 s / 190 GB, "infeasible".
- ``large``: a 12-layer x 768 x 12-head char GPT, context 256, horizon 128, G = 16, bfloat16
  compute, through benchmark.py at 16 prompts per step (``--large_batches=16,32`` adds 32,
  each keyed by prompts; one H100 ran the default suite with it in 497 s): MFU of the
  rollout and of the update separately (benchmark.py's ``breakdown`` times and FLOP counts of
  each half), and the rollout's floor on the device's nominal peak and HBM bandwidth
  (gpu_suite_parts.rollout_floor).
- ``attention`` (on request): the large model at 16 prompts with ``model.attention=cudnn``
  (cuDNN's fused attention in the full-sequence passes), to set beside ``large``'s.
- ``pallas`` (on request, not in --smoke: a CPU has no Triton): the large model at 16 prompts
  with ``model.decode_kernel=pallas`` (grpo_jax/decode_kernel.py: the decode steps' attention
  as one Pallas kernel per layer; ``--decode_kernel=flash``: as jax's flash-decoding kernel),
  to set beside ``large``'s rollout.
- ``profile`` (on request): ``experiments/profile_step.py`` in bfloat16 on the step above and
  on the large model: a jax.profiler trace, busy time by stage (rollout's decode loop,
  reference, update's forward / backward) and by kind of work (dense and batched matmuls,
  elementwise, layout), and each matmul kind's FLOP rate. On a GPU it reads the device
  tracks' kernels (by their ``hlo_op``), with XLA's command buffers off.

MFU = matmul FLOPs (every dot_general executed, loops and the backward pass's recomputation
included) / time / peak, against both the device's nominal dense peak for the dtype
(gpu_suite_parts' table by device_kind; none on a CPU) and the peak measured here. Targets
(one H100): the step >= 20x TRL's; exhaustive V <= 1,000 >= 20x faster and >= 5x less memory
than the guide; V = 50,000 in <= 60 s per iteration within 80 GB; rollout MFU >= 20 % on the
large model; the whole suite in under 8 minutes. Each: value, threshold, met (true / false /
"n/a").

This file is the CLI; the sizes are in gpu_suite_plan.py, the commands, probe and MFU in
gpu_suite_parts.py, figures, targets and JSON in gpu_suite_report.py, markdown in _markdown.

Writes ``<out_dir>/gpu_suite_<device>.json`` and ``.md`` (``--name`` overrides the
basename), rewritten after every measurement (``"complete": false`` until the end, so a run
cut off by a time limit leaves what it measured); exits 1 when a part failed (after writing
both). ``--parts``: by default all but ``ON_REQUEST``'s (each child a compile of its own).

``--smoke``: the parts at tiny sizes on the CPU (JAX_PLATFORMS=cpu, XLA's cheap compiles),
two at a time with the device lock, into a fresh temporary directory unless --out_dir is
given: the step in float32 only (bfloat16 runs in the large part, 2 layers x 64), V = 65 and
256 (chunked) on 1 layer; targets "n/a (smoke)". tests/test_gpu_suite.py runs all six.

``--plan_only`` prints the children in the order they are offered, each with one H100's
time and bytes (gpu_suite_plan.H100_EXPECT, the 2026-11-27 lease's), and the wall time those
schedule to (gpu_suite_plan.expected_wall: an estimate, to cut a lease's plan to), without a
device. On a lent GPU machine (one call at most 600 s, 15 minutes of device time a session, a
machine's start included): ``bash experiments/gpu_machine.sh download`` here once (the wheels
its image lacks, and the corpus), then one device run (carry [".whl", "shared"], timeout_s
595; ``--budget_s`` ends the suite inside the call, the parts that did not fit recorded as not
run):

  source experiments/gpu_machine.sh && python3 experiments/gpu_suite.py --out_dir=$OUT \
      --budget_s=540 2>&1 | tee $OUT/gpu_suite.log

One H100 (2026-11-28) ran the default suite in one such call in 393 s (11 compiles shared the
device for 547 s, 13 timed sections held it for 83 s), and a second call resumed it with
``--parts=pallas,profile`` in 226 s (experiments/results/gpu_h100_2026-11-28). To resume, copy
the reply's ``gpu_suite_<device>.json`` (under files_at) into a folder .git/info/exclude
ignores (``.gpu_prev/``), and the next call (carry it too) adds
``--resume=.gpu_prev/gpu_suite_<device>.json`` (with ``--parts`` the ones to add or finish):
the probe runs again, every measurement recorded there without an error is kept, the rest run.
Keep each call's record and log in experiments/results/gpu_<device>_<date>/ and write the
device's record from them with experiments/gpu_suite_assemble.py (the first call's wall time,
the last call's measurements).
The H200 record (parts run by hand, folded in by experiments/results/gpu_h200_2026-11-26/)
resumes on an H200 with ``--rerun=exhaustive`` (its rows predate the loss that stops
recomputing member chunks; each kept measurement names its checkout in ``measured_at``).
"""

from __future__ import annotations

import json
import shlex
import sys
import tempfile
import threading
import time
from pathlib import Path

from absl import app, flags

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))  # measure.py, trl_grpo.py, gpu_suite_*.py beside this file

import device_lock  # noqa: E402
import gpu_suite_report as report  # noqa: E402
from gpu_suite_jobs import CHILD_ENV_KEYS, Limits, child_env, run_jobs  # noqa: E402
from gpu_suite_parts import jobs_of, peak, probe, shown  # noqa: E402
from gpu_suite_plan import (  # noqa: E402
    H100_MEMORY_LIMIT,
    MEMORY_SHARE,
    SUITE_BUDGET_S,
    expected_wall,
    plan,
    queue_order,
)
from versus_trl import git_state  # noqa: E402

FLAGS = flags.FLAGS
PARTS = ("step", "trl", "exhaustive", "large", "attention", "pallas", "profile")
ON_REQUEST = (
    "attention",
    "pallas",
    "profile",
)  # explain a measurement rather than make one of the issue's
DEFAULT_PARTS = tuple(p for p in PARTS if p not in ON_REQUEST)  # issue 15's measurements
flags.DEFINE_bool("smoke", False, "Every part at tiny sizes on the CPU (seconds, not minutes).")
flags.DEFINE_list(
    "parts", list(DEFAULT_PARTS), f"Parts to run, of {', '.join(PARTS)} (probe always)."
)
flags.DEFINE_string(
    "out_dir",
    "",
    "Where the JSON and markdown go ('': experiments/results, "
    "or a new temporary directory with --smoke).",
)
flags.DEFINE_string("name", "", "Basename of the outputs ('': gpu_suite_<device>[_smoke]).")
flags.DEFINE_string("trl_python", sys.executable, "The Python that runs TRL (torch, trl).")
flags.DEFINE_integer(
    "jobs",
    0,
    "Measurements at a time (0: 3 on a GPU, 2 with --smoke); above 1 their timed sections "
    "take turns on the device (experiments/device_lock.py), their compiles overlap.",
    lower_bound=0,
)
flags.DEFINE_float("time_scale", 1.0, "Multiplies every part's time limit.", lower_bound=0.1)
flags.DEFINE_float(
    "budget_s",
    0.0,
    "The whole suite's wall-clock budget (0: none): each measurement's limit is cut to what "
    "is left, and those that find under a minute left are recorded as not run, so a lease's "
    "time limit ends the suite cleanly instead of killing it mid-part.",
    lower_bound=0.0,
)
flags.DEFINE_string(
    "resume",
    "",
    "A JSON this suite wrote before on the same device kind: its measurements with the same "
    "command and no error are kept, the rest of --parts run (a suite longer than one lease "
    "call); the record keeps the other parts' measurements too.",
)
flags.DEFINE_list("rerun", [], "With --resume: parts whose kept measurements run again.")
flags.DEFINE_list(
    "large_batches",
    [],
    "The large model's prompts per step, each its own measurement ('': the plan's, 16 on a "
    "GPU); e.g. 16,32 adds 32, which on one H100 took 250 s of the suite's 497 s.",
)
flags.DEFINE_enum(
    "decode_kernel",
    "pallas",
    ["pallas", "flash"],
    "The pallas part's model.decode_kernel: the framework's own Triton kernel or jax's "
    "flash-decoding kernel (grpo_jax/decode_kernel.py).",
)
flags.DEFINE_bool(
    "plan_only",
    False,
    "Print the GPU plan's children in the order they are offered, each with one H100's "
    "time and bytes, and the wall time they schedule to; run nothing (no device needed).",
)
flags.DEFINE_string("child", "", "Internal: run one measurement (probe or peak), print JSON.")
flags.DEFINE_string("child_spec", "", "Internal: the child's JSON argument.")

START = time.perf_counter()  # --budget_s counts from here


# ---------------------------------------------------------------------------------------
# main


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    if FLAGS.child:
        if FLAGS.child not in ("probe", "peak"):
            raise app.UsageError(f"--child={FLAGS.child}: only probe or peak")
        spec = json.loads(FLAGS.child_spec or "{}")
        print(json.dumps(probe() if FLAGS.child == "probe" else peak(spec)), flush=True)
        return
    for name in ("parts", "rerun"):
        if unknown := set(FLAGS[name].value) - set(PARTS):
            sys.exit(f"error: --{name}: unknown {sorted(unknown)}; choose from {PARTS}")
    if FLAGS.rerun and not FLAGS.resume:
        sys.exit("error: --rerun needs --resume=FILE (without it every part runs anyway)")
    if bad := [b for b in FLAGS.large_batches if not (b.isdigit() and int(b) > 0)]:
        sys.exit(f"error: --large_batches: {bad} are not positive counts of prompts; e.g. 16,32")
    t0 = time.perf_counter()
    batches = [int(b) for b in FLAGS.large_batches]
    smoke, p = FLAGS.smoke, plan(FLAGS.smoke, batches, FLAGS.decode_kernel)
    workers = FLAGS.jobs or (2 if smoke else 3)
    if FLAGS.plan_only:
        print_plan(jobs_of(p, FLAGS.parts, FLAGS.trl_python)[1:], workers)
        return
    with tempfile.TemporaryDirectory(prefix="gpu_suite_") as scratch:
        suite(smoke, p, workers, child_env(smoke, workers, Path(scratch)), t0)


def suite(smoke: bool, p: dict, workers: int, env: dict, t0: float) -> None:
    """Runs the plan's children ``workers`` at a time in ``env``, writing both outputs after
    each; exits 1 when a part failed."""
    out_dir = Path(
        FLAGS.out_dir
        or (tempfile.mkdtemp(prefix="gpu_suite_smoke_") if smoke else ROOT / "experiments/results")
    )
    # resuming, every part's kept measurements stay in the record; --parts picks what runs
    jobs = jobs_of(p, PARTS if FLAGS.resume else FLAGS.parts, FLAGS.trl_python)
    print(f"{len(jobs)} measurements, {workers} at a time", flush=True)
    lock = threading.Lock()
    run = {
        "command": "python experiments/gpu_suite.py "
        + " ".join(shlex.quote(a) for a in sys.argv[1:]),
        "git": git_state(),
        "child_env": {k: env[k] for k in CHILD_ENV_KEYS if k in env},
        "workers": workers,
    }

    def write(final: bool):
        """Both outputs from the jobs done so far (each job rewrites them, so a run cut off
        by a time limit leaves what it measured), once the probe has named the device."""
        with lock:
            if not final and "result" not in jobs[0]:
                return None
            lock_dir = env.get(device_lock.ENV)
            shared = device_lock.summary(lock_dir) if lock_dir else None
            raw = report.record(jobs, p, smoke=smoke, final=final, t0=t0, device_lock=shared, **run)
            return raw, report.write(raw, out_dir, FLAGS.name)

    limits = Limits(FLAGS.time_scale, FLAGS.budget_s, FLAGS.trl_python, START)
    run_jobs(jobs[:1], env, 1, limits)  # the probe first: the device's memory, the record's kind
    if FLAGS.resume:
        print(f"kept from {FLAGS.resume}: {resume(jobs, FLAGS.resume)}", flush=True)
        jobs[1:] = [j for j in jobs[1:] if "result" in j or j["part"] in FLAGS.parts]
    limit = jobs[0]["result"].get("memory_bytes_limit")
    capacity = limit * MEMORY_SHARE if limit else None
    if not smoke:
        print(estimate([j for j in jobs[1:] if "result" not in j], workers, capacity), flush=True)
    run_jobs(jobs, env, workers, limits, done=lambda: write(final=False), capacity=capacity)
    raw, path = write(final=True)
    print(report.markdown(raw))
    print(f"wrote {path}.json and .md in {raw['wall_s']:.0f} s")
    failed = [k for k, v in raw["results"].items() if has_error(v)]
    if failed:
        print(f"failed parts: {', '.join(failed)}", file=sys.stderr)
        sys.exit(1)


def estimate(jobs: list, workers: int, capacity) -> str:
    """What one H100's times for these children (gpu_suite_plan.H100_EXPECT) schedule to."""
    if missing := [f"{j['part']} {j['key']}" for j in jobs if "expect_s" not in j]:
        return f"no estimate of the wall time: no H100 time for {', '.join(missing)}"
    wall = expected_wall(jobs, workers, capacity)
    return (
        f"one H100's times for these {len(jobs)} schedule to about {wall:.0f} s, {workers} at "
        f"a time (budget {SUITE_BUDGET_S} s; gpu_suite_plan.expected_wall)"
    )


def print_plan(jobs: list, workers: int) -> None:
    """--plan_only: the children in the order they are offered, and their estimate."""
    for job in queue_order(jobs):
        hint = f"{job.get('expect_s', '?')} s, {job.get('expect_bytes', 0) / 1e9:.1f} GB"
        command = job.get("shown") or shown(job["cmd"], FLAGS.trl_python)
        print(f"{job['part']} {job['key']}: {hint}\n  $ {command}")
    print(estimate(jobs, workers, H100_MEMORY_LIMIT * MEMORY_SHARE))


def resume(jobs: list, path: str) -> int:
    """Gives ``jobs`` the results recorded in ``path`` for the same part, key and command
    (errors, skips and --rerun's parts run again); exits with an error line where ``path``
    is no suite record or was measured on another device kind than ``jobs[0]``'s probe.
    Returns how many."""
    try:
        old = json.loads(Path(path).read_text())
        records, kind = old["child_records"], old["device"].get("device_kind")
    except (OSError, ValueError, KeyError, AttributeError) as e:
        sys.exit(f"error: --resume={path}: not a record this suite wrote ({e}); pass its JSON")
    here = jobs[0]["result"].get("device_kind")
    if kind != here:
        sys.exit(f"error: --resume={path} was measured on {kind!r}, this is {here!r}: "
                 "resume only on the same device kind, or run without --resume")  # fmt: skip
    done = {
        (r["part"], r["key"], r["result"].get("command")): r["result"]
        for r in records
        if r["part"] not in ("probe", *FLAGS.rerun)
        and not ({"error", "skipped"} & set(r["result"]))
    }
    kept = 0
    for job in jobs[1:]:
        command = job.get("shown") or shown(job["cmd"], FLAGS.trl_python)
        result = done.get((job["part"], job["key"], command))
        if result is not None:
            # which code measured it: the old record's checkout, not this one
            job["result"] = {**result, "resumed_from": path, "measured_at": old.get("git")}
            kept += 1
    return kept


def has_error(x) -> bool:
    if isinstance(x, dict):
        return "error" in x or any(has_error(v) for v in x.values())
    return False


if __name__ == "__main__":
    app.run(main)
