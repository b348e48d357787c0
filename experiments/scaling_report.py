"""The markdown of a scaling.py record: the setup, a row per run beside the guide's claims
(``GUIDE``), and the notes. Everything it prints comes from the record (the device and jax
version as measured), so ``scaling.py --report_only`` renders the same table anywhere.
"""

from __future__ import annotations

GUIDE = {  # V -> (feasible?, memory GB, time/iteration) as the guide states them
    65: ("yes", "12", "6 s"),
    256: ("yes", "48", "24 s"),
    1000: ("marginal", "190", "95 s"),
    50000: ("no (one 80 GB GPU)", "≈9,500", "~1 h"),
}
GIB = 2**30


def fmt_bytes(b):
    return f"{b / GIB:.2f} GiB" if b >= GIB / 4 else f"{b / 2**20:.0f} MiB"


def reference_line(r: dict) -> str:
    """The setup's KL bullet from a run's record (runs before the option had none)."""
    if r.get("reference", "none") == "none":
        return (
            "- **No reference model** (`reference.kind=none`): the step has no KL term, so "
            "neither the KL over V at the decision point nor the reference's log-probs are "
            "computed here."
        )
    est = r.get("kl_estimator")
    how = (
        "the loss runs the reference inside its member chunks (exact KL over V at every "
        "generated position)"
        if est in ("exact", "exact_forward")
        else "the rollout carries log π_ref of each generated token, computed member chunk by "
        "member chunk beside the policy's (no [B, V, H, V] reference log-probs)"
    )
    return (
        f"- **KL reference: the frozen initial policy** (`reference.kind={r['reference']}`, "
        f"`grpo.kl_estimator={est}`, β = {r.get('beta', '?')}): {how}."
    )


def _setup_lines(raw: dict, any_r: dict) -> list[str]:
    setup = raw["setup"]
    return [
        "# Exhaustive GRPO scaling with the vocabulary size V",
        "",
        f"- Device: **{raw['device']}** (jax {raw['jax']}).",
        f"- Command: `{raw['command']}`",
        f"- Setup: one exhaustive GRPO train step (jitted once, state donated): B="
        f"{setup['batch_size']} prompts × V forced first tokens, each continued for "
        f"{setup['horizon'] - 1} sampled tokens (horizon {setup['horizon']}), context "
        f"{setup['context_len']}; model {any_r.get('model', '?')}; synthetic data (uniform "
        "random int32 tokens in [0, V)); reward `match`; "
        f"estimator `{any_r.get('exhaustive_estimator', '?')}`, train_continuations="
        f"{any_r.get('train_continuations', '?')}; "
        f"{any_r.get('num_iterations', 1)} optimizer update(s) per rollout (grpo.num_iterations); "
        f"{setup['warmup']} warm-up + {setup['steps']} "
        "timed steps, median reported.",
        reference_line(any_r),
        "- Memory on CPU: the step executable's `compiled.memory_analysis()` argument + "
        "output + temp − aliased (XLA's buffer plan for the step), and the process peak RSS "
        "(ru_maxrss, one process per run, includes JAX/XLA runtime and compilation); on GPU "
        "`memory_stats()['peak_bytes_in_use']`.",
        "- Chunks: `vocab_chunk` members are rolled out at a time, and `loss_chunk` members "
        "run the loss's training forward at a time (each chunk's gradient taken after its "
        "forward: nothing recomputed); "
        "0 = all at once. Both leave the result unchanged (tests/test_loss.py).",
        "- *compiled only*: the step was compiled and its buffer plan read, but it was not "
        "run (no time measured): whether its buffers fit, not how fast it is.",
        "",
    ]


def _row(v: int, r: dict | None) -> str:
    """One run's row (a guide-only row, or the run's error, where it has no measurement)."""
    g = GUIDE.get(v, ("–", "–", "–"))
    if r is None or "compile_s" not in r:
        why = r["error"] if r else "not run on this device"
        return f"| {v} | – | {g[0]} | {g[1]} | {g[2]} | {why} | – | – | – | – | – | – |"
    chunks = f"{r['vocab_chunk']} / {r.get('loss_chunk', 0) or r['vocab_chunk']}"
    if "median_step_s" in r:
        times = ", ".join(f"{t:.2f}" for t in r["step_times_s"])
        timing = f"{r['median_step_s']:.2f} ({times})"
        tps = f"{r['tokens_per_s']:,.0f}"
        rss = fmt_bytes(r["process_peak_rss_bytes"])
    else:  # the RSS of a process that only compiled says nothing about the step
        timing, tps, rss = "*compiled only, not run*", "–", "–"
    return (
        f"| {v} | {chunks} | {g[0]} | {g[1]} | {g[2]} | {timing} | "
        f"{fmt_bytes(r.get('executable_bytes', r['peak_memory_bytes']))} | "
        f"{rss} | {r['compile_s']:.1f} | {tps} | "
        + (f"{r['matmul_flops'] / 1e12:.2f} | " if "matmul_flops" in r else "– | ")
        + " → ".join(f"{x:.1f}" for x in r.get("loadavg_1m_before_after", []))
        + " |"
    )


def markdown(raw: dict) -> str:
    """The table's markdown from a run record (scaling.py's JSON)."""
    results = {tuple(int(x) for x in key.split(":")): r for key, r in raw["results"].items()}
    any_r = next((r for r in results.values() if "compile_s" in r), {})
    lines = _setup_lines(raw, any_r) + [
        "| V | chunks (rollout / loss) | guide: feasible | guide: memory (GB) "
        "| guide: time / iteration | measured: time / iteration (s, median) "
        "| measured: step executable memory | measured: process peak RSS | compile (s) "
        "| generated tokens/s | matmul TFLOP / iteration | load avg (1 min) before → after |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    measured_v = {k[0] for k in results}
    not_run = [(v, -1, -1) for v in GUIDE if v not in measured_v]  # guide rows only
    lines += [_row(key[0], results.get(key)) for key in sorted([*results, *not_run])]
    lines += [
        "",
        "The guide's figures are claims for an 80 GB GPU with an unstated model; nothing "
        "here is extrapolated to the runs that were not made. On a shared machine the times "
        "depend on the other jobs' load (the load-average column; "
        f"{raw['setup']['cpu_count']} CPU cores); the memory figures do not.",
    ]
    if raw.get("note"):
        lines += ["", raw["note"]]
    if any("memory_stats" in r.get("peak_memory_source", "") for r in results.values()):
        lines.append("Memory column: device peak_bytes_in_use.")
    return "\n".join(lines) + "\n"
