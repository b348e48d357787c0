"""The step's metrics, computed on device from the scored group parts.

Names follow TRL's GRPOTrainer so that dashboards carry over: ``reward``, ``reward_std``,
``frac_reward_zero_std``, ``rewards/<term>/mean``, ``rewards/<term>/std``,
``completions/mean_length``, ``completions/min_length``, ``completions/max_length``,
``completions/clipped_ratio``, ``clip_ratio/{low,high,region}_mean`` (loss.py), ``kl``,
``entropy`` and ``num_tokens`` (cumulative, in engine.py). Where the definitions differ:

* ``reward`` is the mean over prompts of each group's mean return (TRL: the mean over all
  completions; equal when every group has the same number of members), and ``reward_std``
  the mean over prompts of each group's population std (ddof 0; TRL's std is ddof 1 over the
  group, see objective.group_advantages); ``rewards/<term>/std`` is ddof 0 too (TRL's
  ``nanstd``: ddof 1).
* ``kl`` and ``entropy`` (loss.py) are, as TRL's, token means over the batch's completion
  tokens, whatever ``grpo.loss_agg`` weighs the loss's own KL and entropy terms by. A forced
  part's (no TRL counterpart) weigh the decision point's exact KL / entropy over V and its
  continuation tokens' (aggregated as in the loss) 1 : t - 1 over t completion tokens.
* ``frac_reward_zero_std`` counts the groups whose counted returns are all equal: exactly
  those whose advantages are all 0 (objective.group_advantages centres them exactly). TRL
  counts std ≈ 0 (``isclose``, atol 1e-8) of its float rewards.
* Forced groups (exhaustive, guided) are every first token, not samples of π: their plain
  mean is not the policy's expected return; ``reward_policy_mean`` weights each member by
  π_old of its first token, which is (a class representative or a guided explorer times
  its importance weight, as scoring.return_credit weighs it).

The framework's own extras: ``reward_policy_mean``, ``reward_spread`` (best minus worst
member), ``advantage_var``, ``ratio_mean``, ``generated_tokens`` (completion tokens this step)
and, for exhaustive parts, ``first_token/reward`` and ``first_token/best`` ([V] vectors: the
mean return of forcing each token and how often it is the group's best; a task's host hook
may draw them).
"""

import jax
import jax.numpy as jnp

from grpo_jax import objective, scoring


def _prompt_stats(part, forced: bool):
    """Per-prompt statistics of one part, and the prompts that count."""
    mm = part.member_mask * part.valid  # members that count and were scored
    ret = part.returns
    n = jnp.maximum(mm.sum(1), 1.0)
    mean = (ret * mm).sum(1) / n
    # centred as the advantages are: exactly 0 in a group of equal returns, whatever G
    std = jnp.sqrt((objective.center(ret, mm > 0, jnp.ones_like(ret), 1) ** 2).sum(1) / n)
    valid = (mm.sum(1) > 0).astype(jnp.float32)
    big, small = jnp.where(mm > 0, ret, -jnp.inf), jnp.where(mm > 0, ret, jnp.inf)
    spread = jnp.where(valid > 0, big.max(1) - small.min(1), 0.0)
    # forced: π̄ of each member's first token, a stand-in's weight included
    pw = scoring.first_token_weights(part) * mm if forced else mm
    policy_mean = (ret * pw).sum(1) / jnp.maximum(pw.sum(1), 1e-30)
    tm = part.token_mask
    stats = {
        "reward": mean,
        "reward_policy_mean": policy_mean,
        "reward_std": std,
        "frac_reward_zero_std": (spread == 0).astype(jnp.float32),
        "reward_spread": spread,
    }
    adv_var = jnp.sum(part.advantages**2 * tm) / jnp.maximum(tm.sum(), 1.0)
    return stats, valid, adv_var


def first_token_stats(part, vocab_size: int):
    """Forced parts over the whole vocabulary: per first token (by id, whatever slot a mode
    puts it in), its mean return over the prompts that forced it, and the share of the
    prompts that count where it is the group's best."""
    am = part.action_mask
    by_id = lambda x: jnp.zeros(vocab_size).at[part.actions].add(x)  # summed over prompts
    reward = by_id(part.action_returns * am) / jnp.maximum(by_id(am), 1.0)
    best_slot = jnp.argmax(jnp.where(am > 0, part.action_returns, -jnp.inf), 1)
    best_id = jnp.take_along_axis(part.actions, best_slot[:, None], 1)[:, 0]
    best = jax.nn.one_hot(best_id, vocab_size) * am.max(1, keepdims=True)
    return {
        "first_token/reward": reward,
        "first_token/best": best.sum(0) / jnp.maximum(am.max(1).sum(), 1.0),
    }


def group_metrics(parts, forced_flags, vocab_size: int) -> dict:
    """Reward statistics of the step's groups, weighted over parts by their prompts."""
    sums, total = {}, 0.0
    adv_num = adv_den = 0.0
    out = {}
    for part, forced in zip(parts, forced_flags, strict=True):
        stats, valid, adv_var = _prompt_stats(part, forced)
        w = valid.sum()
        total = total + w
        for k, v in stats.items():
            sums[k] = sums.get(k, 0.0) + jnp.sum(v * valid)
        tm = part.token_mask.sum()
        adv_num, adv_den = adv_num + adv_var * tm, adv_den + tm
        if forced and part.actions.shape[1] == vocab_size:
            out.update(first_token_stats(part, vocab_size))
    total = jnp.maximum(total, 1.0)
    out.update({k: v / total for k, v in sums.items()})
    out["advantage_var"] = adv_num / jnp.maximum(adv_den, 1.0)
    return out


def reward_term_metrics(terms, parts, term_values, discount=1.0) -> dict:
    """``rewards/<term>/mean`` and ``/std`` of each term's raw (unweighted) return over every
    member that counts and that the term scored (a term's None is left out); the returns are
    γ-discounted like the ``reward`` (``reward.discount``)."""
    out = {}
    for term in terms:
        rs, ws = [], []
        for i, part in enumerate(parts):
            values, valid = term_values[i]
            r = scoring.sequence_returns(values[term.name], part.token_mask, discount)
            w = (part.member_mask > 0) & (values[f"{term.name}/valid"] > 0)
            rs.append(r.reshape(-1))
            ws.append(w.reshape(-1).astype(jnp.float32))
        r, w = jnp.concatenate(rs), jnp.concatenate(ws)
        n = jnp.maximum(w.sum(), 1.0)
        mean = jnp.sum(r * w) / n
        out[f"rewards/{term.name}/mean"] = mean
        out[f"rewards/{term.name}/std"] = jnp.sqrt(jnp.sum((r - mean) ** 2 * w) / n)
    return out


def completion_metrics(parts, eos_id) -> dict:
    """Completion lengths (tokens up to and including EOS) over the members that count;
    ``clipped_ratio`` is the share that hit the length limit without EOS (1 for a task with
    no EOS, whose completions all run to the fixed horizon)."""
    lengths, counted, ended, n_prompt = [], [], [], 0.0
    for part in parts:
        length = part.completion_mask.sum(-1)
        mm = part.member_mask > 0
        if eos_id is None:
            term = jnp.zeros(length.shape, bool)
        else:
            term = jnp.any((part.tokens == eos_id) & (part.completion_mask > 0), -1)
        lengths.append(length.reshape(-1))
        counted.append(mm.reshape(-1))
        ended.append(term.reshape(-1))
        n_prompt = n_prompt + jnp.sum(prompt_tokens(part.prompts)[:, None] * mm)
    length, mm, term = (jnp.concatenate(x) for x in (lengths, counted, ended))
    n = jnp.maximum(mm.sum(), 1)
    gen = jnp.sum(jnp.where(mm, length, 0.0))
    return {
        "completions/mean_length": gen / n,
        "completions/min_length": jnp.min(jnp.where(mm, length, jnp.inf)),
        "completions/max_length": jnp.max(jnp.where(mm, length, 0.0)),
        "completions/clipped_ratio": jnp.sum(mm & ~term) / n,
        "generated_tokens": gen,
        "num_tokens": gen + n_prompt,
    }


def prompt_tokens(prompts) -> jax.Array:
    """Prompt tokens per prompt [B] (float), for num_tokens: the prompt mask's sum when the
    prompts carry one, else their static width."""
    mask = getattr(prompts, "mask", None)
    if mask is not None:
        return jnp.sum(mask, -1)
    tokens = getattr(prompts, "tokens", None)
    width = 0 if tokens is None else tokens.shape[-1]
    b = jax.tree.leaves(prompts)[0].shape[0]
    return jnp.full((b,), float(width))
