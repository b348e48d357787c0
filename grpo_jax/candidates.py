"""Forced groups that cost less than V rollouts: which first actions to roll out, and the
all-action estimator's per-action values when only some of them are rolled out.

``pruned``: the smallest set of the guide's top-probability tokens whose mass reaches
``group.coverage``, capped at ``group.max_candidates`` (the static group size). The
all-action gradient is exact on the candidate set, -∇ Σ_{a∈M} π(a)(R(a) - b), and the
policy's mass outside it, the part of Σ_a π(a)A(a)∇log π(a) that is dropped, is reported as
``group/uncovered_mass``. With coverage 1.0 and max_candidates = V the candidates are every
token in id order: the exhaustive group exactly, rollout for rollout.

``hierarchical``: the vocabulary is split into C classes (``token_classes``). The first
decision forces every class: one representative a_c ~ π_old(·|c) per class is rolled out.
The second forces every member of the ``group.expand_classes`` classes with the most policy
mass. The per-action values handed to the exact all-action loss are (``hierarchical_values``)

    q(a) = R(a)                                          a in an expanded class
    q(a) = b_E + [a = a_c] (R(a_c) - b_E) / π_old(a|c)   a in another class c

with b_E the π-weighted mean return over the expanded members (a control variate that does
not depend on any a_c). E_{a_c}[q(a)] = R(a), so at π = π_old the estimator's expectation is
the exact all-action gradient -∇ Σ_a π(a)R(a); its class-level part, Σ_c ∇π(c)·q̄(c), is
what forcing every class buys, and the within-class part of an unexpanded class is a one-
sample score-function term with baseline b_E. Expanding every class gives the exact
gradient with no sampling at all (tests/test_candidates.py checks both against the exact
gradient). Cost: C + expand_classes × S rollouts (S = the largest class) instead of V.
"""

import unicodedata

import jax
import jax.numpy as jnp
import numpy as np

from grpo_jax.specs import GroupSpec
from grpo_jax.validate import require


def pruned_candidates(guide_logp, coverage: float, max_candidates: int):
    """guide_logp [B, V] -> (actions [B, M] int32 in id order, mask [B, M] float).

    A token is a candidate when the guide's mass of the tokens ranked above it is below
    ``coverage`` (so the set is the smallest top set that reaches it) and its rank is below
    M. Coverage >= 1 takes every token the guide gives mass to (rounding in the cumulative
    sum must not drop the tail)."""
    b, v = guide_logp.shape
    p = jnp.exp(guide_logp)
    order = jnp.argsort(-p, axis=-1)
    sorted_p = jnp.take_along_axis(p, order, -1)
    before = jnp.cumsum(sorted_p, -1) - sorted_p
    keep_sorted = (before < coverage) | (coverage >= 1.0)
    keep_sorted &= (jnp.arange(v) < max_candidates) & (sorted_p > 0)
    keep = jnp.zeros((b, v), bool).at[jnp.arange(b)[:, None], order].set(keep_sorted)
    # the kept ids in increasing order: top_k of (V - id) over the kept set
    score = jnp.where(keep, v - jnp.arange(v), 0)
    top, _ = jax.lax.top_k(score, max_candidates)
    return (v - top).astype(jnp.int32) % v, (top > 0).astype(jnp.float32)


def token_classes(kind: str, texts, num_classes: int) -> np.ndarray:
    """[V] class id of every token, from its text (``texts[i]``: token i decoded).

    ``chars``: by the first character: letters, whitespace, digits, punctuation and others,
    and special tokens (empty text: PAD, EOS) in a class of their own; empty classes are
    dropped. ``blocks``: ``num_classes`` contiguous id ranges of equal size; for a BPE
    vocabulary ids follow the merge order, which is a frequency order."""
    v = len(texts)
    if kind == "blocks":
        return (np.arange(v) * num_classes // v).astype(np.int32)

    def category(text):
        if not text:
            return 0
        c = text[0]
        if c.isspace():
            return 1
        if c.isalpha():
            return 2
        if c.isdigit():
            return 3
        return 4 if unicodedata.category(c).startswith("P") else 5

    cats = np.array([category(t) for t in texts])
    _, dense = np.unique(cats, return_inverse=True)
    return dense.astype(np.int32)


def task_classes(spec: GroupSpec, texts):
    """The hierarchical group's token classes for a vocabulary whose token i decodes to
    ``texts[i]`` (None for every other mode); checks group.expand_classes against them."""
    if spec.mode != "hierarchical":
        return None
    classes = token_classes(spec.class_kind, texts, spec.num_classes)
    n = int(classes.max()) + 1
    require(
        spec.expand_classes <= n,
        "group.expand_classes",
        spec.expand_classes,
        f"must be <= the number of token classes ({n} with group.class_kind={spec.class_kind})",
    )
    return classes


def group_slots(classes: np.ndarray, expand: int) -> int:
    """Forced slots of a hierarchical group: a representative per class plus the members of
    ``expand`` classes (each padded to the largest class)."""
    return int(classes.max()) + 1 + expand * int(np.bincount(classes).max())


def class_members(classes: np.ndarray):
    """[V] class ids -> (members [C, S] int32 token ids, member_mask [C, S] bool)."""
    c = int(classes.max()) + 1
    s = int(np.bincount(classes, minlength=c).max())
    members = np.zeros((c, s), np.int32)
    mask = np.zeros((c, s), bool)
    for k in range(c):
        ids = np.flatnonzero(classes == k)
        members[k, : ids.size], mask[k, : ids.size] = ids, True
    return members, mask


def hierarchical_candidates(key, policy_logp, classes, members, member_mask, expand: int):
    """The hierarchical group's forced actions.

    policy_logp [B, V]: π_old's (tempered) log-probs at the decision point. Returns
    (actions [B, C + expand·S] int32, mask, weights): the first C slots are the class
    representatives (counted for classes that are not expanded and have mass), then the
    members of the ``expand`` classes with the most mass. ``weights`` [B, A] is the
    importance weight π_old(c)/π_old(a_c) of a representative and 0 for members."""
    b = policy_logp.shape[0]
    n_cls = members.shape[0]
    p = jnp.exp(policy_logp)
    class_mass = jax.ops.segment_sum(p.T, classes, num_segments=n_cls).T  # [B, C]
    _, top = jax.lax.top_k(class_mass, expand)  # [B, E]
    expanded = jnp.zeros((b, n_cls), bool).at[jnp.arange(b)[:, None], top].set(True)
    # one representative per class from π_old(·|c): Gumbel-max over the class's members
    lp_members = jnp.where(member_mask, policy_logp[:, members], -jnp.inf)  # [B, C, S]
    g = jax.random.gumbel(key, lp_members.shape)
    pick = jnp.argmax(jnp.where(member_mask, lp_members + g, -jnp.inf), -1)  # [B, C]
    reps = members[jnp.arange(n_cls), pick]  # [B, C]
    rep_p = jnp.take_along_axis(p, reps, -1)
    alive = (class_mass > 0) & (rep_p > 0)
    rep_mask = alive & ~expanded
    weights = jnp.where(rep_mask, class_mass / jnp.where(alive, rep_p, 1.0), 0.0)
    exp_ids = members[top].reshape(b, -1)  # [B, E·S]
    exp_mask = member_mask[top].reshape(b, -1)
    actions = jnp.concatenate([reps, exp_ids], -1).astype(jnp.int32)
    mask = jnp.concatenate([rep_mask, exp_mask], -1).astype(jnp.float32)
    weights = jnp.concatenate([weights, jnp.zeros(exp_mask.shape)], -1)
    return actions, mask, weights


def hierarchical_values(pi, actions, action_mask, weights, action_returns):
    """Per-action values q [B, V] for the exact all-action loss (see the module docstring).

    pi [B, V]: stop-gradient policy probabilities (for the control variate b_E); actions,
    action_mask, weights, action_returns [B, A]: the group's slots. weights > 0 marks a slot
    that stands for others, rolled out with probability 1 / weight relative to them (a class
    representative; a guided group's random explorer, groups.guided_candidates), 0 a slot
    whose return is its own (an expanded member; a guided top-k token). The advantages'
    std (scale group / batch) is then the π-weighted std of q over the whole vocabulary."""
    b, v = pi.shape
    is_rep = weights > 0
    member = (action_mask > 0) & ~is_rep
    pi_act = jnp.take_along_axis(pi, actions, -1)
    w_m = jnp.where(member, pi_act, 0.0)
    b_e = jnp.sum(w_m * action_returns, -1) / jnp.maximum(jnp.sum(w_m, -1), 1e-30)  # [B]
    rows = jnp.arange(b)[:, None]
    q = jnp.broadcast_to(b_e[:, None], (b, v))
    rep_val = b_e[:, None] + (action_returns - b_e[:, None]) * weights
    # exactly one slot writes each rolled-out token; the others are dropped (mode="drop")
    q = q.at[rows, jnp.where(member, actions, v)].set(action_returns, mode="drop")
    return q.at[rows, jnp.where(is_rep & (action_mask > 0), actions, v)].set(rep_val, mode="drop")
