"""The report of an equal-compute run (experiments/exhaustive_vs_sampled.py --budget, run by
experiments/equal_compute.py), from its JSON alone (``render_budget``): the budget each mode
spent, the final metrics with their standard errors and each mode's difference to the sampled
mode tested for significance, and curves against training seconds and generated tokens.
``budget_summary`` computes those statistics from the per-seed finals, both for the run's
record and at every rendering (so a table always follows the code, not a stored summary).

The test of a difference. Seed i starts from the same initial parameters and rng seed in every
mode, and one evaluation scores every mode, so the modes' results are paired by seed and
may be correlated, positively or negatively (a one-off check of the committed runs found
both signs; no committed command computes it). Treating
them as independent, SE = sqrt(SE_a² + SE_ref²), over- or understates the noise depending on
the sign of that correlation. The paired test uses the per-seed differences d_i = a_i − ref_i:
SE_Δ = std(d, ddof=1) / √n and t = mean(d) / SE_Δ. With 3 seeds SE_Δ is itself estimated from 3
values, so t is compared with Student's t with n − 1 = 2 degrees of freedom, not with a normal:
"beyond 3 SE" would be p ≈ 0.0027 under a normal but p ≈ 0.095 under t(2), where p < 0.05 needs
|t| > 4.30. The report gives t, the two-sided p and a verdict at ``ALPHA`` = 0.05 per
comparison. Caveats a reader must keep: the t test assumes the seed differences are roughly
normal, which 3 seeds cannot check (and an exact sign-flip permutation test on 3 pairs can
never reach p < 0.05: its smallest p is 2/8 = 0.25); the p-values are not adjusted for the
several modes and metrics of a table (with k comparisons about 0.05·k false "yes" are expected
when no mode differs; Holm or Bonferroni would divide ALPHA by up to k); and a difference is
one over seeds of this setup, not over setups. Where a mode's seeds are not the reference's
(another set, a seed missing or repeated), the runs are not paired and Welch's unpaired t is
used instead (SE_Δ = sqrt(SE_a² + SE_ref²), Welch-Satterthwaite degrees of freedom); the
table's "test" column says which.
"""

import math
import statistics

import numpy as np
from comparison_report import closing_lines, command_lines, pct, same_window_references, spread
from ml_collections import config_dict
from scipy import stats  # a dependency of jax

from grpo_jax import plots

ALPHA = 0.05  # a difference counts as significant at two-sided p < ALPHA (per comparison)


def is_rate(key: str) -> bool:
    """Metrics shown in % (accuracies and pass@k); others as they are."""
    return "accuracy" in key or "pass_at" in key


def show(key, x, digits=1) -> str:
    return f"{100 * x:.{digits}f}" if is_rate(key) else f"{x:.4g}"


def t_test(diff: float, se: float, df, test: str) -> dict:
    """t = diff / se with its two-sided p under Student's t with ``df`` degrees of freedom;
    t and p are None where se is 0 or df is undefined (one seed, or identical differences)."""
    out = {"diff": diff, "se_diff": se, "df": df, "test": test, "t": None, "p": None}
    if se > 0 and df is not None and df > 0:
        out["t"] = diff / se
        out["p"] = float(2 * stats.t.sf(abs(out["t"]), df))
    return out


def paired_test(a: list[float], ref: list[float]) -> dict:
    """Paired t test of a − ref (a[i] and ref[i] from the same seed): SE_Δ = std(d, ddof=1)/√n
    of the differences d, n − 1 degrees of freedom."""
    d = [x - y for x, y in zip(a, ref, strict=True)]
    se = statistics.stdev(d) / math.sqrt(len(d)) if len(d) > 1 else 0.0
    return t_test(statistics.fmean(a) - statistics.fmean(ref), se, len(d) - 1, "paired")


def welch_test(a: list[float], ref: list[float]) -> dict:
    """Welch's unpaired t test of mean(a) − mean(ref): SE_Δ = sqrt(SE_a² + SE_ref²) and the
    Welch-Satterthwaite degrees of freedom (None with a single seed on either side)."""
    diff = statistics.fmean(a) - statistics.fmean(ref)
    if min(len(a), len(ref)) < 2:
        return t_test(diff, 0.0, None, "Welch")
    va, vr = (statistics.variance(v) / len(v) for v in (a, ref))
    df = (va + vr) ** 2 / (va**2 / (len(a) - 1) + vr**2 / (len(ref) - 1)) if va + vr else None
    return t_test(diff, math.sqrt(va + vr), df, "Welch")


def versus(recs, ref_recs, key: str) -> dict:
    """``key``'s final value in ``recs`` minus in ``ref_recs``, tested paired by seed where
    both hold the same seeds once each, else with Welch's unpaired test."""
    a = {r["seed"]: r["final"][key] for r in recs}
    ref = {r["seed"]: r["final"][key] for r in ref_recs}
    if a.keys() == ref.keys() and len(a) == len(recs) and len(ref) == len(ref_recs):
        return paired_test([a[s] for s in sorted(a)], [ref[s] for s in sorted(a)])
    return welch_test([r["final"][key] for r in recs], [r["final"][key] for r in ref_recs])


def budget_summary(runs, metrics, reference: str) -> dict:
    """Per mode and metric: mean, std (ddof=1), SE = std/√n, min, max of the final values
    over seeds, and the difference to ``reference``'s mean with its test (``versus``)."""
    out = {}
    for mode, recs in runs.items():
        out[mode] = {}
        for key in metrics:
            mean, std, lo, hi = spread([r["final"][key] for r in recs])
            se = std / len(recs) ** 0.5
            out[mode][key] = {"mean": mean, "std": std, "se": se, "min": lo, "max": hi}
            out[mode][key].update(versus(recs, runs[reference], key))
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


def p_text(p: float) -> str:
    return "<0.001" if p < 0.001 else f"{p:.3f}"


def versus_cells(key, m) -> str:
    """The Δ, t, test, p and 'p < ALPHA' cells of one mode's row."""
    test = m["test"] + ("" if m["df"] is None else f", df {m['df']:.3g}")
    if m["t"] is None:
        return f"| {show(key, m['diff'])} | – | {test} | – | – |"
    verdict = "yes" if m["p"] < ALPHA else "no"
    return f"| {show(key, m['diff'])} | {m['t']:+.1f} | {test} | {p_text(m['p'])} | {verdict} |"


def metric_table(raw, summary, key) -> list[str]:
    ref = raw["reference_mode"]
    init = spread([r["points"][0]["eval"][key] for r in next(iter(raw["runs"].values()))])
    lines = [
        f"### {key}{' (%)' if is_rate(key) else ''}, at the full budget",
        "",
        f"| mode | mean ± std | SE | [min–max] | Δ vs {ref} | t = Δ / SE_Δ | test | p "
        f"| p < {ALPHA:g} |",
        "|---|---|---|---|---|---|---|---|---|",
        f"| init | {show(key, init[0])} ± {show(key, init[1])} | – "
        f"| [{show(key, init[2])}–{show(key, init[3])}] | – | – | – | – | – |",
    ]
    for mode, m in summary.items():
        m = m[key]
        lines.append(
            f"| {mode} | {show(key, m['mean'])} ± {show(key, m['std'])} | {show(key, m['se'], 2)} "
            f"| [{show(key, m['min'])}–{show(key, m['max'])}] "
            + ("| – | – | – | – | – |" if mode == ref else versus_cells(key, m))
        )
    return lines + [""]


def stats_text(ref: str, n: int) -> str:
    """The paragraph under "Final metrics" saying how the table's statistics are computed."""
    needs = ""
    if n > 1:  # the two-sided critical value of t(n − 1)
        needs = f"; with n = {n} paired seeds p < {ALPHA:g} needs |t| > "
        needs += f"{stats.t.isf(ALPHA / 2, n - 1):.2f}"
    return (
        f"Mean ± std (sample std, ddof=1) over seeds; SE = std/√n. Seed i starts from the same "
        f"initial parameters in every mode, so Δ is tested paired by seed: d_i = value_i − "
        f"{ref}_i, SE_Δ = std(d)/√n, t = mean(d)/SE_Δ, p two-sided from Student's t with n − 1 "
        f"df (test: paired). A mode whose seeds differ from {ref}'s gets Welch's unpaired test "
        f"(SE_Δ = √(SE² + SE_{ref}²), Welch–Satterthwaite df; test: Welch). p is per "
        f"comparison, not adjusted for the table's several{needs}."
    )


def write_budget_markdown(raw, configs, pngs, note=""):
    """The <name>.md of an equal-compute run from its JSON dict, configs and PNG names; the
    statistics are recomputed from the per-seed finals (``budget_summary``)."""
    summary = budget_summary(raw["runs"], raw["metrics"], raw["reference_mode"])
    lines = budget_header(raw, configs) + ["## Budget spent", ""] + spent_table(raw)
    lines += ["", f"## Final metrics (n = {len(raw['seeds'])} seeds)", ""]
    lines += [stats_text(raw["reference_mode"], len(raw["seeds"])), ""]
    for key in raw["metrics"]:
        lines += metric_table(raw, summary, key)
    return "\n".join(lines + closing_lines(note, pngs)) + "\n"


def render_budget(raw, out_dir, basename) -> str:
    """Writes <basename>.md and its PNGs from an equal-compute run's JSON dict (as stored:
    the live run and --report_only render the same); returns the markdown."""
    configs = {m: config_dict.ConfigDict(c) for m, c in raw["configs"].items()}
    pngs = write_budget_plots(raw, out_dir, basename)
    md = write_budget_markdown(raw, configs, pngs, raw.get("note", ""))
    (out_dir / f"{basename}.md").write_text(md)
    return md
