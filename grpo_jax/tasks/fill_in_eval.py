"""The fill-in task's held-out evaluation: a generator's fills of fixed val windows and spans.

The windows are the val split's (``heldout_windows``); the spans are drawn once from
``eval.seed``, so every training seed is scored on the same ones. Metrics:
  eval/fill_accuracy          greedy fill: share of masked chars equal to the original
  eval/fill_accuracy/lenK     the same over the spans of K chars only, for each K the spans
                              have (the per-position policy is exact on 1-char spans, only
                              factorised on longer ones)
  eval/sampled_fill_accuracy  mean π(original char) over masked positions
  eval/pass_at_k              P(one of k sampled fills restores the whole span), exact
(π: the generator's softmax at temperature 1, not the GRPO run's group.temperature)
  eval/judge_reward           the judge's reward of the greedy fills
  eval/judge_reward_original  the judge's reward of the original windows (a ceiling)

``single_char_optimum`` is not a training metric: it scores, on single-char spans, the
policy a perfect optimiser of the objective would reach against the same judge.
"""

import jax
import jax.numpy as jnp
import numpy as np

from grpo_jax import data as data_lib
from grpo_jax import judge as judge_lib


def heldout_windows(
    corpus: data_lib.Corpus, num_windows: int, length: int, name: str = "eval.num_windows"
) -> np.ndarray:
    """[num_windows, length] windows of the val split, spread evenly and not overlapping; more
    than the split holds is refused (``name``: the setting the message names)."""
    holds = max(1, (len(corpus.val) - length) // length)
    if num_windows > holds:
        raise ValueError(
            f"{name}={num_windows}: the val split ({len(corpus.val)} tokens) holds {holds} "
            f"windows of {length} that do not overlap; ask for at most {holds}"
        )
    ctx, tgt = data_lib.eval_windows(corpus.val, num_windows, length - 1, 1)
    return np.concatenate([ctx, tgt], 1)


def make_evaluate(config, generator, masked_input, judge_reward, judge_params, windows, vocab):
    """params -> (scalars, texts) on ``windows`` [N, L]; the judge's metrics only when
    ``judge_params`` is not None. ``masked_input(windows, span)`` masks the spans."""
    d = config.data
    length = d.window_len
    # eval.seed: the same spans for every training seed
    ev_span = judge_lib.random_spans(
        jax.random.PRNGKey(int(config.eval.get("seed", config.seed)) + 104729),
        len(windows),
        length,
        d.span_min,
        d.span_max,
    )
    ev_win = jnp.asarray(windows)
    ev_in = masked_input(ev_win, ev_span)
    pass_k = tuple(int(k) for k in config.eval.pass_k)
    lengths = sorted({int(k) for k in np.asarray(ev_span.sum(-1))})

    @jax.jit
    def eval_core(params, jparams):
        logits = generator.apply({"params": params}, ev_in)
        logp = jax.nn.log_softmax(logits, -1)
        greedy = jnp.argmax(logits, -1)
        filled = jnp.where(ev_span > 0, greedy, ev_win)
        lp_orig = jnp.take_along_axis(logp, ev_win[..., None], -1)[..., 0]  # [N, L]
        n_masked = ev_span.sum()
        hits = jnp.sum((greedy == ev_win) * ev_span, -1)  # [N]
        out = {
            "eval/fill_accuracy": hits.sum() / n_masked,
            "eval/sampled_fill_accuracy": jnp.sum(jnp.exp(lp_orig) * ev_span) / n_masked,
            "filled": filled,
        }
        span_len = ev_span.sum(-1)
        for k in lengths:  # only the lengths the eval's spans have: no 0 for "none"
            sel = span_len == k
            out[f"eval/fill_accuracy/len{k}"] = jnp.sum(hits * sel) / jnp.maximum(k * sel.sum(), 1)
        p_span = jnp.exp(jnp.sum(lp_orig * ev_span, -1))  # P(one sample restores the span)
        for k in pass_k:
            out[f"eval/pass_at_{k}"] = jnp.mean(1.0 - (1.0 - p_span) ** k)
        if jparams is not None:
            out["eval/judge_reward"] = judge_reward(jparams, filled).mean()
            out["eval/judge_reward_original"] = judge_reward(jparams, ev_win).mean()
        return out

    def evaluate(params):
        res = jax.device_get(eval_core(params, judge_params))
        filled = res.pop("filled")
        scalars = {k: float(x) for k, x in res.items()}
        lines = []
        for i in range(min(config.eval.num_samples, len(filled))):
            lines.append(f"--- masked  : {vocab.decode(np.asarray(ev_in[i]))!r}")
            lines.append(f"    filled  : {vocab.decode(filled[i])!r}")
            lines.append(f"    original: {vocab.decode(windows[i])!r}")
        return scalars, {"samples": "\n".join(lines), "summary": ""}

    return evaluate


def single_char_optimum(config, s, ref_params, judge_params, policies=(), num_windows=1024):
    """Greedy fill accuracy on held-out single-char spans of: the reference generator; the
    exact per-window optimum of E_π[r] − β KL(π‖π_ref) with π = softmax(z / T), z_ref + (T/β)·r
    with r the judge's reward of each of the V fills (what a perfect optimiser of the same
    judge would reach); GRPO's fixed point, where its expected update is zero (``fixed_point``:
    advantages centred on the group's mean, the member's own reward included, carry (1 − 1/G)
    of the reward's gradient, so z_ref + (1 − 1/G)(T/β)·r); and each of ``policies`` (param
    trees), all on the same windows. ``*_changed``: the share of windows whose fill differs
    from the reference's. ``s`` is the task's ``fill_in.load_setup(config)``.

    The fixed point holds for grpo.advantage_scale=none (a std scale divides the advantages
    by a random group statistic: no closed form), which it requires. A diagnostic for
    experiments (V judge passes per window), not a training metric."""
    if config.grpo.advantage_scale != "none":
        raise ValueError(
            f"single_char_optimum: grpo.advantage_scale={config.grpo.advantage_scale!r} has no "
            "closed-form fixed point; it needs 'none'"
        )
    v, length = s.v, config.data.window_len
    windows = jnp.asarray(heldout_windows(s.corpus, num_windows, length, "num_windows"))
    n = len(windows)
    key = jax.random.PRNGKey(int(config.eval.seed) + 7)  # not the eval spans' key
    pos = jax.random.randint(key, (n,), 0, length)
    rows = jnp.arange(n)
    masked = windows.at[rows, pos].set(s.mask_id)
    original = windows[rows, pos]

    def fill_rewards(window_and_pos):  # [L], () -> [V]: the judge's reward of every fill
        window, p = window_and_pos
        filled = jnp.broadcast_to(window, (v, length)).at[jnp.arange(v), p].set(jnp.arange(v))
        return s.judge_reward(judge_params, filled)

    # V judge passes per window, 64 windows at a time (memory)
    r = jax.jit(lambda w, p: jax.lax.map(fill_rewards, (w, p), batch_size=64))(windows, pos)
    logits = jax.jit(lambda p: s.generator.apply({"params": p}, masked)[rows, pos])
    accuracy = lambda z: float(jnp.mean(jnp.argmax(z, -1) == original))
    strength = float(config.group.temperature) / float(config.grpo.beta)
    shrink = 1.0 - 1.0 / int(config.group.size)
    z_ref = logits(ref_params)
    z_opt, z_fixed = z_ref + strength * r, z_ref + shrink * strength * r
    changed = lambda z: float(jnp.mean(jnp.argmax(z, -1) != jnp.argmax(z_ref, -1)))
    return {
        "num_windows": n,
        "reference": accuracy(z_ref),
        "optimum": accuracy(z_opt),
        "optimum_changed": changed(z_opt),
        "fixed_point": accuracy(z_fixed),
        "fixed_point_changed": changed(z_fixed),
        "policies": [accuracy(logits(p)) for p in policies],
    }
