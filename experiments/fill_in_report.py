"""fill_in.md, fill_in_curves.png: the report of experiments/fill_in.py.

Renders the runner's summary (the dict it writes to fill_in.json) and the ablation file
(fill_in_ablation.json) as markdown tables and the verdict; it runs nothing (the runner draws
the learning-curve figure). ``metric_keys`` names the held-out metrics both the runner and
the tables use.

The summary holds everything the report reads, the run's settings included (``setting``:
SETTING_FIELDS of the config it ran), so a record renders as it was measured whatever the
config says today.

Train metrics carry the trainer's (TRL's) names, ``reward`` and ``rewards/fill_accuracy/mean``.
Summaries and workdirs from before the engine refactor (the fill_in.json committed until
2026-11-29 among them) carry the old ``reward_mean`` and ``sample_fill_accuracy``, and
``eval/pass@k`` for ``eval/pass_at_k``: ``markdown`` renames the eval ones
(metric_writers.current_names, the same metrics) and keeps the train ones (``train_names``: the
old fill accuracy was defined otherwise), so an old summary still renders. The runner stores
train metrics as the workdir logged them, so the same holds for a summary of an old workdir.
"""

import numpy as np

from grpo_jax.metric_writers import current_names

REWARD, FILL_ACC = "reward", "rewards/fill_accuracy/mean"
TRAIN_STATS = (REWARD, FILL_ACC, "kl", "entropy")  # the train metrics the summary keeps
OLD_NAMES = {REWARD: "reward_mean", FILL_ACC: "sample_fill_accuracy"}  # before the refactor

EVAL_KEYS = (
    "eval/judge_reward",
    "eval/fill_accuracy",
    "eval/sampled_fill_accuracy",
    "eval/pass_at_1",
    "eval/pass_at_4",
)
WHY = """Why: a judge trained against the generator's own samples estimates
logit ≈ log p_data(fill) / π_ref(fill) + const, and the KL-regularised optimum of
E_π[r] − β KL(π‖π_ref) is π ∝ π_ref · exp(r/β). The policy and its KL are those of the
tempered generator softmax(z/T), so in the generator's own logits the optimum is
z = z_ref + (T/β)·r: T = β = 0.5 aims at the same greedy fill as T = β = 1
(π ∝ π_ref · exp(logit), the judge-corrected generator) while the group's samples fall on
the few plausible chars whose order decides that fill."""
READING = """* Reading: the judge carries the information (its exact optimum raises single-char
greedy accuracy by {gain}), and GRPO raises the train reward, the judge reward, sampled accuracy
and pass@k, but in a CPU-sized run {share} of that gain shows in its greedy fills (the final
policies' single-char greedy accuracy is {deltas} against the reference's). Greedy accuracy is
decided by near-ties of the top two chars; in the ablation's T = 1 runs (its T != 1 runs predate
the tempered KL reference) the change GRPO makes to the top-1 minus top-2 margin correlates
{corr} with the optimum's at {slope} of its size (`top2_margin` in the ablation file), so it
flips about as many right argmaxes away as wrong ones right. Supervised distillation of the exact
single-char optimum into the generator (not GRPO; rows `distill_*`) did no better on 2-3-char
spans."""


# the config fields the report names (setting_of), kept in the summary as the run had them
SETTING_FIELDS = (
    "data.window_len", "data.span_min", "data.span_max", "model.num_layers", "model.d_model",
    "pretrain.num_steps", "judge.num_steps", "judge.corruptions", "judge.reward", "group.size",
    "group.temperature", "train.batch_size", "train.num_steps", "optim.learning_rate",
    "grpo.beta", "grpo.advantage_scale", "grpo.num_iterations", "eval.num_windows",
)  # fmt: skip


def setting_of(cfg) -> dict:
    """SETTING_FIELDS of a config, by dotted name."""
    return {name: cfg[name.split(".")[0]][name.split(".")[1]] for name in SETTING_FIELDS}


def metric_keys(setting: dict, logged: dict):
    """EVAL_KEYS and the greedy accuracy per span length (eval/fill_accuracy/lenK) for the
    lengths the held-out spans have: those ``logged`` (one eval row) holds; the eval logs no
    lenK for a length its fixed spans lack."""
    spans = range(setting["data.span_min"], setting["data.span_max"] + 1)
    lens = (f"eval/fill_accuracy/len{k}" for k in spans)
    return (*EVAL_KEYS, *(k for k in lens if k in logged))


def logged_name(row, key) -> str:
    """The name a train metric has in a metrics.jsonl row or a summary entry: ``key``, or in
    one written before the engine refactor its old name (OLD_NAMES)."""
    return key if key in row else OLD_NAMES.get(key, key)


def train_value(row, key):
    return row[logged_name(row, key)]


def has_train_value(row, key) -> bool:
    return logged_name(row, key) in row


def fmt(x, nd=4):
    return f"{x:.{nd}f}"


def sd(x):
    """Sample std over seeds (ddof=1; 0 for one seed)."""
    return float(np.std(x, ddof=1)) if len(x) > 1 else 0.0


def table(head, rows):
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return lines + ["| " + " | ".join(r) + " |" for r in rows]


def short(key):
    return key.removeprefix("eval/")


def eval_table(evals, keys):
    rows = [[str(e["step"]), *(fmt(e[k]) for k in keys)] for e in evals]
    return table(["step", *map(short, keys)], rows)


def mean_std_table(runs, keys):
    """Eval metrics mean ± std over seeds at each eval step."""
    rows = []
    for i, e in enumerate(runs[0]["eval"]):
        vals = [np.array([r["eval"][i][k] for r in runs]) for k in keys]
        rows.append([str(e["step"]), *(f"{v.mean():.4f} ± {sd(v):.4f}" for v in vals)])
    return table(["step", *map(short, keys)], rows)


def train_names(runs) -> dict:
    """REWARD and FILL_ACC as the record names them: a run from before the engine refactor
    logged OLD_NAMES, and its FILL_ACC was defined otherwise (train_section), so its report
    keeps them."""
    row = runs[0]["train_windows"][0]
    return {k: logged_name(row, k) for k in OLD_NAMES}


def windows_table(runs, seeds):
    reward, fill_acc = train_names(runs).values()
    head = ["steps", *(f"{reward} s{s}" for s in seeds), f"{reward} (mean)"]
    head += [f"{fill_acc} (mean)", "kl (mean)"]
    rows = []
    for i, w in enumerate(runs[0]["train_windows"]):
        at = lambda k: [r["train_windows"][i][k] for r in runs]
        rs = at(reward)
        means = (np.mean(rs), np.mean(at(fill_acc)), np.mean(at("kl")))
        rows.append([w["steps"], *map(fmt, rs), *map(fmt, means)])
    return table(head, rows)


def ablation_section(ab):
    if ab is None:
        return []
    judges = [
        [k, j["corruptions"], str(j["steps"]), fmt(j["held_out_accuracy"])]
        + [fmt(j["optimum_greedy_1char"])]
        for k, j in ab["judges"].items()
    ]
    head = ["run", "judge", "change vs old defaults", "lr schedule", "Δ greedy"]
    head += ["Δ greedy len1", "Δ greedy len3", "Δ sampled", "Δ pass@1", "Δ judge reward"]
    head += ["train reward_mean first→last 10%", "1-char greedy"]
    rows = []
    for r in ab["runs"]:
        d = lambda k, nd=4: f"{r['d_' + k]:+.{nd}f}"
        reward = "-"
        if "reward_mean_first" in r:
            reward = f"{r['reward_mean_first']:.3f} → {r['reward_mean_last']:.3f}"
        cells = [d("fill_accuracy"), d("fill_accuracy/len1"), d("fill_accuracy/len3")]
        cells += [d("sampled_fill_accuracy"), d("pass@1"), d("judge_reward", 3)]
        cells += [reward, fmt(r["greedy_1char"])]
        rows.append([r["run"], r["judge"], r["change"], r["schedule"], *cells])
    jhead = ["judge", "corruptions", "steps", "held-out accuracy", "exact optimum, 1-char greedy"]
    return [
        "## Ablation (what was tried; separate runs, `fill_in_ablation.json`)",
        "",
        ab["note"],
        "",
        *table(jhead, judges),
        "",
        *table(head, rows),
        "",
    ]


def verdict(runs, seeds, opt, base, ab, keys):
    first = {k: np.array([r["eval"][0][k] for r in runs]) for k in keys}
    final = {k: np.array([r["eval"][-1][k] for r in runs]) for k in keys}
    md = []
    for k in keys:
        d = final[k] - first[k]
        md.append(
            f"* {short(k)}: {first[k].mean():.4f} → {final[k].mean():.4f} (Δ {d.mean():+.4f}, "
            f"per seed {', '.join(f'{x:+.4f}' for x in d)}; seed std of the final "
            f"{sd(final[k]):.4f})"
        )
    reward = train_names(runs)[REWARD]
    w0 = [r["train_windows"][0][reward] for r in runs]
    w1 = [r["train_windows"][-1][reward] for r in runs]
    pairs = ", ".join(f"{a:.3f}→{b:.3f}" for a, b in zip(w0, w1, strict=True))
    md.append(f"* train {reward}, first vs last window: per seed {pairs}")
    rises = {short(k): bool(np.all(final[k] > first[k])) for k in keys}
    gain = final["eval/fill_accuracy"] - first["eval/fill_accuracy"]
    word = "RISES" if rises["fill_accuracy"] else "does NOT rise"
    md.append(
        f"* Held-out greedy fill accuracy {word} in every seed (mean Δ {gain.mean():+.4f}, "
        f"{gain.mean() / max(sd(gain), 1e-9):.1f} seed-standard-deviations of the Δ). Rises "
        f"in every seed: {', '.join(k for k, v in rises.items() if v) or 'none'}; not: "
        f"{', '.join(k for k, v in rises.items() if not v) or 'none'}."
    )
    ref, pol = opt["reference"], opt["policies"]
    named = [f"s{s} {fmt(a)} ({a - ref:+.4f})" for s, a in zip(seeds, pol, strict=False)]
    if base is not None:
        named.append(f"old GRPO defaults {fmt(pol[-1])} ({pol[-1] - ref:+.4f})")
    fixed = ""
    if "fixed_point" in opt:  # records from before 2026-11-29 have the optimum only
        fixed = (
            f"; GRPO's fixed point (its advantages, centred on the group's mean with the "
            f"member's own reward in it, carry (1 − 1/G) of the reward's gradient: z_ref + "
            f"(1 − 1/G)(T/β)·r) {fmt(opt['fixed_point'])} ({opt['fixed_point'] - ref:+.4f})"
        )
    md.append(
        f"* Exact optimum of the same objective on {opt['num_windows']} held-out single-char "
        f"spans (z_ref + (T/β)·r over all V fills, `fill_in_eval.single_char_optimum`): reference "
        f"greedy {fmt(ref)}, optimum {fmt(opt['optimum'])} ({opt['optimum'] - ref:+.4f}){fixed}; "
        f"final policies {', '.join(named)}."
    )
    if ab is not None and not rises["fill_accuracy"]:  # why greedy accuracy lags
        md.append(reading(opt, len(seeds), ab))
    return md


def reading(opt, num_seeds, ab) -> str:
    """READING filled in from the record: the single-char optimum's gain, how much of it the
    seeds' final policies show, and the top-2 margin statistics of the ablation's GRPO runs at T = 1
    (its runs at T != 1 read the KL reference untempered; see its note)."""
    deltas = np.array(opt["policies"][:num_seeds]) - opt["reference"]  # then the baseline's
    share = "none" if deltas.max() <= 0 else "only part"
    at_t1 = {r["run"] for r in ab["runs"] if "T=" not in r["change"] and "distill" not in r["run"]}
    t2 = np.array([v for k, v in ab["top2_margin"]["runs"].items() if k in at_t1])
    return READING.format(
        gain=f"{opt['optimum'] - opt['reference']:+.4f}",
        share=share,
        deltas=f"{deltas.min():+.4f} to {deltas.max():+.4f}",
        corr=f"{t2[:, 0].min():.2f}-{t2[:, 0].max():.2f}",
        slope=f"{t2[:, 1].min():.2f}-{t2[:, 1].max():.2f}",
    )


def commands_section(summary) -> list[str]:
    """The title, the runner's command and every stage's, and the wall-clock per stage."""
    seeds, times, root = summary["seeds"], summary["wall_s"], summary["root"]
    baseline = summary["baseline"]["grpo"] if summary["baseline"] else None
    return [
        "# Single-step fill-in with a judge: GRPO against a frozen judge",
        "",
        f"Device: {summary['device']}; no accelerator. Produced by `experiments/fill_in.py` (root "
        f"`{root}`) with the committed defaults of `{summary['config_path']}`.",
        "",
        "## Commands",
        "",
        "```bash",
        "export GRPO_JAX_DATA=/work/shared/data/tinyshakespeare.txt",
        f"python experiments/fill_in.py --root={root} --seeds={','.join(map(str, seeds))}"
        + (" --baseline" if baseline else ""),
        "# which ran:",
        *summary["commands"].values(),
        "```",
        "",
        "Wall-clock per stage (s; the 2-core CPU was shared with another process): "
        + ", ".join(f"{k} {v}" for k, v in times.items())
        + f"; total {sum(times.values()) / 60:.1f} min.",
        "",
    ]


def setting_section(c: dict) -> list[str]:
    """What was trained (the run's SETTING_FIELDS), and why its T and β."""
    return [
        "## Setting",
        "",
        f"* Window {c['data.window_len']} chars, one masked span of {c['data.span_min']}-"
        f"{c['data.span_max']} chars; generator and judge are {c['model.num_layers']}x"
        f"{c['model.d_model']} bidirectional encoders.",
        f"* Supervised generator (`--mode=pretrain`, {c['pretrain.num_steps']} steps): the GRPO "
        "init, the frozen KL reference, and the source of the judge's `generator` negatives.",
        f"* Judge (`--mode=train_judge`, {c['judge.num_steps']} steps): real windows vs. windows "
        f"whose span is corrupted by one of `{c['judge.corruptions']}`.",
        f"* GRPO: reward = the frozen judge's window `{c['judge.reward']}` of the filled window "
        f"(nothing else; it never sees the original), G={c['group.size']} fills per window "
        f"sampled at T={c['group.temperature']}, {c['train.batch_size']} windows/step, "
        f"{c['train.num_steps']} steps, lr {c['optim.learning_rate']} (cosine over all num_steps x "
        f"mu updates), exact KL to the reference with beta={c['grpo.beta']}, advantages "
        f"`{c['grpo.advantage_scale']}`, mu={c['grpo.num_iterations']}.",
        "",
        WHY,
        "",
    ]


def judge_section(summary) -> list[str]:
    """The judge's and the supervised generator's final held-out figures."""
    judge_eval, gen_eval = summary["judge_final_eval"], summary["generator_final_eval"]
    judge_rows = [[short(k), fmt(v)] for k, v in judge_eval.items() if k.startswith("eval/")]
    return [
        "## Judge (held-out real-vs-corrupted, its own corruptions, fixed val windows)",
        "",
        *table(["metric", "value"], judge_rows),
        "",
        f"Supervised generator after {gen_eval['step']} steps (its last held-out eval while "
        f"pretraining, = step 0 below): greedy {fmt(gen_eval['eval/fill_accuracy'])}, sampled "
        f"{fmt(gen_eval['eval/sampled_fill_accuracy'])}.",
        "",
    ]


def heldout_section(runs, seeds, keys, c: dict) -> list[str]:
    """The GRPO runs' held-out metrics at each eval step: over seeds, then seed by seed."""
    lines = [
        f"## GRPO: held-out metrics (mean ± std over seeds {', '.join(map(str, seeds))})",
        "",
        "`fill_accuracy`: greedy fill = original char, share of masked chars (`/lenK`: spans "
        "of K chars); `sampled_fill_accuracy`: mean π(original char) at T = 1; `pass@k`: a "
        "whole span restored in k samples at T = 1 (exact); `judge_reward`: the judge's reward "
        f"of the greedy fills. Step 0 is the supervised generator. All on the same "
        f"{c['eval.num_windows']} held-out windows and spans.",
        "",
        *mean_std_table(runs, keys),
        "",
    ]
    for s, r in zip(seeds, runs, strict=True):
        lines += [f"Seed {s}:", "", *eval_table(r["eval"], keys), ""]
    return lines


def train_section(runs, seeds, window, c: dict) -> list[str]:
    """The train reward per window of steps, per seed and its mean."""
    reward, fill_acc = train_names(runs).values()
    over = f"(train `{fill_acc}` is over the T = {c['group.temperature']} samples"
    if fill_acc == FILL_ACC:
        over += ": per member the share of its span's chars equal to the original, averaged "
        over += "over members.)"
    else:
        over += (
            ", pooled over all sampled chars: this run predates the engine refactor, which "
            f"renamed `{reward}` to `{REWARD}` and averages each member's share in `{FILL_ACC}`.)"
        )
    return [
        f"## GRPO: train {reward} per {window}-step window",
        "",
        over,
        "",
        *windows_table(runs, seeds),
        "",
    ]


def baseline_section(baseline, keys) -> list[str]:
    """The run with the previous GRPO defaults, if there was one."""
    if not baseline:
        return []
    return [
        "## Baseline: the previous GRPO defaults, same judge (seed 0)",
        "",
        f"`{' '.join(baseline['flags'])}` (with the lr-schedule fix):",
        "",
        *eval_table(baseline["grpo"]["eval"], keys),
        "",
    ]


def markdown(summary, ab):
    """fill_in.md's lines: ``summary`` is fill_in.json's dict, ``ab`` the ablation file's (or
    None)."""
    summary = current_names(summary)
    c, seeds = summary["setting"], summary["seeds"]
    runs = [summary["grpo"][f"seed{s}"] for s in seeds]
    keys = metric_keys(c, runs[0]["eval"][0])
    baseline = summary["baseline"]
    base = baseline["grpo"] if baseline else None
    opt = summary["single_char_optimum"]
    return [
        *commands_section(summary),
        *setting_section(c),
        *judge_section(summary),
        *heldout_section(runs, seeds, keys, c),
        *train_section(runs, seeds, summary["window"], c),
        "## Verdict",
        "",
        *verdict(runs, seeds, opt, base, ab, keys),
        "",
        *baseline_section(baseline, keys),
        *ablation_section(ab),
        "![learning curves](fill_in_curves.png)",
        "",
    ]
