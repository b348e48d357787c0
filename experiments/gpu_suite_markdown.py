"""The GPU suite's markdown report (gpu_suite_report.write renders it from the suite's JSON
record): the run's facts, the targets, and one section per part."""

from __future__ import annotations

import math

from gpu_suite_parts import nominal_of
from gpu_suite_plan import SUITE_BUDGET_S
from xla_profile import matmul_busy


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


def wall_words(raw: dict) -> str:
    """The suite's wall time against its budget; a call that resumed a record (its wall-time
    target n/a: not one run) gives its own time only."""
    met = str(raw.get("targets", {}).get("suite wall time (s)", {}).get("met", ""))
    if raw["wall_s"] is not None and met.startswith("n/a (not one run"):
        return (
            f"This call's wall time {raw['wall_s']:.0f} s, not the suite's: it resumed a record "
            f"of earlier calls (budget {SUITE_BUDGET_S} s on one H100 for one run)"
        )
    assembled = "; – : a record assembled from several calls" if raw["wall_s"] is None else ""
    return (
        f"Total wall time {fmt(raw['wall_s'], '.0f')} s (budget {SUITE_BUDGET_S} s on one "
        f"H100{assembled})"
    )


def markdown(raw: dict) -> str:
    """The markdown report of a suite record (the JSON's dict)."""
    res = raw["results"]
    lines = overview(raw) + targets_table(raw["targets"])
    step = res.get("step")
    if step is not None:
        lines += step_section(step, raw["smoke"])
    if res.get("trl") is not None:
        lines += trl_section(res["trl"], step)
    if res.get("exhaustive") is not None:
        lines += exhaustive_section(res["exhaustive"])
    if res.get("large"):
        lines += ["", "## Larger model: where the framework stands when the GPU is busy"]
        for batch, large in res["large"].items():
            lines += large_section(large, batch)
    if res.get("attention"):
        # cudnn on a GPU; the smoke runs its path through XLA (the command names which)
        lines += ["", "## Larger model, `model.attention` as its command sets it (GPU: cudnn)"]
        for batch, large in res["attention"].items():
            lines += large_section(large, batch)
    if res.get("pallas"):
        flash = any("decode_kernel=flash" in r.get("command", "") for r in res["pallas"].values())
        kernel = "jax's flash-decoding kernel" if flash else "one Pallas kernel per layer"
        lines += ["", f"## Larger model, the decode steps' attention as {kernel}"]
        for batch, large in res["pallas"].items():
            lines += large_section(large, batch)
    for name, prof in (res.get("profile") or {}).items():
        lines += profile_section(prof, name)
    lines += ["", "## Commands", ""]
    lines += [f"- `{c}`" for c in raw["commands"]]
    if raw.get("child_env"):
        lines.append(f"- children's environment: {raw['child_env']}")
    return "\n".join(lines) + "\n"


def overview(raw: dict) -> list:
    """The title and the run's facts: device, dtypes, peaks, MFU, wall time."""
    info = raw["device"]
    return [
        f"# GPU suite: {info.get('device_kind', '?')}" + (" (smoke)" if raw["smoke"] else ""),
        "",
        f"- Device: **{info.get('device_kind', '?')}** ({info.get('platform', '?')}) × "
        f"{info.get('device_count', '?')}; jax {info.get('jax', '?')}, jaxlib "
        f"{info.get('jaxlib', '?')}; float32 matmuls: {info.get('float32_matmuls', '?')}.",
        f"- Dtypes: compute {', '.join(raw['dtypes'])} (params float32); the large model "
        f"and the exhaustive rows as stated below.",
        "- Peaks (FLOP/s): measured "
        + ", ".join(
            f"{d} " + (fmt(v.get("flops_per_s"), ".3e") if "error" not in v else v["error"])
            for d, v in raw["results"].get("peak", {}).items()
        )
        + "; nominal "
        + ", ".join(f"{d} {fmt(nominal_of(info, d), '.3e')}" for d in raw["dtypes"])
        + " (dense, by device_kind; – on a CPU).",
        "- MFU = matmul FLOPs executed (loops and the backward pass's recomputation included) "
        "/ time / peak, against the nominal and the measured peak.",
        f"- {wall_words(raw)}; "
        f"{raw['workers']} measurement(s) at a time, each in its own process; per part (its "
        "processes' wall times added): "
        + ", ".join(f"{k} {v:.0f} s" for k, v in raw["part_wall_s"].items())
        + ".",
        *lock_line(raw.get("device_lock")),
        *(
            []
            if raw["complete"]
            else ["- **Partial**: written after each measurement; this run had not finished."]
        ),
        "",
    ]


def lock_line(lock: dict | None) -> list:
    """How the side-by-side children shared the device (experiments/device_lock.py)."""
    if not lock:
        return []
    sh, tm = lock["shared"], lock["timed"]
    return [
        f"- Side by side: {lock['processes']} processes took the device lock; "
        f"{tm['sections']} timed sections held it alone for {tm['held_s']:.0f} s (waiting "
        f"{tm['waited_s']:.0f} s), {sh['sections']} compiles shared it for {sh['held_s']:.0f} s "
        f"(waiting {sh['waited_s']:.0f} s); longest overlap of a timed section with another "
        f"process's: {lock['timed_overlap_s']:.3f} s."
    ]


def targets_table(targets: dict) -> list:
    lines = [
        "## Targets",
        "",
        "| target | value | threshold | met |",
        "|---|---|---|---|",
    ]
    for name, t in targets.items():
        value = pct(t["value"]) if "MFU" in name else fmt(t["value"])
        met = {True: "**yes**", False: "no"}.get(t["met"], t["met"])
        lines.append(f"| {name} | {value} | {t['threshold']} | {met} |")
    return lines


def step_section(step: dict, smoke: bool) -> list:
    lines = [
        "",
        "## GRPO step (8 prompts × G = 8, context 100, horizon 70, μ = 1, β = 0.04, "
        "frozen-policy k3, reward match; 4×4×128 char GPT)"
        if not smoke
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
    return lines


def trl_section(trl: dict, step: dict | None) -> list:
    lines = [
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
    return lines


def exhaustive_section(exh: dict) -> list:
    any_r = next((r for r in exh.values() if "model" in r), {})
    lines = [
        "",
        f"## Exhaustive GRPO iterations (B = {any_r.get('batch_size', '?')}, context "
        f"{any_r.get('context_len', '?')}, horizon {any_r.get('horizon', '?')}, model "
        f"{any_r.get('model', '?').split()[0]} (params float32), μ = "
        f"{any_r.get('num_iterations', '?')}, KL reference "
        f"{any_r.get('reference', '?')} + {any_r.get('kl_estimator', '?')}, β = "
        f"{any_r.get('beta', '?')})",
        "",
        "| V | compute | chunks (rollout / loss) | guide: s / iteration | guide: memory "
        "| s / iteration | peak bytes | faster than guide | less memory than guide "
        "| TFLOP / iteration | MFU (nominal / measured) | compile s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for v, r in exh.items():
        if "error" in r:
            lines.append(f"| {v} | {r['error']} | | | | | | | | | | |")
            continue
        g, u = r["guide"], r["utilisation"]
        gt, gm = (
            ("infeasible", "–")
            if g == "infeasible"
            else (f"{g['s_per_iteration']:g}", f"{g['bytes'] / 1e9:g} GB")
        )
        lines.append(
            f"| {v} | {r['model'].split()[-1]} | "
            f"{r['vocab_chunk'] or 'all'} / {r['loss_chunk'] or 'same'} | {gt} | "
            f"{gm} | {r['median_step_s']:.3f} | {gib(r['peak_memory_bytes'])} | "
            f"{times(r.get('speedup_vs_guide'))} | {times(r.get('memory_vs_guide'))} | "
            f"{fmt(r.get('matmul_flops') and r['matmul_flops'] / 1e12)} | "
            f"{pct(u['mfu_nominal'])} / {pct(u['mfu_measured'])} | {r['compile_s']:.1f} |"
        )
    lines.append(f"(peak bytes: {any_r.get('peak_memory_source', '?')}.)")
    lines += [f"- V = {v}: {r['note']}" for v, r in exh.items() if r.get("note")]
    return lines


def large_section(large: dict, batch: str) -> list:
    """One of the large part's measurements (``batch``: its prompts per step)."""
    lines = ["", f"### {batch} prompts per step", ""]
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
        if fl := large.get("rollout_floor"):
            lines.append(floor_line(fl))
        for half in ("rollout", "update"):
            for e in large.get(f"{half}_matmul_uncounted", []):
                lines.append(
                    f"- Not in the {half}'s GFLOP and MFU (the counter cannot size it): "
                    f"`{e['primitive']}` at `{e['op']}`, {e['runs']} runs: {e['why']}."
                )
        if large.get("note"):
            lines.append(f"- {large['note']}")
    return lines


def floor_line(fl: dict) -> str:
    """The large part's rollout floor (gpu_suite_parts.rollout_floor). A record from before
    2026-11-29 holds the floor that took the rollout's phases as overlapping: it is shown as
    recorded, with where the corrected one is."""
    reads = (
        f"its decode loop reads at least {fl['decode_bytes'] / 1e9:.1f} GB (weights, prompt keys "
        f"and values, member cache per step) in {1e3 * fl['memory_s']:.1f} ms at "
        f"{fl['bandwidth_bytes_per_s'] / 1e12:.2f} TB/s"
    )
    if "floor_s" not in fl:
        return (
            f"- The rollout's floor on the nominal figures: {reads}, its matmuls take "
            f"{1e3 * fl['compute_s']:.1f} ms at the peak: measured {fl['times_floor']:.1f}× the "
            f"larger, an MFU ceiling of {pct(fl['mfu_ceiling'])} (as recorded: that floor took "
            "the rollout's phases as overlapping; rollout_floor_recount.md sums them)."
        )
    return (
        f"- The rollout's floor on the nominal figures: {reads}, and its matmuls take "
        f"{1e3 * fl['loop_compute_s']:.1f} ms at the peak; the prefill's and the reference's "
        f"matmuls, before and after the loop, {1e3 * fl['outside_loop_compute_s']:.1f} ms. "
        f"Floor {1e3 * fl['floor_s']:.1f} ms: measured {fl['times_floor']:.1f}× it, an MFU "
        f"ceiling of {pct(fl['mfu_ceiling'])}."
    )


def profile_section(prof: dict, name: str) -> list:
    """profile_step.py's summary of one workload (``name``: the plan's, e.g. step, large): busy
    time by stage and by kind of work, the matmul rates, the costliest source ops."""
    dtype = f", {prof['dtype']}" if "dtype" in prof else ""
    title = f"## Where the GRPO step's time goes ({name}{dtype}; experiments/profile_step.py)"
    lines = ["", title, ""]
    if "error" in prof:
        return lines + [f"failed: {prof['error']}"]
    total = prof["thunk_ms_per_step"]
    share = lambda d: ", ".join(f"{k} {100 * v / (total or math.nan):.0f} %" for k, v in d.items())
    lost = prof.get("unattributed") or {}
    lines += [
        f"Wall {prof['wall_ms_per_step']:.2f} ms / step; kernels / thunks {total:.2f} ms / step "
        f"attributed to an instruction, {lost.get('ms_per_step', 0.0):.2f} ms not "
        f"({', '.join(lost.get('names', [])) or 'none'}).",
        f"- by stage: {share(prof['by_stage']) or '– (nothing attributed)'}",
        f"- by kind: {share(prof['by_kind']) or '– (nothing attributed)'}",
    ]
    kinds = ", ".join(f"{k} {g:.3g}" for k, g in prof["matmul_gflop_per_step"].items())
    g, ms = matmul_busy(prof)  # GFLOP per ms is TFLOP/s
    rate = f"{g / ms:.3g} TFLOP/s busy" if ms > 0 else "– (no matmul kernel attributed)"
    lines.append(f"- matmuls: {g:.3g} GFLOP / step ({kinds}) in {ms:.1f} ms at {rate}")
    ops = prof.get("by_op", [])[:8]  # records from before it was kept have none
    lines += ["- costliest source ops (layers and loop segments summed):"] if ops else []
    lines += [f"  - `{r['op']}` ({r['kind']}, {r['stage']}): {r['thunk_ms']:.1f} ms" for r in ops]
    return lines
