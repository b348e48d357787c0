"""The report of experiments/exhaustive_vs_sampled.py: summary, markdown table, plots.

``summarize`` reduces the per-seed run records to mean, std, min and max per mode;
``write_plots`` draws the learning curves (mean ± std band over seeds vs step, with the
n-gram reference points on next-char accuracy); ``write_markdown`` renders the table, the
guide's claims beside them and an optional Observations note. ``--report_only`` calls the
last two on the stored JSON alone, so nothing here trains or evaluates.

An equal-compute run (``--budget``, experiments/equal_compute.py) has its own report, from its
JSON alone too (``render_budget``): the budget each mode spent, the final metrics with their
standard errors and each mode's difference to the sampled mode in standard errors of the
difference, and curves against training seconds and generated tokens.
"""

import json
import statistics

import jax
import numpy as np
from ml_collections import config_dict

from grpo_jax import candidates, groups, plots
from grpo_jax.specs import GroupSpec

EVAL_METRICS = ("eval/rollout_accuracy", "eval/next_char_accuracy")
# next-char accuracy of the n-gram models on the whole val split (the issue's figures)
REFERENCE_POINTS = {"unigram": 0.149, "bigram": 0.270, "trigram": 0.381}
NGRAM_NAMES = {1: "unigram", 2: "bigram", 3: "trigram"}
GUIDE_CLAIMS = {  # the guide's "Final Accuracy" (metric unspecified) and training time
    "sampled": ("5.2%", "2 hours", "Space (degenerate)"),
    "exhaustive": ("35.7%", "8 hours", "Context-dependent"),
    "guided": ("42.3%", "4 hours", "Context-dependent"),
}


def spread(values):
    """(mean, std (ddof=1; 0 for one seed), min, max)."""
    v = [float(x) for x in values]
    std = statistics.stdev(v) if len(v) > 1 else 0.0
    return statistics.fmean(v), std, min(v), max(v)


def pct(x):
    return f"{100 * x:.1f}"


def fmt_pct(s):
    mean, std, lo, hi = s
    return f"{pct(mean)} ± {pct(std)} [{pct(lo)}–{pct(hi)}]"


def fmt(s, digits=2):
    mean, std, lo, hi = s
    return f"{mean:.{digits}f} ± {std:.{digits}f} [{lo:.{digits}f}–{hi:.{digits}f}]"


def summarize(runs):
    out = {}
    for mode, recs in runs.items():
        s = {k: spread([r["final"][k] for r in recs]) for k in EVAL_METRICS}
        s["init"] = {k: spread([r["init"][k] for r in recs]) for k in EVAL_METRICS}
        s["wall_s"] = spread([r["wall_s"] for r in recs])
        s["median_step_time_s"] = spread([r["median_step_time_s"] or 0.0 for r in recs])
        s["heldout_first_char_entropy"] = spread([r["heldout_first_char_entropy"] for r in recs])
        s["train_entropy"] = spread([r["train_entropy"] for r in recs])
        s["best_char"] = [r["best_char"] for r in recs]
        s["best_char_frac"] = [r["best_char_frac"] for r in recs]
        out[mode] = s
    return out


def same_window_references(runs):
    """The n-gram models' next-char accuracy on the runs' own eval windows (the trainer logs
    eval/ngram{n}_next_char_accuracy; every run shares the windows), or {} for runs that
    predate those metrics."""
    final = next(iter(runs.values()))[0]["final"]
    keys = {name: f"eval/ngram{n}_next_char_accuracy" for n, name in NGRAM_NAMES.items()}
    return {name: final[k] for name, k in keys.items() if k in final}


def write_plots(runs, out_dir, device, basename):
    """One PNG per EVAL_METRICS key, <basename>_<metric>.png in out_dir; returns the file names."""
    pngs = []
    for key in EVAL_METRICS:
        series = {}
        for mode, recs in runs.items():
            steps = recs[0]["curves"][key][0]
            vals = np.array([r["curves"][key][1] for r in recs])  # [seeds, points]
            std = vals.std(0, ddof=1) if len(recs) > 1 else np.zeros(vals.shape[1])
            series[f"{mode} (n={len(recs)})"] = (steps, vals.mean(0), std)
        if key == "eval/next_char_accuracy":
            steps = next(iter(series.values()))[0]
            refs = same_window_references(runs) or REFERENCE_POINTS
            for name, val in refs.items():
                series[f"{name} ({pct(val)}%)"] = (steps, [val] * len(steps))
        name = f"{basename}_{key.split('/')[-1]}.png"
        plots.learning_curves(
            series,
            out_dir / name,
            key,
            title=f"{key}: mean ± std over seeds ({device.split(' ')[0]})",
        )
        pngs.append(name)
    return pngs


def versus_references(m, refs):
    """Where a mode's mean next-char accuracy sits among the n-gram reference points."""
    acc = m["eval/next_char_accuracy"][0]
    above = [n for n, v in refs.items() if acc > v]
    below = [n for n, v in refs.items() if acc <= v]
    if not above:
        return "below the unigram"
    if not below:
        return "above the trigram"
    return f"above the {above[-1]}, below the {below[0]}"


def members_per_prompt(config, vocab_size: int) -> float:
    """Rollouts per prompt of a mode's config (a stored one too: the JSON's group block)."""
    spec = GroupSpec.from_config(config.group)
    classes = None
    if spec.mode == "hierarchical":  # its size needs the classes; id blocks need no texts
        if spec.class_kind != "blocks":
            return float("nan")
        classes = candidates.token_classes("blocks", [""] * vocab_size, spec.num_classes)
    return groups.members_per_prompt(spec, vocab_size, config.train.batch_size, classes)


def write_markdown(raw, configs, pngs, note=""):
    """The <name>.md text from the run JSON's dict, the per-mode configs and the PNG names."""
    s = raw["summary"]
    any_cfg = next(iter(configs.values()))
    n_seeds = len(raw["seeds"])
    lines = [
        "# Exhaustive vs sampled vs guided GRPO (held-out, char-level tiny Shakespeare)",
        "",
        f"- Device: **{raw['device']}** (jax {jax.__version__}). Seeds {raw['seeds']} "
        + (
            "ran **in parallel**: one program per mode, the train step vmapped over the "
            "seeds (`--vmap_seeds`, `sharding.make_multi_seed_step`); the wall time per run "
            "is the set's divided by the seeds, the step time one step of the whole set."
            if raw.get("seeds_parallel")
            else "ran **sequentially** through `trainer.train_and_evaluate`, one workdir per "
            "run (`--vmap_seeds` runs them as one vmapped program instead)."
        ),
        f"- Command: `{raw['command']}`",
        f"- Config overrides (all modes): `{json.dumps(raw['overrides'])}`",
        f"- Steps per run: {any_cfg.train.num_steps} GRPO steps, each "
        f"{any_cfg.grpo.num_iterations} optimizer update(s) (grpo.num_iterations) on one "
        f"batch of rollouts, batch {any_cfg.train.batch_size} prompts, context "
        f"{any_cfg.data.context_len}, horizon {any_cfg.data.horizon}; model "
        f"{any_cfg.model.num_layers} layers × {any_cfg.model.num_heads} heads × "
        f"{any_cfg.model.d_model}; lr {any_cfg.optim.learning_rate}, β {any_cfg.grpo.beta}, "
        f"reference {any_cfg.reference.kind} (n={any_cfg.reference.ngram_order}, KL "
        f"`{any_cfg.grpo.kl_estimator}`), reward "
        f"`{any_cfg.reward.terms}`, exhaustive estimator `{any_cfg.grpo.exhaustive_estimator}`; "
        f"eval on {any_cfg.eval.num_windows} held-out val windows every "
        f"{any_cfg.train.eval_every} steps.",
        f"- Init: {'`' + any_cfg.init_from + '`' if any_cfg.init_from else 'random, from the seed'}"
        " — the same initial params for every mode at a given seed.",
        "- Members per prompt: "
        + ", ".join(f"{m} {members_per_prompt(c, 65):g}" for m, c in configs.items())
        + " (for V=65).",
        f"- Figures: mean ± std (sample std, ddof=1) over {n_seeds} seeds, [min–max] in "
        "brackets; accuracies in %.",
        "",
        "| mode | eval/rollout_accuracy % | eval/next_char_accuracy % | wall time / run (s) "
        "| step time (s, median) | eval/best_char per seed (share of windows) "
        "| held-out first-char entropy (nats) | final train entropy (nats/token) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    init = next(iter(s.values()))["init"]
    lines.append(
        f"| init (step 0) | {fmt_pct(init['eval/rollout_accuracy'])} | "
        f"{fmt_pct(init['eval/next_char_accuracy'])} | – | – | – | – | – |"
    )
    for mode, m in s.items():
        chars = ", ".join(
            f"{c!r} ({f:.0%})" for c, f in zip(m["best_char"], m["best_char_frac"], strict=True)
        )
        lines.append(
            f"| {mode} | {fmt_pct(m['eval/rollout_accuracy'])} | "
            f"{fmt_pct(m['eval/next_char_accuracy'])} | {fmt(m['wall_s'], 0)} | "
            f"{fmt(m['median_step_time_s'], 3)} | {chars} | "
            f"{fmt(m['heldout_first_char_entropy'])} | {fmt(m['train_entropy'])} |"
        )
    same = same_window_references(raw["runs"])
    refs = same or REFERENCE_POINTS
    where = "these eval windows" if same else "the whole val split"
    lines += [
        "",
        "Reference points (next-char accuracy): on the whole val split "
        + ", ".join(f"{name} {pct(v)}%" for name, v in REFERENCE_POINTS.items())
        + (
            "; on these eval windows " + ", ".join(f"{n} {pct(v)}%" for n, v in same.items())
            if same
            else ""
        )
        + f". Here (mean over seeds, against {where}): "
        + "; ".join(
            f"{mode} {pct(m['eval/next_char_accuracy'][0])}% ({versus_references(m, refs)})"
            for mode, m in s.items()
        )
        + ".",
        "",
        "Wall time / run includes compilation and the evaluations; step time is the trainer's "
        "`step_time_s` (no eval; the first logged interval, which holds the compilation, is "
        "left out). Held-out first-char entropy: the final policy's entropy at "
        "temperature 1 over the first generated char of the eval windows (the same measure "
        "for every mode); train entropy: the last logged `entropy` (per-token mean over the "
        "training rollouts, decision point exact over V in forced modes; guided groups "
        "average over the candidate slots that count, see loss.py).",
        "",
        "## The guide's claims, for comparison",
        "",
        "| mode | guide: final accuracy | guide: training time | guide: best char "
        "| here: rollout / next-char accuracy % | here: wall time / run |",
        "|---|---|---|---|---|---|",
    ]
    for mode, m in s.items():
        claim = GUIDE_CLAIMS.get(mode, ("–", "–", "–"))
        lines.append(
            f"| {mode} | {claim[0]} | {claim[1]} | {claim[2]} | "
            f"{pct(m['eval/rollout_accuracy'][0])} / {pct(m['eval/next_char_accuracy'][0])} | "
            f"{m['wall_s'][0]:.0f} s |"
        )
    lines += [
        "",
        "The guide gives no metric, model size, step count, hardware or seed count for its "
        "figures (5.2% / 35.7% / 42.3% after 2 h / 8 h / 4 h), so they are claims, not "
        "targets; the runs above are CPU-sized (a small model, a few optimizer steps) and "
        "are not a reproduction of hours-long runs.",
        "",
        *(["## Observations", "", note, ""] if note else []),
        "## Learning curves",
        "",
    ]
    lines += [f"![{p}]({p})" for p in pngs]
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------ equal compute (--budget)

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
        f"- Device: **{raw['device']}** (jax {jax.__version__}). Seeds {raw['seeds']}.",
        f"- Command: `{raw['command']}`",
        f"- Config overrides (all modes): `{json.dumps(raw['overrides'])}`",
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
    lines += [*(["## Observations", "", note, ""] if note else []), "## Learning curves", ""]
    lines += [f"![{p}]({p})" for p in pngs]
    return "\n".join(lines) + "\n"


def render_budget(raw, out_dir, basename) -> str:
    """Writes <basename>.md and its PNGs from an equal-compute run's JSON dict (as stored:
    the live run and --report_only render the same); returns the markdown."""
    configs = {m: config_dict.ConfigDict(c) for m, c in raw["configs"].items()}
    pngs = write_budget_plots(raw, out_dir, basename)
    md = write_budget_markdown(raw, configs, pngs, raw.get("note", ""))
    (out_dir / f"{basename}.md").write_text(md)
    return md
