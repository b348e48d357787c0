"""The GPU suite's plan (experiments/gpu_suite.py): each part's workload, the issue's for one
H100 and tiny ones for --smoke (the same code paths on a CPU in seconds), and the order its
children run in (schedule: what one H100 measured of each child's time and memory)."""

from __future__ import annotations

import threading

SUITE_BUDGET_S = 480  # the "under 8 minutes on one H100"

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
    # is 52 GiB (103 GiB at 32 prompts); one H200 peaked at 23.0 GiB. The loss runs unchunked,
    # as on that H200 (group.loss_chunk=4 would cut the plan's temporaries 51 -> 18 GiB)
    "train.batch_size": 16,
}
# the large part's prompts per step, each its own measurement (gpu_suite.py --large_batches):
# at 16 (256 sequences per decode step) one H100's rollout reached 4.8 % of the bf16 peak,
# each of its 127 decode steps a pass over 85 M parameters for 256 rows. 32 prompts (6.0 %,
# 47.9 GB) is on request: with it the default suite took 497 s of its 480 on one H100
# (2026-11-27), and its child alone 250 s of the 1,423 its children took
LARGE_BATCHES = (16,)
LARGE_PARTS = ("large", "attention", "pallas")  # benchmark.py on it, keyed by prompts per step


# What each child took on one H100 (experiments/results/gpu_h100_2026-11-28: wall seconds
# three at a time, its compiles and its waits for the device lock included; peak device
# bytes), for the schedule below and expected_wall. Call 1 ran the default suite, call 2 the
# pallas and profile children beside each other; large 32 and attention 16 are from
# gpu_h100_2026-11-27. The peaks' and TRL's bytes were not recorded and are estimates (a peak
# call holds its 8 outputs: 8 x 8192^2 in float32 is 2.1 GB, in bfloat16 1.1 GB). On
# 2026-11-26 the first call ran large 16 beside large 32 and V = 50,000: out of memory,
# hence the bytes.
H100_EXPECT = {
    "peak float32": (8, 2.5e9),
    "peak bfloat16": (8, 1.5e9),
    "step float32": (188, 0.4e9),
    "step bfloat16": (180, 0.3e9),
    "trl float32": (79, 1.0e9),  # torch's bytes unrecorded; 4x4x128 in float32 is small
    "trl bfloat16": (65, 1.0e9),
    "exhaustive 65": (66, 0.6e9),
    "exhaustive 256": (130, 1.2e9),
    "exhaustive 1000": (123, 9.8e9),
    "exhaustive 50000": (135, 5.6e9),
    "large 16": (187, 24.7e9),
    "large 32": (250, 47.9e9),
    "attention 16": (151, 18.7e9),  # 2026-11-27, beside a part since removed
    "pallas 16": (224, 24.7e9),
    "profile step": (192, 0.3e9),  # beside profile large; bytes: step bfloat16's
    "profile large": (218, 24.7e9),  # the bytes are large 16's (the same step)
}
# the probe's memory_bytes_limit on one H100 (XLA_PYTHON_CLIENT_MEM_FRACTION=0.92)
H100_MEMORY_LIMIT = 78_217_478_144
# the share of a process's memory limit (XLA_PYTHON_CLIENT_MEM_FRACTION of the device) that
# the children running at once may expect to peak at together: the peaks are the allocators'
# bytes in use, each process also holds its CUDA context, cuDNN workspaces and fragmentation
MEMORY_SHARE = 0.8


def queue_order(jobs: list) -> list:
    """The order jobs are offered in: the peaks first, then the longest expected first."""
    return sorted(jobs, key=lambda j: (j["part"] != "peak", -j.get("expect_s", 0)))


def _first_fitting(pending: list, busy_bytes: float, busy_jobs: int, capacity):
    """The first pending job whose ``expect_bytes`` fit in ``capacity`` beside the running
    jobs' (alone, any job fits; None: no limit), or None."""
    for job in pending:
        need = busy_bytes + job.get("expect_bytes", 0)
        if capacity is None or busy_jobs == 0 or need <= capacity:
            return job
    return None


def schedule(jobs: list, workers: int, run, capacity: float | None = None) -> None:
    """``run(job)`` for every job, ``workers`` at a time: the peaks first, then the longest
    expected (``expect_s``) first, a job whose ``expect_bytes`` would not fit in ``capacity``
    beside the running jobs' waiting for them to finish (alone a job always starts; None: no
    limit). The first exception a ``run`` raised is raised once all have finished."""
    pending = queue_order(jobs)
    cond, busy, errors = threading.Condition(), {"bytes": 0.0, "jobs": 0}, []

    def next_job():
        return _first_fitting(pending, busy["bytes"], busy["jobs"], capacity)

    def worker():
        while True:
            with cond:
                while pending and (job := next_job()) is None:
                    cond.wait()
                if not pending:
                    return
                pending.remove(job)
                busy["bytes"] += job.get("expect_bytes", 0)
                busy["jobs"] += 1
            try:
                run(job)
            except Exception as e:  # raised below, once the others have finished
                errors.append(e)
            with cond:
                busy["bytes"] -= job.get("expect_bytes", 0)
                busy["jobs"] -= 1
                cond.notify_all()

    threads = [threading.Thread(target=worker) for _ in range(max(1, workers))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def expected_wall(jobs: list, workers: int, capacity: float | None = None) -> float:
    """The seconds ``schedule`` takes if every job takes its ``expect_s`` (0 without one): the
    same order and memory rule on a simulated clock. With H100_EXPECT it replays one H100's
    children, whose walls include the waits the device lock made them take beside the others
    they ran with then; other company waits differently, so it is an estimate, not a time.
    For the 12 children that 2026-11-27's call ran after its probe it gives 493 s; the call
    took 497."""
    pending, running, now = queue_order(jobs), [], 0.0  # running: (end, bytes)
    while pending or running:
        busy = sum(b for _, b in running)
        job = _first_fitting(pending, busy, len(running), capacity)
        if job is not None and len(running) < max(1, workers):
            pending.remove(job)
            running.append((now + job.get("expect_s", 0), job.get("expect_bytes", 0)))
        else:
            running.remove(first := min(running))
            now = first[0]
    return now


def plan(smoke: bool, large_batches=(), decode_kernel: str = "pallas") -> dict:
    """Every part's sizes: the issue's for a GPU, tiny ones (same code paths) for --smoke;
    ``large_batches`` (prompts per step), where given, replace the large part's;
    ``decode_kernel``: the pallas part's model.decode_kernel (``pallas`` or ``flash``)."""
    p = smoke_plan() if smoke else gpu_plan()
    if large_batches:
        p["large"]["batches"] = tuple(large_batches)
    # on request: the large part's model at its first batch with cuDNN's fused attention in
    # its full-sequence passes, beside the shared prefix (a CPU has no cuDNN: XLA's path)
    large = p["large"]
    setting = {"model.attention": "xla" if smoke else "cudnn"}
    p["attention"] = {**large, "overrides": {**large["overrides"], **setting}}
    p["attention"]["batches"] = large["batches"][:1]
    if not smoke:  # and the decode steps' attention as Pallas (Triton) kernels
        setting = {"model.decode_kernel": decode_kernel}
        p["pallas"] = {**large, "overrides": {**large["overrides"], **setting}}
        p["pallas"]["batches"] = large["batches"][:1]
    return p


def gpu_plan() -> dict:
    """The issue's sizes (one H100)."""
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
            # (V, rollout chunk, loss chunk, warmup, steps[, compute dtype]); 0 = all members
            # at once; the dtype float32 where not given
            "runs": (
                # the loss in member chunks: all at once the H200 peaked at 2.42 / 9.25 GiB
                # (guide / 4.6, / 4.8); chunked, XLA's CPU buffer plans shrink 2.51 -> 0.58
                # and 10.13 -> 1.38 GiB (rollout chunks change nothing there)
                (65, 0, 13, 1, 3),
                (256, 0, 32, 1, 3),
                (1000, 0, 250, 1, 2),  # CPU buffer plan 12.2 GiB (all at once: 54)
                # bfloat16 matmuls: 80 s an iteration on one H200, float32 (TF32) 104 s
                (50000, 2500, 25, 0, 1, "bfloat16"),
            ),
            "timeout": 300,
        },
        "large": {
            "variant": "sampled",
            "overrides": LARGE,
            "batches": LARGE_BATCHES,
            "args": ("--warmup=1", "--steps=3", "--breakdown_runs=2"),
            "timeout": 420,
        },
        # where the time goes (profile_step.py), in the compute dtype GPUs run: the step above,
        # and the large model, whose rollout reached 5 % of the H200's bf16 peak (decode-bound
        # or not is what its profile answers)
        "profile": {
            "runs": {
                "step": ("sampled", {**STEP, "model.dtype": "bfloat16"}),
                "large": ("sampled", LARGE),  # bfloat16 already
            },
            "args": ("--warmup=2", "--steps=3", "--top=12"),
            "timeout": 240,
        },
        "probe_timeout": 120,
        "peak_timeout": 120,
        "expect": {k: list(v) for k, v in H100_EXPECT.items()},
    }


# TRL's side at smoke size: one warm-up and one timed step of a one-layer GPT-2 on the CPU
SMOKE_TRL = dict(
    steps=1,
    warmup=1,
    device="cpu",
    batch_prompts=2,
    group=2,
    context=16,
    horizon=8,
    layers=1,
    heads=2,
    width=32,
)


def smoke_plan() -> dict:
    """Tiny sizes on the CPU through the same code paths (--smoke)."""
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
            "kwargs": SMOKE_TRL,
            "timeout": 240,
        },
        "exhaustive": {
            "variant": "exhaustive,tiny",
            "args": ("--batch_size=2", "--context_len=16", "--horizon=8", "--corpus_len=4000"),
            # V = 256 in bfloat16 compute, as the GPU plan's V = 50,000
            "runs": ((65, 0, 0, 0, 1), (256, 32, 32, 0, 1, "bfloat16")),
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
            "batches": (2,),
            "args": ("--warmup=1", "--steps=2", "--breakdown_runs=1"),
            "timeout": 240,
        },
        "profile": {
            # one run: the GPU plan's second (the large model) is the same code path
            "runs": {"step": ("tiny,sampled", {**STEP, **tiny, "model.dtype": "float32"})},
            "args": ("--warmup=1", "--steps=1", "--top=5"),
            "timeout": 240,
        },
        "probe_timeout": 240,
        "peak_timeout": 240,
    }
