"""The report of an equal-compute run (experiments/exhaustive_vs_sampled.py --budget, run by
experiments/equal_compute.py), from its JSON alone (``render_budget``): the budget each mode
spent, the final metrics with their standard errors and each mode's difference to the sampled
mode in standard errors of the difference, and curves against training seconds and generated
tokens. ``budget_summary`` computes those differences when the run's record is written.
"""

import statistics

import numpy as np
from comparison_report import closing_lines, command_lines, pct, same_window_references, spread
from ml_collections import config_dict

from grpo_jax import plots

SIGNIFICANT_SE = 3.0  # a difference counts as clear beyond 3 standard errors


def is_rate(key: str) -> bool:
    """Metrics shown in % (accuracies and pass@k); others as they are."""
    return "accuracy" in key or "pass_at" in key


def show(key, x, digits=1) -> str:
    return f"{100 * x:.{digits}f}" if is_rate(key) else f"{x:.4g}"


def versus(a, ref) -> dict:
    """a's mean minus ref's, in units of the difference's standard error sqrt(se_a² + se_ref²)
    (None where both have a zero SE, e.g. a single seed)."""
    diff = a["mean"] - ref["mean"]
    se = (a["se"] ** 2 + ref["se"] ** 2) ** 0.5
    return {"diff": diff, "z": diff / se if se > 0 else None}


def budget_summary(runs, metrics, reference: str) -> dict:
    """Per mode and metric: mean, std (ddof=1), SE = std/√n, min, max of the final values
    over seeds, and the difference to ``reference``'s mean in SE units."""
    out = {}
    for mode, recs in runs.items():
        out[mode] = {}
        for key in metrics:
            mean, std, lo, hi = spread([r["final"][key] for r in recs])
            se = std / len(recs) ** 0.5
            out[mode][key] = {"mean": mean, "std": std, "se": se, "min": lo, "max": hi}
    for mode in runs:
        for key in metrics:
            out[mode][key].update(versus(out[mode][key], out[reference][key]))
    return out


def budget_curve(recs, axis: str, key: str):
    """(x, mean, std) over seeds of ``key`` at the eval points, x = mean seconds or tokens."""
    x = np.array([[p[axis] for p in r["points"]] for r in recs], float).mean(0)
    vals = np.array([[p["eval"][key] for p in r["points"]] for r in recs], float)
    std = vals.std(0, ddof=1) if len(recs) > 1 else np.zeros(vals.shape[1])
    return x, vals.mean(0), std


AXES = {"seconds": "training seconds (vmapped set of seeds)", "tokens": "generated tokens / seed"}


def write_budget_plots(raw, out_dir, basename):
    """Per metric two PNGs, <basename>_<metric>_{seconds,tokens}.png: mean ± std band over
    seeds against training seconds and against generated tokens; returns the file names."""
    pngs = []
    for key in raw["metrics"]:
        for axis, xlabel in AXES.items():
            series = {
                f"{mode} (n={len(recs)})": budget_curve(recs, axis, key)
                for mode, recs in raw["runs"].items()
            }
            if key == "eval/next_char_accuracy":
                span = [0, max(s[0][-1] for s in series.values())]
                for name, val in same_window_references(raw["runs"]).items():
                    series[f"{name} ({pct(val)}%)"] = (span, [val, val])
            title = f"{key} (mean ± std, {len(raw['seeds'])} seeds)"
            fig = plots.learning_curves_figure(series, key, title)
            ax = fig.axes[0]
            ax.set_xlabel(xlabel)
            for line in ax.lines[len(raw["runs"]) :]:  # the n-gram references, after the modes
                line.set_linestyle(":")
            ax.legend(fontsize=8)
            name = f"{basename}_{key.split('/')[-1]}_{axis}.png"
            fig.savefig(out_dir / name, dpi=120)
            pngs.append(name)
    return pngs


def budget_header(raw, configs) -> list[str]:
    """The markdown's opening bullets: device, command, budget, setup."""
    c = next(iter(configs.values()))
    budget, n = raw["budget"], len(raw["seeds"])
    ref = c.get("reference", {}).get("kind", "policy" if c.grpo.beta > 0 else "none")
    kind = (
        f"every mode trains its {n} seeds, vmapped as one program, for the same "
        f"{budget['amount']:g} s (training only: compilation and evaluations excluded; the "
        "clock waits for each step); the lr schedule spans the steps a few timed steps predict"
        if budget["kind"] == "wall"
        else f"every seed of every mode generates {int(budget['amount']):,} tokens (the first "
        "step at which its count reaches the budget); the lr schedule spans exactly those steps"
    )
    return [
        f"# Equal compute: {' vs '.join(raw['modes'])} ({c.task}, {budget['text']})",
        "",
        f"- Device: **{raw['device']}** (jax {raw['jax']}). Seeds {raw['seeds']}.",
        *command_lines(raw),
        f"- Budget **{budget['text']}**: {kind}. Evaluated at fractions 0, 1/{budget['points']}, "
        f"…, 1 of the budget (the first step reaching each), the same for every mode.",
        "- Generated tokens: the task's count per step (`task.tokens_per_step`: B prompts × "
        "group members × tokens each generates, what a step costs); `generated_tokens` (the "
        "engine's metric) counts only the members that count, up to EOS.",
        f"- Setup: model {c.model.num_layers} layers × {c.model.num_heads} heads × "
        f"{c.model.d_model}, batch {c.train.batch_size}, lr {c.optim.learning_rate}, "
        f"β {c.grpo.beta}, μ {c.grpo.num_iterations}, reference {ref}, reward "
        f"`{c.reward.terms}`; init "
        + (f"`{c.init_from}` (every mode and seed)" if c.init_from else "random, per seed")
        + ".",
        "",
    ]


def spent_table(raw) -> list[str]:
    lines = [
        "| mode | tokens / step / seed | steps (lr schedule) | seconds | tokens / seed "
        "| generated_tokens / seed | compile (s) |",
        "|---|---|---|---|---|---|---|",
    ]
    for mode, info in raw["spent"].items():
        gen = statistics.fmean(r["points"][-1]["generated_tokens"] for r in raw["runs"][mode])
        lines.append(
            f"| {mode} | {info['tokens_per_step']:,} | {info['steps']} ({info['schedule_steps']}) "
            f"| {info['seconds']:.1f} | {info['tokens']:,} | {gen:,.0f} | {info['compile_s']:.1f} |"
        )
    return lines


def versus_cells(key, m) -> str:
    """The Δ, Δ / SE and 'beyond 3 SE' cells of one mode's row."""
    z = m["z"]
    if z is None:
        return f"| {show(key, m['diff'])} | – | – |"
    return f"| {show(key, m['diff'])} | {z:+.1f} | {'yes' if abs(z) > SIGNIFICANT_SE else 'no'} |"


def metric_table(raw, key) -> list[str]:
    s, ref = raw["summary"], raw["reference_mode"]
    init = spread([r["points"][0]["eval"][key] for r in next(iter(raw["runs"].values()))])
    lines = [
        f"### {key}{' (%)' if is_rate(key) else ''}, at the full budget",
        "",
        f"| mode | mean ± std | SE | [min–max] | Δ vs {ref} | Δ / SE "
        f"| beyond {SIGNIFICANT_SE:g} SE |",
        "|---|---|---|---|---|---|---|",
        f"| init | {show(key, init[0])} ± {show(key, init[1])} | – "
        f"| [{show(key, init[2])}–{show(key, init[3])}] | – | – | – |",
    ]
    for mode, m in s.items():
        m = m[key]
        lines.append(
            f"| {mode} | {show(key, m['mean'])} ± {show(key, m['std'])} | {show(key, m['se'], 2)} "
            f"| [{show(key, m['min'])}–{show(key, m['max'])}] "
            + ("| – | – | – |" if mode == ref else versus_cells(key, m))
        )
    return lines + [""]


def write_budget_markdown(raw, configs, pngs, note=""):
    """The <name>.md of an equal-compute run from its JSON dict, configs and PNG names."""
    lines = budget_header(raw, configs) + ["## Budget spent", ""] + spent_table(raw)
    lines += [
        "",
        f"## Final metrics (n = {len(raw['seeds'])} seeds)",
        "",
        "Mean ± std (sample std, ddof=1) over seeds; SE = std/√n; Δ / SE = (mean − "
        f"mean_{raw['reference_mode']}) / √(SE² + SE_{raw['reference_mode']}²).",
        "",
    ]
    for key in raw["metrics"]:
        lines += metric_table(raw, key)
    return "\n".join(lines + closing_lines(note, pngs)) + "\n"


def render_budget(raw, out_dir, basename) -> str:
    """Writes <basename>.md and its PNGs from an equal-compute run's JSON dict (as stored:
    the live run and --report_only render the same); returns the markdown."""
    configs = {m: config_dict.ConfigDict(c) for m, c in raw["configs"].items()}
    pngs = write_budget_plots(raw, out_dir, basename)
    md = write_budget_markdown(raw, configs, pngs, raw.get("note", ""))
    (out_dir / f"{basename}.md").write_text(md)
    return md
