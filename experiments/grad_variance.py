"""Gradient variance per unit of compute: how good each group mode's policy gradient is per second.

On FIXED params (the seed's init or ``--init_from``) and a FIXED batch of prompts (``--data_seed``)
each ``--modes`` entry computes R gradients that differ only in the rollout key, through the
library's task, Step and loss (``build_task``, ``task.build``, ``Step.rollout``/``Step.score``
and the loss the engine builds with loss.make_loss): ∇θ of the engine's loss at its first update
(ratio 1, so the clipped surrogate's gradient is the policy gradient; forced modes use their
all-action estimator). β = 0 unless --config.grpo.beta is given. An entry may carry settings,
``mode:key=value[:key=value]`` (``sampled:group.size=16``, a guide for a config without one);
any group.mode the config accepts works. Estimators and formulas: METHOD (the report's header).

  GRPO_JAX_DATA=/work/shared/data/tinyshakespeare.txt python experiments/grad_variance.py \
      --config=configs/shakespeare.py --label=shakespeare --config.model.num_layers=2 \
      --config.model.d_model=64 --config.model.num_heads=2 --config.train.batch_size=4
  python experiments/grad_variance.py --smoke --config=shakespeare:tiny --out_dir=/tmp/gv

A run writes its section (``--label``) into <out_dir>/<name>.json and renders <name>.md from all
sections there (``--report_only --note=...`` re-renders). A mode's repeats run in ``--calls``
jitted lax.map calls over keys (one gradient after another, as in training), the first (with
compilation) untimed; a Python reward's host part is timed between its two jitted programs.
"""

import hashlib
import json
import math
import os
import shlex
import statistics
import sys
import time
from pathlib import Path

import jax
import numpy as np
from absl import app, flags
from jax.flatten_util import ravel_pytree
from ml_collections import config_flags

from grpo_jax import config_blocks, trainer
from grpo_jax.tasks import build_task

FLAGS = flags.FLAGS
config_flags.DEFINE_config_file("config", "configs/shakespeare.py", "Config (path[:sizes]).")
flags.DEFINE_list("modes", ["sampled", "exhaustive", "guided"], "mode[:key=value...] entries.")
flags.DEFINE_integer("repeats", 40, "R: gradients per mode.", lower_bound=2)
flags.DEFINE_integer("calls", 5, "Program calls per mode (the first untimed).", lower_bound=3)
flags.DEFINE_integer("true_group_size", 64, "G of the sampled groups of the true gradient.")
flags.DEFINE_integer("true_repeats", 64, "Gradients averaged into the true gradient.")
flags.DEFINE_enum(
    "true_advantage_scale",
    "",
    ["", "none", "group", "batch"],
    "grpo.advantage_scale of the true gradient's groups ('' = the objective's; none: no std "
    "scaling, so t̂ has the policy gradient's direction up to O(1/G)).",
)
flags.DEFINE_integer("data_seed", 0, "Key of the fixed batch of prompts.")
flags.DEFINE_integer("rollout_seed", 1, "Root key of the rollouts (fold_in per mode).")
flags.DEFINE_string("init_from", "", "Checkpoint dir of the params (else config.seed's init).")
flags.DEFINE_bool("smoke", False, "The config's tiny variant and a few repeats (< 60 s on CPU).")
flags.DEFINE_string("label", "", "Section of the outputs (default: config.task).")
flags.DEFINE_string("out_dir", "experiments/results", "Where <name>.md and .json go.")
flags.DEFINE_string("name", "grad_variance", "Basename of the outputs.")
flags.DEFINE_string("note", "", "Observations for the report (kept when not given).")
flags.DEFINE_bool("report_only", False, "Only re-render <name>.md from <name>.json.")
TARGET = 0.9
RHO_PER_REPEAT_MAX = 10  # beyond ρ/R = 10 the ceiling is not estimated (ceiling_fit)
METHOD = """\
**True gradient t̂**: the mean of many sampled-group gradients with a large G on the same prompts
and params (GRPO's own estimator, with the objective's settings unless `--true_advantage_scale`
is given). Without std scaling (advantage_scale none) its expectation has the direction of the
policy gradient up to the O(1/G) effect of the group baseline. With std scaling (advantage_scale
group) it does not: as G grows each prompt's advantages are divided by that prompt's reward std
σ_p, so t̂ tends to Σ_p ∇J_p / σ_p, which weights the prompts by 1/σ_p. The arithmetic sections
use std scaling; `--true_advantage_scale=none` builds t̂ without it, to measure how much the
weighting moves the ceilings. Its precision: the split-half cosine s (one half's mean vs the
other's) gives cos(t̂, t) ≈ sqrt(2s / (1 + s)), t the expectation of t̂.

**Per mode**, g_1..g_R its repeats, ḡ their mean: c_1 = mean_i cos(g_i, t̂) ± standard error;
cos(ḡ, t̂); the mean cosine between repeats; ρ = tr Cov(g) / ‖E g‖² (each unbiased: Σ‖g_i − ḡ‖²
/ (R−1) and ‖ḡ‖² − tr Cov / R; ∞ when the noise hides the mean). Model: n averaged gradients
have cos(ḡ_n, t) = c_∞ / sqrt(1 + ρ/n), c_∞ = cos(E g, t) the mode's *ceiling* (its bias:
what averaging can reach); at n = 1, c_∞ = c_1·sqrt(1 + ρ) ± se·sqrt(1 + ρ) (c_1's standard
error carried through; ρ's own error is left out, so this understates it). A value above 1 by
at most that error is shown as 1; further above 1, or where ρ/R > 10 (‖ḡ_R‖² is then over 90 %
noise and ρ the ratio to a small difference), the model does not fit: the ceiling, n and s to
0.9 are "–", with the reason under the table. **n to 0.9** = ρ / ((c_∞/0.9)² − 1)
(∞ if c_∞ ≤ 0.9; in brackets the no-bias value from c_1 alone, (1 − c_1²)/c_1² · 0.81/0.19);
**s to 0.9** = max(n, 1) × s/grad. The model's cos(ḡ_R, t̂) is shown beside the measured one.
s/grad: median over the timed calls; tokens/grad: the rollout's static B × members × T (in
brackets those that count: guided's masked slots and tokens after EOS do not)."""


def load_mode_config(flag, entry: str, smoke: bool):
    """The file's ``<mode>[,sizes]`` variant (plain sizes and group.mode=mode when the file has
    no such variant), the command line's overrides, then the entry's own settings."""
    mode, *settings = entry.split(":")
    path, _, arg = flag.config_filename.partition(":")
    sizes = [t.strip() for t in arg.split(",") if t.strip()]
    sizes += ["tiny"] if smoke and "tiny" not in sizes else []
    try:
        config = config_blocks.load_config(path, ",".join([mode] + sizes))
    except ValueError:
        config = config_blocks.load_config(path, ",".join(sizes))
    config.group.mode = mode
    overrides = dict(config_flags.get_override_values(flag))
    if "group.mode" in overrides:
        raise app.UsageError("--config.group.mode is set by --modes")
    config.update_from_flattened_dict(overrides)
    if "grpo.beta" not in overrides:
        config.grpo.beta = 0.0  # the comparison is about the pg term
    for item in settings:
        config_blocks.set_field(config, *item.split("=", 1))
    config.init_from = FLAGS.init_from or config.init_from
    return config


def make_programs(step, prompts):
    """run(state, inputs, keys) -> per key (flat ∇θ of the engine's loss, counted tokens, mean
    return): the groups vary with the key, the prompts stay fixed."""

    def grad_of(params, ref_state, batch, host_out):
        parts, _ = step.score(batch, host_out)
        old = tuple(p.logp_old for p in parts)
        loss = lambda p: step.loss(p, parts, old, True, step.forced, ref_state)[0]
        grads = jax.grad(loss)(params)
        tokens = sum(p.token_mask.sum() for p in parts)
        ret = sum(p.returns.sum() for p in parts) / sum(p.member_mask.sum() for p in parts)
        return ravel_pytree(grads)[0], tokens, ret

    def rollouts(state, inputs, keys):
        return jax.lax.map(lambda k: step.groups(state, inputs, prompts, k), keys)

    def grads(params, ref_state, batches, host_outs):
        return jax.lax.map(lambda bh: grad_of(params, ref_state, *bh), (batches, host_outs))

    if step.host is None:
        fused = lambda state, inputs, keys: grads(
            state.params, inputs.ref_state, rollouts(state, inputs, keys), None
        )
        return jax.jit(fused)
    roll, grad = jax.jit(rollouts), jax.jit(grads)

    def split(state, inputs, keys):
        batches = roll(state, inputs, keys)
        host = [step.host(jax.tree.map(lambda x, i=i: x[i], batches)) for i in range(len(keys))]
        host = jax.tree.map(lambda *xs: np.stack(xs), *host)
        return grad(state.params, inputs.ref_state, batches, host)

    return split


def collect(config, repeats: int, calls: int, key):
    """R gradients of one config on the fixed batch, and the timing of the calls."""
    task = build_task(config, "train")
    params = trainer.initial_params(config, task)
    step, inputs = task.build(params)
    prompts = step.prompts(jax.random.PRNGKey(FLAGS.data_seed), inputs.data)
    run = make_programs(step, prompts)
    state, per_call, load = task.make_state(params), math.ceil(repeats / calls), os.getloadavg()
    keys = jax.random.split(key, per_call * calls)
    out, times = [], []
    for c in range(calls):
        t0 = time.perf_counter()
        res = jax.block_until_ready(run(state, inputs, keys[c * per_call : (c + 1) * per_call]))
        times.append(time.perf_counter() - t0)
        out.append(jax.device_get(res))
    grads, tokens, returns = (np.concatenate([o[i] for o in out]) for i in range(3))
    b = int(config.train.batch_size)
    # T, the static completion length: the groups' shape, traced, not run
    batch = jax.eval_shape(step.groups, state, inputs, prompts, keys[0])
    length = batch.parts[0].tokens.shape[-1]
    leaves = [np.asarray(x) for x in jax.tree.leaves(prompts)]
    return grads.astype(np.float64), {
        "repeats": len(grads),
        "s_per_grad": statistics.median(times[1:]) / per_call,
        "first_call_s": times[0],
        "load_avg_1min": [load[0], os.getloadavg()[0]],
        # the task's own count: value horizons, classes and decision points included
        "members_per_prompt": task.tokens_per_step / (b * length),
        "tokens_per_grad": int(task.tokens_per_step),
        "counted_tokens": float(tokens.mean()),
        "mean_return": float(returns.mean()),
        "completion_length": length,
        "prompts_sha256": hashlib.sha256(b"".join(x.tobytes() for x in leaves)).hexdigest()[:12],
        "num_params": int(grads.shape[1]),
    }


def unit(x):  # a zero gradient (no reward signal) gives NaN cosines, shown as "–"
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


def noise_ratio(g):
    """ρ = tr Cov / ‖E g‖², both unbiased from the rows of g (∞ when noise hides the mean)."""
    tr_cov = np.sum((g - g.mean(0)) ** 2) / (len(g) - 1)
    mean2 = np.sum(g.mean(0) ** 2) - tr_cov / len(g)
    return float(tr_cov / mean2) if mean2 > 0 else math.inf


def truth_stats(g):
    s = float(unit(g[: len(g) // 2].mean(0)) @ unit(g[len(g) // 2 :].mean(0)))
    return {"split_half_cos": s, "cos_to_exact_est": math.sqrt(2 * s / (1 + s)) if s > 0 else 0}


def ceiling_fit(c1, cos_se, rho, repeats, s_per_grad):
    """The model's ceiling c_∞ = c_1·sqrt(1 + ρ) and its standard error cos_se·sqrt(1 + ρ) (ρ's
    own error left out, so an underestimate), then n and s to TARGET and the model's cos(ḡ_R, t̂).
    A cosine cannot exceed 1: a raw ceiling above 1 by at most its standard error is noise
    around a ceiling of 1 and shows as 1 (arithmetic's sampled 1.003 ± 0.010). Further above 1,
    or with ρ/R > RHO_PER_REPEAT_MAX (‖ḡ_R‖² mostly noise, so ρ is the ratio to a small
    difference and its error, left out of the se, dominates), the model does not fit: ceiling,
    n, s and the model's cosine are NaN ("–") and ``ceiling_note`` says why."""
    finite = math.isfinite(rho)
    raw = c1 * math.sqrt(1 + rho) if finite else math.nan
    se = cos_se * math.sqrt(1 + rho) if finite else math.nan
    why = []
    if raw - 1 > se:
        why.append(f"c_1·sqrt(1 + ρ) = {raw:.3g} ± {se:.2g} exceeds 1 by more than its error")
    if finite and rho > RHO_PER_REPEAT_MAX * repeats:
        why.append(f"ρ/R = {rho / repeats:.3g} > {RHO_PER_REPEAT_MAX}: ρ is poorly measured")
    ceiling = math.nan if why or math.isnan(raw) else min(1.0, raw)
    if why:
        n = math.nan
    else:
        n = rho / ((ceiling / TARGET) ** 2 - 1) if ceiling > TARGET else math.inf
    return {
        "ceiling_raw": raw,
        "ceiling_se": se,
        "ceiling": ceiling,
        "ceiling_note": "; ".join(why),
        "n_to_target": n,
        "s_to_target": math.nan if why else max(n, 1.0) * s_per_grad,
        "cos_of_mean_model": ceiling / math.sqrt(1 + rho / repeats),
    }


def mode_stats(g, truth, s_per_grad):
    """Cosines to t̂, ρ, the ceiling and the compute to reach cosine 0.9 (METHOD)."""
    r, cos = len(g), unit(g) @ unit(truth)
    c1, gram, rho = float(cos.mean()), unit(g) @ unit(g).T, noise_ratio(g)
    se = float(cos.std(ddof=1) / math.sqrt(r))
    return {
        "cos": c1,
        "cos_se": se,
        "cos_of_mean": float(unit(g.mean(0)) @ unit(truth)),
        "repeat_cos": float((gram.sum() - np.trace(gram)) / (r * (r - 1))),
        "rho": rho,
        **ceiling_fit(c1, se, rho, r, s_per_grad),
        "n_to_target_unbiased": (1 - c1**2) / c1**2 * 0.81 / 0.19 if c1 > 0 else math.inf,
        "cos_per_s": c1 / s_per_grad,
    }


def fmt(x, digits=3):
    return "–" if x != x else "∞" if x == math.inf else f"{x:.{digits}g}"  # x != x: NaN


def ceiling_cell(r):
    if r["ceiling_note"]:
        return f"– ({fmt(r['ceiling_raw'])} ± {fmt(r['ceiling_se'], 2)})"
    return fmt(r["ceiling"]) + (
        f" ± {fmt(r['ceiling_se'], 2)}" if r["ceiling_se"] == r["ceiling_se"] else ""
    )


def section(label, rec):
    t, m, names = rec["truth"], rec["meta"], list(rec["modes"])
    scale = f", advantage_scale {t['advantage_scale']}" if "advantage_scale" in t else ""
    lines = [
        f"## {label}\n\n- Command: `{rec['command']}`",
        f"- Device: {m['platform']}; {m['params']}; seeds: {m['seeds']}",
        f"- Batch: {m['batch']} fixed prompts (sha256 {m['prompts_sha256']}; the same in every "
        f"mode: {m['same_prompts']}), completion length {m['completion_length']}; "
        f"{m['objective']}",
        f"- True gradient: the mean of {t['repeats']} sampled-group gradients with G = "
        f"{t['group_size']}{scale} ({t['repeats'] * t['group_size']:,} completions per prompt, "
        f"{t['s_per_grad']:.3g} s each): split-half cosine {t['split_half_cos']:.4f}, so "
        f"cos(t̂, t) ≈ {t['cos_to_exact_est']:.4f}\n",
        "| mode | members / prompt | tokens / grad | s / grad | cos(g, t̂) ± se | cos(ḡ_R, t̂) "
        "(model) | cos between repeats | ρ | ceiling c_∞ ± se | n to 0.9 (no bias) | s to 0.9 | "
        "cos/s |",
        "|---" * 12 + "|",
    ]
    for mode, r in rec["modes"].items():
        lines.append(
            f"| {mode} | {fmt(r['members_per_prompt'])} | {r['tokens_per_grad']:,} "
            f"({r['counted_tokens']:,.0f}) | {fmt(r['s_per_grad'])} | {r['cos']:.3f} ± "
            f"{r['cos_se']:.3f} | {r['cos_of_mean']:.3f} ({fmt(r['cos_of_mean_model'])}), R = "
            f"{r['repeats']} | {r['repeat_cos']:.3f} | {fmt(r['rho'])} | {ceiling_cell(r)} | "
            f"{fmt(r['n_to_target'])} ({fmt(r['n_to_target_unbiased'])}) | "
            f"{fmt(r['s_to_target'])} | {fmt(r['cos_per_s'])} |"
        )
    unfit = [
        f"- {mode}: {r['ceiling_note']}" for mode, r in rec["modes"].items() if r["ceiling_note"]
    ]
    if unfit:
        lines += ['\nCeiling not estimated ("–"; the model does not fit, METHOD):\n', *unfit]
    lines += ["\nCosines between the mean gradients (t̂ and each mode's ḡ):\n", "| | t̂ | "]
    lines[-1] += " | ".join(names) + " |\n" + "|---" * (len(names) + 2) + "|"
    for a, row in zip(["t̂"] + names, rec["mean_cos"], strict=True):
        lines.append(f"| {a} | " + " | ".join(f"{x:.3f}" for x in row) + " |")
    return "\n".join(lines + [""])


def refit(raw):
    """Every stored mode's ceiling, n and s to 0.9 again from its stored c_1, se, ρ and R (a
    re-render applies today's ceiling_fit to older records)."""
    for rec in raw["sections"].values():
        for r in rec["modes"].values():
            r.update(ceiling_fit(r["cos"], r["cos_se"], r["rho"], r["repeats"], r["s_per_grad"]))
    return raw


def markdown(raw) -> str:
    """<name>.md from <name>.json's record."""
    title = "# Gradient variance per unit of compute (`experiments/grad_variance.py`)\n"
    sections = [section(k, v) for k, v in raw["sections"].items()]
    note = [f"## Observations\n\n{raw['note']}\n"] if raw["note"] else []
    return "\n".join([title, METHOD, ""] + note + sections)


def write_report(out_dir: Path, name: str, label: str, rec, note=""):
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.json"
    raw = json.loads(path.read_text()) if path.exists() else {"sections": {}, "note": ""}
    if rec is not None:
        raw["sections"][label] = rec
    raw["note"] = note or raw["note"]
    md = markdown(refit(raw))
    path.write_text(json.dumps(raw, indent=1, default=str))
    (out_dir / f"{name}.md").write_text(md)
    return md


def run_meta(config, tmeta, modes):
    dev, gr, c = jax.devices()[0], config.grpo, config.init_from
    loads = [x for m in modes.values() for x in m["load_avg_1min"]]
    return {
        "platform": f"{dev.device_kind} ({dev.platform}, {jax.device_count()} device(s)), jax "
        f"{jax.__version__}, dtype {config.model.dtype}",
        "params": f"{tmeta['num_params']:,} params ({f'init_from {c}' if c else 'random init'})",
        "seeds": f"init {config.seed}, prompts (data key) {FLAGS.data_seed}, rollouts "
        f"{FLAGS.rollout_seed}; 1-min load average {min(loads):.1f}–{max(loads):.1f}",
        "batch": int(config.train.batch_size),
        "prompts_sha256": tmeta["prompts_sha256"],
        "same_prompts": all(m["prompts_sha256"] == tmeta["prompts_sha256"] for m in modes.values()),
        "completion_length": tmeta["completion_length"],
        "objective": f"β = {gr.beta}, advantage_scale {gr.advantage_scale}, loss_agg "
        f"{gr.loss_agg}, exhaustive_estimator {gr.exhaustive_estimator}",
    }


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    if FLAGS.report_only:
        return print(write_report(Path(FLAGS.out_dir), FLAGS.name, None, None, FLAGS.note))
    smoke, root = FLAGS.smoke, jax.random.PRNGKey(FLAGS.rollout_seed)
    repeats, calls = (4, 3) if smoke else (FLAGS.repeats, FLAGS.calls)
    true_g, true_r = (8, 6) if smoke else (FLAGS.true_group_size, FLAGS.true_repeats)
    config = load_mode_config(FLAGS["config"], f"sampled:group.size={true_g}", smoke)
    true_cfg = config.copy_and_resolve_references()  # config keeps the objective run_meta shows
    true_cfg.grpo.advantage_scale = FLAGS.true_advantage_scale or config.grpo.advantage_scale
    g_true, tmeta = collect(true_cfg, true_r, calls, jax.random.fold_in(root, 10_000))
    truth, modes, means = g_true.mean(0), {}, [g_true.mean(0)]
    print(f"truth: {truth_stats(g_true)}", flush=True)
    for i, entry in enumerate(FLAGS.modes):
        cfg = load_mode_config(FLAGS["config"], entry, smoke)
        g, meta = collect(cfg, repeats, calls, jax.random.fold_in(root, i))
        modes[entry] = {**meta, **mode_stats(g, truth, meta["s_per_grad"])}
        means.append(g.mean(0))
        print(f"{entry}: {json.dumps(modes[entry])}", flush=True)
    env = f"GRPO_JAX_DATA={os.environ['GRPO_JAX_DATA']} " if "GRPO_JAX_DATA" in os.environ else ""
    rec = {
        "command": f"{env}python experiments/grad_variance.py {shlex.join(sys.argv[1:])}",
        "overrides": dict(config_flags.get_override_values(FLAGS["config"])),
        "meta": run_meta(config, tmeta, {"truth": tmeta, **modes}),
        "truth": {
            "group_size": true_g,
            "advantage_scale": true_cfg.grpo.advantage_scale,
            **truth_stats(g_true),
            **tmeta,
        },
        "modes": modes,
        "mean_cos": (unit(np.stack(means)) @ unit(np.stack(means)).T).tolist(),
    }
    print(
        write_report(Path(FLAGS.out_dir), FLAGS.name, FLAGS.label or config.task, rec, FLAGS.note)
    )


def resolve_config_arg(argv):
    """``--config=NAME[:sizes]`` may name a packaged config, as grpo-jax's flag does."""
    fix = lambda a: "--config=" + config_blocks.resolve_config_flag(a[len("--config=") :])
    return [fix(a) if a.startswith("--config=") else a for a in argv]


if __name__ == "__main__":
    app.run(main, argv=resolve_config_arg(sys.argv))
