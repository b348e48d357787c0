"""The GPU suite's sizes (experiments/gpu_suite.py): each part's workload, the issue's for one
H100 and tiny ones for --smoke (the same code paths on a CPU in seconds)."""

from __future__ import annotations

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
# the large part's prompts per step, each its own measurement: at 16 (256 sequences per
# decode step) one H200's rollout reached 5.2 % of the bf16 peak, each of its 127 decode steps
# a pass over 85 M parameters for 256 rows; 32 doubles the rows each pass serves (its memory,
# about twice 16's by the CPU plans above, is unmeasured on a GPU)
LARGE_BATCHES = (16, 32)


def plan(smoke: bool) -> dict:
    """Every part's sizes: the issue's for a GPU, tiny ones (same code paths) for --smoke."""
    return smoke_plan() if smoke else gpu_plan()


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
    }


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
            "batches": (2,),  # one: the GPU plan's second is the same code path
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
