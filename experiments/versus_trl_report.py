"""The markdown of a versus_trl.py record: the headline ratio, a row per round, the machine
and versions, the commands, and what differs between the two sides (``NOTES``, also kept
in the JSON). ``summary_of`` reduces the rounds to the figures the headline quotes.
"""

from __future__ import annotations

import pathlib
import statistics


def summarise(xs):
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def summary_of(rounds: list[dict]) -> dict:
    """Medians over rounds of each round's median, per-round ratios, the fastest steps."""
    jm = [r["grpo_jax"]["median_step_s"] for r in rounds]
    tm = [r["trl"]["median_step_s"] for r in rounds]
    summary = {
        "grpo_jax_s_per_step": summarise(jm),
        "trl_s_per_step": summarise(tm),
        "ratio_of_medians": statistics.median(tm) / statistics.median(jm),
        "ratio_per_round": summarise([r["ratio"] for r in rounds]),
        # the fastest step of all rounds on each side: the least disturbed by other processes
        "grpo_jax_fastest_step_s": min(r["grpo_jax"]["min_step_s"] for r in rounds),
        "trl_fastest_step_s": min(r["trl"]["min_step_s"] for r in rounds),
        "grpo_jax_tokens_per_s": statistics.median(r["grpo_jax"]["tokens_per_s"] for r in rounds),
        "trl_tokens_per_s": statistics.median(r["trl"]["tokens_per_s"] for r in rounds),
        "grpo_jax_compile_s": summarise([r["grpo_jax"]["compile_s"] for r in rounds]),
    }
    summary["ratio_of_fastest"] = summary["trl_fastest_step_s"] / summary["grpo_jax_fastest_step_s"]
    return summary


def share(side: dict) -> str:
    x = side.get("other_processes_cpu_share")
    return "n/a" if x is None else f"{100 * x:.0f} %"


def git_lines(res: dict) -> list[str]:
    g = res.get("git")
    if not g:
        return []
    out = []
    for when in ("start", "end"):
        st = g.get(when) or {}
        dirty = ", ".join(st.get("dirty") or []) or "none"
        out.append(f"- checkout at the {when}: HEAD {st.get('head')}, tracked changes: {dirty}")
    return out


def _round_rows(res: dict) -> list[str]:
    rows = [
        "| round | grpo_jax s/step (min–max) | TRL s/step (min–max) | TRL ÷ grpo_jax | "
        "grpo_jax tokens/s | TRL tokens/s | load avg before | other processes' CPU "
        "(grpo_jax / TRL run) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in res["rounds"]:
        gj, tr = r["grpo_jax"], r["trl"]
        rows.append(
            f"| {r['round']} | {gj['median_step_s']:.3f} ({min(gj['step_times_s']):.3f}–"
            f"{max(gj['step_times_s']):.3f}) | {tr['median_step_s']:.3f} ({tr['min_step_s']:.3f}–"
            f"{tr['max_step_s']:.3f}) | {r['ratio']:.2f} | {gj['tokens_per_s']:,.0f} | "
            f"{tr['tokens_per_s']:,.0f} | {r['load_before'][0]:.2f} | "
            f"{share(gj)} / {share(tr)} |"
        )
    return rows


def _headline(res: dict) -> list[str]:
    s, w = res["summary"], res["work"]
    return [
        f"# grpo_jax vs TRL GRPOTrainer, side by side ({res['name']})",
        "",
        f"Measured {res['date']} in one invocation of `experiments/versus_trl.py`: {w['rounds']} "
        f"alternating rounds (grpo_jax then TRL, each a fresh process), {w['warmup']} untimed "
        f"warm-up steps then {w['steps']} timed steps per side per round.",
        "",
        f"Work: {w['layers']} x {w['heads']} x {w['width']} char GPT, {w['batch_prompts']} prompts "
        f"x G = {w['group']}, context {w['context']}, horizon {w['horizon']} (forced), mu = 1, "
        f"beta = {w['beta']}, k3 KL to the frozen initial policy, `match` reward, {w['dtype']}; "
        f"{w['batch_prompts'] * w['group'] * w['horizon']:,} generated tokens per step.",
        "",
        f"**grpo_jax {s['grpo_jax_s_per_step']['median']:.3f} s/step, TRL "
        f"{s['trl_s_per_step']['median']:.3f} s/step: TRL takes {s['ratio_of_medians']:.2f}x "
        f"as long per step** (per-round ratios {s['ratio_per_round']['min']:.2f}–"
        f"{s['ratio_per_round']['max']:.2f}; medians over rounds of each round's median). "
        f"Fastest single steps: grpo_jax {s['grpo_jax_fastest_step_s']:.3f} s, TRL "
        f"{s['trl_fastest_step_s']:.3f} s (ratio {s['ratio_of_fastest']:.2f}).",
        "",
    ]


def _quiet_lines(res: dict) -> list[str]:
    waits = ", ".join(
        f"{r['grpo_jax'].get('waited_s', 0):.0f} s / {r['trl'].get('waited_s', 0):.0f} s"
        for r in res["rounds"]
    )
    return [
        "The load average before a round includes the previous round's own processes (it "
        "decays over minutes); the last column is the share of the machine's CPU time that "
        "other processes used while each side ran (/proc/stat busy time less the side's own). "
        f"Before each side the driver waited (at most {res['wait_quiet_s']:g} s) for that "
        f"share to fall below {100 * res['quiet_share']:g} % over 3 s; waits: "
        + waits
        + " (grpo_jax / TRL, per round).",
        "",
    ]


def _machine_lines(res: dict) -> list[str]:
    s, h = res["summary"], res["host"]
    j, t = res["grpo_jax_env"], res["trl_env"]
    first = res["rounds"][0]
    return [
        "## Machine and versions",
        "",
        f"- host: {h['cpu']}, {h['cpu_count']} logical CPUs, "
        f"Python {h['python']}; load averages (1/5/15 min) at start "
        f"{', '.join(f'{x:.2f}' for x in res['load_start'])}, at end "
        f"{', '.join(f'{x:.2f}' for x in res['load_end'])}",
        f"- grpo_jax: jax {j['jax']}, jaxlib {j['jaxlib']}, flax {j['flax']}, optax {j['optax']}; "
        f"device {j['device']} x{j['num_devices']}; XLA's CPU thread pool over all "
        f"{h['cpu_count']} CPUs; compile {s['grpo_jax_compile_s']['median']:.1f} s "
        "(excluded from the step time)",
        f"- TRL: trl {t['trl']}, transformers {t['transformers']}, torch {t['torch']} "
        f"(Python {t['python']}); device {t['device']}; torch threads {t['threads']}; "
        f"{first['trl']['model']}, vocabulary {first['trl']['vocab_size']}, "
        f"{first['trl']['params']:,} parameters (grpo_jax: "
        f"{first['grpo_jax']['params']:,}); measured mean completion length "
        f"{first['trl']['mean_completion_length']:g} (asserted = horizon)",
        *git_lines(res),
        "",
    ]


def write_md(res: dict, path: pathlib.Path):
    lines = [
        *_headline(res),
        *_round_rows(res),
        "",
        *_quiet_lines(res),
        *_machine_lines(res),
        "## Commands",
        "",
        "```bash",
        res["command"],
        "# per round, from the repository root:",
        res["commands"]["grpo_jax"],
        res["commands"]["trl"],
        "```",
        "",
        "## What differs between the two sides",
        "",
        *[f"- {n}" for n in res["notes"]],
        "",
    ]
    if res.get("note"):
        lines += ["## Remarks", "", res["note"], ""]
    path.write_text("\n".join(lines))


NOTES = [
    "Timing: grpo_jax times its whole jitted step (prompt sampling on device, rollout, reward, "
    "reference and policy forwards, loss, AdamW update) with block_until_ready, compile "
    "excluded; TRL's is timed by a TrainerCallback from on_step_begin to on_step_end (CUDA "
    "synchronised): generation, reward, reference forward, loss, backward, clip, AdamW and "
    "scheduler step, TRL's per-step metrics included; the dataloader fetch before "
    "on_step_begin and the (disabled) logging after on_step_end are outside it "
    "(`median_loop_s`, end to end, is in the JSON).",
    "Sampling: grpo_jax samples inside one XLA program and encodes each prompt once, its G "
    "members attending to the shared prompt keys/values; TRL calls transformers' "
    "`generate` (eager PyTorch, a Python loop over 70 decode steps with a KV cache) on the "
    "prompt repeated G times, and its training and reference forwards run over all 64 x 170 "
    "tokens, prompt included.",
    "Vocabulary: grpo_jax has the corpus's 65 chars; TRL's GPT-2 has those plus one "
    "end-of-text token (also pad), which `min_new_tokens` masks at every generated position "
    "(so completions are exactly 70 chars) but which stays in the training softmax; the "
    "parameter counts differ by that one embedding row (128 parameters at width 128).",
    "Objective: both use the sequence mean of token means (TRL loss_type='grpo', grpo_jax's "
    "sequence-mean-token-mean), unscaled group-centred advantages (TRL scale_rewards='none', "
    "grpo_jax advantage_scale='none'), the PPO clip 0.2 (inactive at mu = 1) and the k3 KL with "
    "beta 0.04 to the initial weights; TRL adds its own bookkeeping (entropy, clip ratios, "
    "gathers) to every step.",
    "Optimizer: AdamW lr 3e-3, b2 0.99, global-norm clip 1.0 on both; schedules: grpo_jax "
    "linear warm-up 10 then cosine to 10 %, TRL cosine_with_min_lr (10 %) with 10 warm-up "
    "steps (the schedule does not change the cost).",
    "Prompts: grpo_jax draws uniform random windows of the train split inside the step; "
    "TRL's dataset holds batch_prompts x (warmup + steps) random train-split windows, "
    "drawn once on the host.",
    "Dropout: none on either side (GPT-2's default 0.1 is set to 0 and TRL's "
    "disable_dropout is on; trl_grpo.py stops if the policy has any); records before "
    "2026-11-29 ran TRL's policy with 0.1 in generation and training.",
    "Threads: torch runs with torch.get_num_threads() intra-op threads (the machine's "
    "cores by default); XLA's CPU client uses its own pool over the same cores. Each side "
    "runs alone (sequential subprocesses).",
]
