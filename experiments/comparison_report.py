"""The report of experiments/exhaustive_vs_sampled.py: summary, markdown table, plots.

``summarize`` reduces the per-seed run records to mean, std, min and max per mode;
``write_plots`` draws the learning curves (mean ± std band over seeds vs step, with the
n-gram reference points on next-char accuracy); ``write_markdown`` renders the table, the
guide's claims beside them and an optional Observations note. ``--report_only`` calls the
last two on the stored JSON alone, so nothing here trains or evaluates.

An equal-compute run (``--budget``) has its own report, experiments/equal_compute_report.py,
which shares the figures' formatting, the n-gram references and the closing sections here.
"""

import json
import statistics

import numpy as np

from grpo_jax import candidates, groups, plots
from grpo_jax.specs import GroupSpec

EVAL_METRICS = ("eval/rollout_accuracy", "eval/next_char_accuracy")
# next-char accuracy of the n-gram models on the whole val split (the figures)
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


SEEDS_PARALLEL = (
    "ran **in parallel**: one program per mode, the train step vmapped over the "
    "seeds (`--vmap_seeds`, `sharding.make_multi_seed_step`); the wall time per run "
    "is the set's divided by the seeds, the step time one step of the whole set."
)
SEEDS_SEQUENTIAL = (
    "ran **sequentially** through `trainer.train_and_evaluate`, one workdir per "
    "run (`--vmap_seeds` runs them as one vmapped program instead)."
)
MEASURES = (
    "Wall time / run includes compilation and the evaluations; step time is the trainer's "
    "`step_time_s` (no eval; the first logged interval, which holds the compilation, is "
    "left out). Held-out first-char entropy: the final policy's entropy at "
    "temperature 1 over the first generated char of the eval windows (the same measure "
    "for every mode); train entropy: the last logged `entropy` (per-token mean over the "
    "training rollouts, decision point exact over V in forced modes; guided groups "
    "average over the candidate slots that count, see loss.py)."
)
GUIDE_CAVEAT = (
    "The guide gives no metric, model size, step count, hardware or seed count for its "
    "figures (5.2% / 35.7% / 42.3% after 2 h / 8 h / 4 h), so they are claims, not "
    "targets; the runs above are CPU-sized (a small model, a few optimizer steps) and "
    "are not a reproduction of hours-long runs."
)


def command_lines(raw) -> list[str]:
    """The command and its config overrides, as bullets (either kind of report)."""
    return [
        f"- Command: `{raw['command']}`",
        f"- Config overrides (all modes): `{json.dumps(raw['overrides'])}`",
    ]


def closing_lines(note, pngs) -> list[str]:
    """The optional Observations section, then the learning curves (either kind of report)."""
    observations = ["## Observations", "", note, ""] if note else []
    return [*observations, "## Learning curves", "", *(f"![{p}]({p})" for p in pngs)]


def setup_bullet(c) -> str:
    """What one run is: steps, batch, model, optimizer, KL, reward and eval, from a config."""
    return (
        f"- Steps per run: {c.train.num_steps} GRPO steps, each "
        f"{c.grpo.num_iterations} optimizer update(s) (grpo.num_iterations) on one "
        f"batch of rollouts, batch {c.train.batch_size} prompts, context "
        f"{c.data.context_len}, horizon {c.data.horizon}; model "
        f"{c.model.num_layers} layers × {c.model.num_heads} heads × "
        f"{c.model.d_model}; lr {c.optim.learning_rate}, β {c.grpo.beta}, "
        f"reference {c.reference.kind} (n={c.reference.ngram_order}, KL "
        f"`{c.grpo.kl_estimator}`), reward "
        f"`{c.reward.terms}`, exhaustive estimator `{c.grpo.exhaustive_estimator}`; "
        f"eval on {c.eval.num_windows} held-out val windows every "
        f"{c.train.eval_every} steps."
    )


def header_lines(raw, configs) -> list[str]:
    """The title and the opening bullets: device, how the seeds ran, command, setup, init."""
    c = next(iter(configs.values()))
    seeds_ran = SEEDS_PARALLEL if raw.get("seeds_parallel") else SEEDS_SEQUENTIAL
    return [
        "# Exhaustive vs sampled vs guided GRPO (held-out, char-level tiny Shakespeare)",
        "",
        f"- Device: **{raw['device']}** (jax {raw['jax']}). Seeds {raw['seeds']} " + seeds_ran,
        *command_lines(raw),
        setup_bullet(c),
        f"- Init: {'`' + c.init_from + '`' if c.init_from else 'random, from the seed'}"
        " — the same initial params for every mode at a given seed.",
        "- Members per prompt: "
        + ", ".join(f"{m} {members_per_prompt(mc, 65):g}" for m, mc in configs.items())
        + " (for V=65).",
        f"- Figures: mean ± std (sample std, ddof=1) over {len(raw['seeds'])} seeds, [min–max] "
        "in brackets; accuracies in %.",
    ]


def results_table(s) -> list[str]:
    """The main table: the initial policy, then each mode's final figures over seeds."""
    init = next(iter(s.values()))["init"]
    lines = [
        "| mode | eval/rollout_accuracy % | eval/next_char_accuracy % | wall time / run (s) "
        "| step time (s, median) | eval/best_char per seed (share of windows) "
        "| held-out first-char entropy (nats) | final train entropy (nats/token) |",
        "|---|---|---|---|---|---|---|---|",
        f"| init (step 0) | {fmt_pct(init['eval/rollout_accuracy'])} | "
        f"{fmt_pct(init['eval/next_char_accuracy'])} | – | – | – | – | – |",
    ]
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
    return lines


def references_line(runs, s) -> str:
    """The n-gram reference points, and where each mode's next-char accuracy sits among them
    (against the runs' own eval windows where the records hold those figures)."""
    same = same_window_references(runs)
    refs = same or REFERENCE_POINTS
    where = "these eval windows" if same else "the whole val split"
    whole = ", ".join(f"{name} {pct(v)}%" for name, v in REFERENCE_POINTS.items())
    windows = ", ".join(f"{name} {pct(v)}%" for name, v in same.items())
    here = "; ".join(
        f"{mode} {pct(m['eval/next_char_accuracy'][0])}% ({versus_references(m, refs)})"
        for mode, m in s.items()
    )
    return (
        f"Reference points (next-char accuracy): on the whole val split {whole}"
        + (f"; on these eval windows {windows}" if same else "")
        + f". Here (mean over seeds, against {where}): {here}."
    )


def guide_section(s) -> list[str]:
    """The guide's claimed accuracy and time per mode beside this run's."""
    lines = [
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
    return lines + ["", GUIDE_CAVEAT, ""]


def write_markdown(raw, configs, pngs, note=""):
    """The <name>.md text from the run JSON's dict, the per-mode configs and the PNG names."""
    s = raw["summary"]
    lines = [
        *header_lines(raw, configs),
        "",
        *results_table(s),
        "",
        references_line(raw["runs"], s),
        "",
        MEASURES,
        "",
        *guide_section(s),
        *closing_lines(note, pngs),
    ]
    return "\n".join(lines) + "\n"
