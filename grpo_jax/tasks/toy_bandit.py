"""The toy contextual bandit behind GRPO tutorials, as a Task for the common trainer.

World (deterministic from ``toy.world_seed``, or ``seed`` when it is -1): N contexts with fixed
random embeddings e_c ~ N(0, I_d), a V-token vocabulary and hidden true preferences
p(c, ·) = softmax(2·z_c), z ~ N(0, 1). The true reward of token v in context c is p(c, v); the
best token is argmax_v p(c, v).

Pipeline, all inside the task (seconds on a CPU, deterministic from the seed):
  1. SFT: an MLP policy (e_c -> hidden ReLU -> V logits, Flax Linen) trained by cross-entropy
     on tokens sampled from the true preferences. ``init_params(key)`` returns the SFT policy,
     so GRPO starts from it (``init_from`` still overrides it) and the KL reference is the
     frozen initial (SFT) policy.
  2. Reward model (``toy.reward=rm``): a Bradley–Terry model r_φ(c, v) (token embedding
     concatenated with e_c -> MLP -> scalar) fit on simulated comparisons (c, a, b) labelled
     a ≻ b with probability σ(toy.bt_scale · (p(c, a) - p(c, b))). The true rewards are
     probabilities in [0, 1], so with bt_scale = 1 the labels are close to coin flips; the
     default 10 makes the comparisons informative. Trained in ``build``.
  3. GRPO through the one engine (grpo_jax/single_step.py adapts this one-action policy):
     G samples per context (or every action, ``group.mode=exhaustive``), reward r_φ (``rm``)
     or the verifiable 1[v = best token] (``rlvr``); the zero-weight terms ``true_reward``
     and ``sample_accuracy`` are logged as rewards/<term>/mean beside it.

Evaluation is exact (the policy is a V-way softmax per context, no sampling):
  eval/true_reward        Σ_v π(v|c) p(c, v), averaged over contexts (and per context /ctxI)
  eval/accuracy           fraction of contexts whose greedy token is the best one
  eval/sampled_accuracy   π(best|c) averaged over contexts (and per context /ctxI)
  eval/pass_at_k          1 - (1 - π(best|c))^k averaged over contexts
  eval/kl_to_sft          exact KL(π ‖ π_SFT) averaged over contexts
  eval/optimal_true_reward  max_v p(c, v) averaged (the ceiling of eval/true_reward)
"""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import logging

from grpo_jax import groups, objective, sharding, single_step
from grpo_jax.rewards import RewardTerm
from grpo_jax.specs import EngineSpec, OptimSpec
from grpo_jax.task import Task
from grpo_jax.train_state import init_state, make_optimizer
from grpo_jax.validate import choice, integer, number

REWARDS = ("rm", "rlvr")


class ToyWorld:
    """Embeddings, true preferences and best tokens of one toy problem (numpy, host)."""

    def __init__(self, seed: int, num_contexts: int, context_dim: int, vocab_size: int, temp):
        k_emb, k_z = jax.random.split(jax.random.PRNGKey(seed))
        self.embeddings = np.asarray(jax.random.normal(k_emb, (num_contexts, context_dim)))
        z = jax.random.normal(k_z, (num_contexts, vocab_size))
        self.prefs = np.asarray(jax.nn.softmax(temp * z, axis=-1))  # [N, V] true rewards
        self.best = self.prefs.argmax(-1).astype(np.int32)  # [N]


class MLPPolicy(nn.Module):
    """Context embedding -> hidden (ReLU) -> vocabulary logits."""

    hidden: int
    vocab_size: int

    @nn.compact
    def __call__(self, x):
        return nn.Dense(self.vocab_size)(nn.relu(nn.Dense(self.hidden)(x)))


class RewardModel(nn.Module):
    """Bradley–Terry reward model r(c, v): [e_c ; token embedding] -> MLP -> scalar."""

    hidden: int
    vocab_size: int

    @nn.compact
    def __call__(self, ctx_emb, tokens):
        tok = nn.Embed(self.vocab_size, self.hidden)(tokens)
        ctx = jnp.broadcast_to(ctx_emb, tok.shape[:-1] + ctx_emb.shape[-1:])
        h = nn.relu(nn.Dense(self.hidden)(jnp.concatenate([ctx, tok], -1)))
        return nn.Dense(1)(h)[..., 0]


def fit(loss_of_batch, params, key, cfg):
    """Adam on ``loss_of_batch(params, key)`` for cfg.num_steps fresh batches, one lax.scan.

    Returns (params, per-step losses)."""
    tx = optax.adam(cfg.learning_rate)

    def step(carry, k):
        params, opt = carry
        loss, grads = jax.value_and_grad(loss_of_batch)(params, k)
        updates, opt = tx.update(grads, opt, params)
        return (optax.apply_updates(params, updates), opt), loss

    keys = jax.random.split(key, cfg.num_steps)
    (params, _), losses = jax.jit(lambda p, o, ks: jax.lax.scan(step, (p, o), ks))(
        params, tx.init(params), keys
    )
    return params, losses


def train_sft(policy, world, key, cfg):
    """Cross-entropy on tokens sampled from the true preferences (Adam, one lax.scan)."""
    emb, logp_true = jnp.asarray(world.embeddings), jnp.log(jnp.asarray(world.prefs))
    k_init, k_data = jax.random.split(key)
    params = policy.init(k_init, emb[:1])["params"]

    def loss_fn(p, k):
        kc, kt = jax.random.split(k)
        ctx = jax.random.randint(kc, (cfg.batch_size,), 0, emb.shape[0])
        tok = jax.random.categorical(kt, logp_true[ctx])
        logits = policy.apply({"params": p}, emb[ctx])
        return optax.softmax_cross_entropy_with_integer_labels(logits, tok).mean()

    params, losses = fit(loss_fn, params, k_data, cfg)
    return params, float(losses[-100:].mean())


def train_reward_model(rm, world, key, cfg):
    """Bradley–Terry fit on simulated comparisons; returns (params, pairwise accuracy).

    The accuracy is over all (c, a, b) pairs with p(c, a) != p(c, b): how often the RM
    orders them like the true preferences."""
    emb, prefs = jnp.asarray(world.embeddings), jnp.asarray(world.prefs)
    n, v = prefs.shape
    k_init, k_data = jax.random.split(key)
    params = rm.init(k_init, emb[:1], jnp.zeros((1,), jnp.int32))["params"]

    def loss_fn(p, k):
        kc, ka, kb, kl = jax.random.split(k, 4)
        b = cfg.batch_size
        ctx = jax.random.randint(kc, (b,), 0, n)
        ta, tb = jax.random.randint(ka, (b,), 0, v), jax.random.randint(kb, (b,), 0, v)
        p_a = jax.nn.sigmoid(cfg.bt_scale * (prefs[ctx, ta] - prefs[ctx, tb]))
        label = jax.random.bernoulli(kl, p_a).astype(jnp.float32)
        ra = rm.apply({"params": p}, emb[ctx], ta)
        rb = rm.apply({"params": p}, emb[ctx], tb)
        return optax.sigmoid_binary_cross_entropy(ra - rb, label).mean()

    params, _ = fit(loss_fn, params, k_data, cfg)
    scores = np.asarray(rm_table(rm, params, emb, v))  # [N, V]
    true = np.asarray(prefs)
    dt = true[:, :, None] - true[:, None, :]
    ds = scores[:, :, None] - scores[:, None, :]
    valid = dt != 0
    return params, float(np.mean((np.sign(dt) == np.sign(ds))[valid]))


def rm_table(rm, params, emb, vocab_size):
    """r(c, v) for every context and token: [N, V]."""
    n = emb.shape[0]
    toks = jnp.broadcast_to(jnp.arange(vocab_size), (n, vocab_size))
    return rm.apply({"params": params}, emb[:, None, :], toks)


def validate(config, mode: str) -> EngineSpec:
    t = config.toy
    choice("toy.reward", t.reward, REWARDS)
    if mode == "train_judge":
        raise ValueError("task=toy_bandit has no judge; --mode=train_judge is for task=fill_in")
    if mode == "pretrain":
        raise ValueError("task=toy_bandit trains its SFT policy itself; use --mode=train")
    for name in ("num_contexts", "context_dim", "vocab_size", "hidden"):
        integer(f"toy.{name}", t[name], 1)
    integer("toy.world_seed", t.world_seed, -1)
    number("toy.pref_temperature", t.pref_temperature, 0.0, open_low=True)
    for stage in ("sft", "rm"):  # the task's own Adam fits
        integer(f"toy.{stage}.num_steps", t[stage].num_steps, 1)
        integer(f"toy.{stage}.batch_size", t[stage].batch_size, 1)
        number(f"toy.{stage}.learning_rate", t[stage].learning_rate, 0.0, open_low=True)
    number("toy.rm.bt_scale", t.rm.bt_scale, 0.0, open_low=True)
    spec = EngineSpec.from_config(config)
    spec.group.check_vocab(t.vocab_size)
    return spec


def build(config, mode: str = "train", workdir=None) -> Task:  # keeps nothing in workdir
    espec = validate(config, mode)
    t = config.toy
    world_seed = config.seed if t.world_seed < 0 else t.world_seed
    world = ToyWorld(world_seed, t.num_contexts, t.context_dim, t.vocab_size, t.pref_temperature)
    policy = MLPPolicy(t.hidden, t.vocab_size)
    rm = RewardModel(t.hidden, t.vocab_size)
    emb = jnp.asarray(world.embeddings)
    prefs, best = jnp.asarray(world.prefs), jnp.asarray(world.best)
    n, b = t.num_contexts, config.train.batch_size
    pass_k = tuple(int(k) for k in config.eval.pass_k)

    def policy_logits(params, ctx):
        return policy.apply({"params": params}, emb[ctx])[:, None, :]  # [B, 1, V]

    def sample_prompts(key, data):
        ctx = jax.random.randint(key, (b,), 0, n)
        one = jnp.ones((b,), jnp.int32)
        return single_step.SpanPrompts(ctx, one * 0, one, {})

    def action_term(fn):
        return lambda rm_params, ctx, tokens, mask, ref: fn(rm_params, ctx.inputs, tokens[..., 0])

    def is_best(rm_params, ctx, tok):
        return (tok == best[ctx][:, None]).astype(jnp.float32)

    def rm_reward(rm_params, ctx, tok):
        return rm.apply({"params": rm_params}, jnp.repeat(emb[ctx][:, None], tok.shape[1], 1), tok)

    terms = (
        RewardTerm(t.reward, 1.0, action_term(is_best if t.reward == "rlvr" else rm_reward)),
        RewardTerm("true_reward", 0.0, action_term(lambda _, ctx, tok: prefs[ctx[:, None], tok])),
        RewardTerm("sample_accuracy", 0.0, action_term(is_best)),
    )

    def sft(key):
        params, loss = train_sft(policy, world, jax.random.fold_in(key, 1), t.sft)
        logging.info("toy bandit: SFT cross-entropy %.4f after %d steps", loss, t.sft.num_steps)
        return params

    sft_ref = {}  # the SFT policy for eval/kl_to_sft, from the same key the trainer uses

    def init_params(key):
        params = sft(key)
        sft_ref.setdefault("params", jax.tree.map(jnp.copy, params))  # params get donated
        return params

    @jax.jit
    def eval_core(params, ref_params):
        logits = policy.apply({"params": params}, emb)  # [N, V]
        pi = jax.nn.softmax(logits, -1)
        greedy = jnp.argmax(logits, -1)
        p_best = pi[jnp.arange(n), best]
        out = {
            "true": jnp.sum(pi * prefs, -1),
            "p_best": p_best,
            "correct": (greedy == best).astype(jnp.float32),
            "kl": objective.exact_kl(logits, policy.apply({"params": ref_params}, emb)),
            "greedy": greedy,
        }
        for k in pass_k:
            out[f"pass_at_{k}"] = 1.0 - (1.0 - p_best) ** k
        return out

    def evaluate(params):
        if "params" not in sft_ref:
            sft_ref["params"] = sft(jax.random.PRNGKey(config.seed))
        res = jax.device_get(eval_core(params, sft_ref["params"]))
        s = {
            "eval/true_reward": float(res["true"].mean()),
            "eval/accuracy": float(res["correct"].mean()),
            "eval/sampled_accuracy": float(res["p_best"].mean()),
            "eval/kl_to_sft": float(res["kl"].mean()),
            "eval/optimal_true_reward": float(world.prefs.max(-1).mean()),
        }
        for k in pass_k:
            s[f"eval/pass_at_{k}"] = float(res[f"pass_at_{k}"].mean())
        for c in range(n):
            s[f"eval/true_reward/ctx{c}"] = float(res["true"][c])
            s[f"eval/sampled_accuracy/ctx{c}"] = float(res["p_best"][c])
        lines = [
            f"ctx {c}: greedy {int(res['greedy'][c])} best {int(world.best[c])} "
            f"pi(best)={res['p_best'][c]:.3f} true_reward={res['true'][c]:.4f} "
            f"(optimum {world.prefs[c].max():.4f})"
            for c in range(n)
        ]
        return s, {"samples": "\n".join(lines), "summary": f"greedy={res['greedy'].tolist()}"}

    mu = espec.objective.num_iterations
    optim = OptimSpec.from_config(config.optim)
    tx, schedule = make_optimizer(optim, config.train.num_steps, updates_per_step=mu)

    @functools.cache  # the reward model depends on the world alone: trained once per task
    def reward_model():
        key = jax.random.PRNGKey(world_seed + 10_000)
        params, pair_acc = train_reward_model(rm, world, key, t.rm)
        logging.info("toy bandit: reward model pairwise accuracy %.4f", pair_acc)
        return params

    def build(initial_params, mesh=None):
        rm_params = reward_model() if t.reward == "rm" else None
        fns = (policy_logits, t.vocab_size, 1, sample_prompts, terms, tx, schedule)
        hooks = sharding.step_hooks(mesh, config)
        return single_step.build(espec, *fns, initial_params, None, rm_params, hooks)

    return Task(
        init_params=init_params,
        make_state=lambda params: init_state(params, tx, config.seed),
        build=build,
        evaluate=evaluate,
        tokens_per_step=int(b * groups.members_per_prompt(espec.group, t.vocab_size, b)),
        num_steps=int(config.train.num_steps),
        vocab=None,
        log_keys=("loss", "reward", "kl", "eval/true_reward"),
        heldout_key="eval/true_reward",
    )
