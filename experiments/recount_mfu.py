"""The matmul FLOPs of a recorded GPU suite row, counted again by today's counter, and the MFU
they give with the row's recorded times (tracing only: runs on a CPU, nothing is timed).

The 2026-11-27 H100 record's ``attention`` rows (results/gpu_h100_2026-11-27/call3.json)
were counted before flop_count.py sized cuDNN's fused attention, so they count it as no work;
this recounts the ``attention 16`` child (the large model at 16 prompts,
``model.attention=cudnn``) to correct its MFU:

  GRPO_JAX_DATA=../shared/data/tinyshakespeare.txt python experiments/recount_mfu.py

The cuDNN version check and the GPU-kernel config check are stubbed (as
tests/test_model_rollout.py stubs them), so that the cudnn path traces without a GPU.
"""

import copy
import json
from pathlib import Path

import jax
import jax._src.cudnn.fused_attention_stablehlo as fused_attention
from flop_count import step_flops
from gpu_suite_parts import NOMINAL_PEAKS

from grpo_jax import specs, trainer
from grpo_jax.configs.shakespeare import get_config
from grpo_jax.tasks import build_task

fused_attention.check_cudnn_version = lambda: 91000
specs.ModelSpec.check_gpu_kernel = lambda self, *a, **k: None

RECORD = Path(__file__).parent / "results" / "gpu_h100_2026-11-27" / "call3.json"
OVERRIDES = {  # the record's `attention 16` command (gpu_h100_2026-11-27/call3.md)
    "group.size": 16, "reference.kind": "policy", "grpo.kl_estimator": "k3",
    "reward.terms": "match", "grpo.beta": 0.04, "train.batch_size": 16,
    "grpo.num_iterations": 1, "model.num_layers": 12, "model.num_heads": 12,
    "model.d_model": 768, "model.dtype": "bfloat16", "data.context_len": 256,
    "data.horizon": 128, "model.attention": "cudnn",
}  # fmt: skip


def main():
    cfg = get_config("sampled")
    for key, value in OVERRIDES.items():
        block, field = key.split(".")
        cfg[block][field] = value
    cpu = copy.deepcopy(cfg)  # params initialised on the CPU path: the same shapes
    cpu.model.attention = "shared_prefix"
    params0 = trainer.initial_params(cpu, build_task(cpu, "train"))
    task = build_task(cfg, "train")
    step, inputs = task.build(params0)
    state = task.make_state(params0)
    batch = jax.eval_shape(step.rollout, state, inputs)
    flops = {
        "step": step_flops(step.fused, state, inputs)["matmul_flops"],
        "rollout": step_flops(step.rollout, state, inputs)["matmul_flops"],
        "update": step_flops(step.update, state, inputs, batch, None)["matmul_flops"],
    }
    row = json.loads(RECORD.read_text())["results"]["attention"]["16"]
    seconds = {"step": row["median_step_s"], "rollout": row["rollout_s"], "update": row["update_s"]}
    recorded = {
        "step": row["matmul_flops"],
        "rollout": row["rollout_matmul_flops"],
        "update": row["update_matmul_flops"],
    }
    peak = dict(NOMINAL_PEAKS)["H100"]["bfloat16"]
    out = {}
    for part in ("rollout", "update", "step"):
        out[part] = {
            "seconds": seconds[part],
            "recorded_tflop": recorded[part] / 1e12,
            "recounted_tflop": flops[part] / 1e12,
            "recorded_mfu_pct": 100 * recorded[part] / seconds[part] / peak,
            "recounted_mfu_pct": 100 * flops[part] / seconds[part] / peak,
        }
        print(part, {k: round(v, 4) for k, v in out[part].items()})
    print(json.dumps({"nominal_bf16_peak": peak, **out}))


if __name__ == "__main__":
    main()
