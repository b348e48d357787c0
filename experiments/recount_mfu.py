"""Recorded GPU suite rows counted again by today's FLOP counter, with the rows' recorded times
(tracing only: runs on a CPU, nothing is timed).

The 2026-11-27 H100 record's ``attention`` rows (results/gpu_h100_2026-11-27/call3.json)
were counted before flop_count.py sized cuDNN's fused attention, so they count it as no work;
the default recounts the ``attention 16`` child (the large model at 16 prompts,
``model.attention=cudnn``) to correct its MFU:

  GRPO_JAX_DATA=../shared/data/tinyshakespeare.txt python experiments/recount_mfu.py

``--floor`` recomputes the rollout floor (gpu_suite_parts.rollout_floor) of every recorded
large-model row, whose records took the rollout's phases as overlapping: it counts each
row's decode-loop FLOPs (flop_count.loop_matmul_flops) from the row's own command and writes
results/rollout_floor_recount.{json,md}:

  GRPO_JAX_DATA=../shared/data/tinyshakespeare.txt python experiments/recount_mfu.py --floor

The cuDNN version check and the GPU-kernel config check are stubbed (as
tests/test_model_rollout.py stubs them), so that the cudnn and Pallas paths trace without a GPU.
"""

import argparse
import copy
import json
import shlex
from pathlib import Path

import jax
import jax._src.cudnn.fused_attention_stablehlo as fused_attention
from flop_count import step_flops
from gpu_suite_parts import NOMINAL_PEAKS, rollout_floor

from grpo_jax import specs, trainer
from grpo_jax.configs.shakespeare import get_config
from grpo_jax.tasks import build_task

fused_attention.check_cudnn_version = lambda: 91000
specs.ModelSpec.check_gpu_kernel = lambda self, *a, **k: None

RESULTS = Path(__file__).parent / "results"
ATTENTION = ("gpu_h100_2026-11-27/call3.json", "attention", "16")
FLOOR_ROWS = (  # (record, part, prompts): every recorded row with a rollout floor
    ("gpu_suite_nvidia-h100-80gb-hbm3.json", "large", "16"),
    ("gpu_suite_nvidia-h100-80gb-hbm3.json", "pallas", "16"),
    ("gpu_h100_2026-11-27/call3.json", "large", "16"),
    ("gpu_h100_2026-11-27/call3.json", "large", "32"),
    ATTENTION,
)


def config_of(command: str):
    """The config a recorded benchmark.py command ran: its variant and --config.* flags."""
    args = shlex.split(command)
    variant = next(a for a in args if a.startswith("--config=")).split(":")[1]
    cfg = get_config(variant)
    for arg in args:
        if arg.startswith("--config."):
            key, value = arg[len("--config.") :].split("=", 1)
            block, field = key.split(".")
            kind = type(cfg[block][field])
            cfg[block][field] = value == "True" if kind is bool else kind(value)
    return cfg


def counts(cfg) -> dict:
    """The step's, each half's and the rollout loop's matmul FLOPs, traced on this CPU."""
    cpu = copy.deepcopy(cfg)  # params initialised on the CPU paths: the same shapes
    cpu.model.attention, cpu.model.decode_kernel = "shared_prefix", "xla"
    params0 = trainer.initial_params(cpu, build_task(cpu, "train"))
    task = build_task(cfg, "train")
    step, inputs = task.build(params0)
    state = task.make_state(params0)
    batch = jax.eval_shape(step.rollout, state, inputs)
    rollout = step_flops(step.rollout, state, inputs)
    return {
        "step": step_flops(step.fused, state, inputs)["matmul_flops"],
        "rollout": rollout["matmul_flops"],
        "rollout_loop": rollout["loop_matmul_flops"],
        "update": step_flops(step.update, state, inputs, batch, None)["matmul_flops"],
    }


def row_of(record: str, part: str, prompts: str) -> tuple[dict, dict]:
    raw = json.loads((RESULTS / record).read_text())
    return raw["results"][part][prompts], raw["device"]


def attention_mfu() -> dict:
    row, _ = row_of(*ATTENTION)
    flops = counts(config_of(row["command"]))
    seconds = {"step": row["median_step_s"], "rollout": row["rollout_s"], "update": row["update_s"]}
    peak = dict(NOMINAL_PEAKS)["H100"]["bfloat16"]
    out = {}
    for part in ("rollout", "update", "step"):
        recorded = row["matmul_flops" if part == "step" else f"{part}_matmul_flops"]
        out[part] = {
            "seconds": seconds[part],
            "recorded_tflop": recorded / 1e12,
            "recounted_tflop": flops[part] / 1e12,
            "recorded_mfu_pct": 100 * recorded / seconds[part] / peak,
            "recounted_mfu_pct": 100 * flops[part] / seconds[part] / peak,
        }
        print(part, {k: round(v, 4) for k, v in out[part].items()})
    return {"nominal_bf16_peak": peak, **out}


def floors() -> list:
    """Each FLOOR_ROWS row's floor as recorded and as rollout_floor computes it today, from the
    row's recorded rollout time and decode bytes and its recounted FLOPs."""
    out = []
    for record, part, prompts in FLOOR_ROWS:
        row, device = row_of(record, part, prompts)
        flops, old = counts(config_of(row["command"])), row["rollout_floor"]
        new = rollout_floor(
            flops["rollout"], flops["rollout_loop"], row["rollout_s"], old["decode_bytes"],
            row["dtype"], device,
        )  # fmt: skip
        out.append({
            "record": record, "part": part, "prompts": int(prompts),
            "rollout_s": row["rollout_s"], "recorded_rollout_flops": row["rollout_matmul_flops"],
            "rollout_flops": flops["rollout"], "rollout_loop_flops": flops["rollout_loop"],
            "recorded": old, "recounted": new,
        })  # fmt: skip
        print(json.dumps(out[-1]))
    return out


def floor_markdown(rows: list) -> str:
    lines = [
        "# The large model's rollout floor, recounted (experiments/recount_mfu.py --floor)",
        "",
        "The recorded floors took the rollout's phases as overlapping: max(all its matmul FLOPs "
        "at the nominal peak, its decode loop's least traffic at the HBM bandwidth). The phases "
        "run one after another, so the floor is the matmuls outside the decode loop (the "
        "prefill, the reference's pass) at the peak plus the loop's larger of its FLOPs at the "
        "peak and its traffic (gpu_suite_parts.rollout_floor since 2026-11-29). Times and bytes "
        "are the records'; the FLOPs are traced from each row's command on a CPU.",
        "",
        "| record | part | prompts | rollout ms | TFLOP (in the loop) | recorded: floor ms, "
        "× floor, MFU ceiling | recounted: floor ms, × floor, MFU ceiling |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        old, new = r["recorded"], r["recounted"]
        old_floor = r["rollout_s"] / old["times_floor"]
        lines.append(
            f"| {r['record']} | {r['part']} | {r['prompts']} | {1e3 * r['rollout_s']:.1f} | "
            f"{r['rollout_flops'] / 1e12:.2f} ({r['rollout_loop_flops'] / 1e12:.2f}) | "
            f"{1e3 * old_floor:.1f}, {old['times_floor']:.2f}×, {100 * old['mfu_ceiling']:.1f} % | "
            f"{1e3 * new['floor_s']:.1f}, {new['times_floor']:.2f}×, "
            f"{100 * new['mfu_ceiling']:.1f} % |"
        )
    return "\n".join(lines) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--floor", action="store_true", help="recount the large rows' floors")
    if not ap.parse_args().floor:
        print(json.dumps(attention_mfu()))
        return
    rows = floors()
    (RESULTS / "rollout_floor_recount.json").write_text(json.dumps(rows, indent=1) + "\n")
    (RESULTS / "rollout_floor_recount.md").write_text(floor_markdown(rows))


if __name__ == "__main__":
    main()
