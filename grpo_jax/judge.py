"""The fill-in task's judge: a sequence scorer of real vs. corrupted windows.

Trained by ``--mode=train_judge`` (the common trainer, a supervised step) and then loaded,
frozen, as the reward of the fill-in GRPO run (``judge.checkpoint``).

Corruptions replace the chars of a random span (the same span distribution as the
generator's masks) by one of ``judge.corruptions``:
  random   uniform chars of the vocabulary
  unigram  chars drawn from the train split's char frequencies
  swap     the chars at the same positions of another random train window (real text, wrong
           place: the judge must read the context, not only the chars)
Loss, on B real and B corrupted windows per step: per-char binary cross-entropy (ELECTRA's
replaced-token detection; a char counts as corrupted only where it differs from the original),
class-balanced (corrupted chars are a few percent of all), plus the window-level binary
cross-entropy of the window logit (Σ_t log σ(s_t) of the per-char logits plus a learned
bias, encoder.py). A window is classified real when its logit is > 0; the fill-in reward is its
sigmoid.

Held-out metrics (fixed val windows and corruptions):
  eval/judge_accuracy        fraction of real and corrupted windows classified right
  eval/judge_pair_accuracy   fraction of windows scored above their corrupted copy
  eval/judge_accuracy/KIND   accuracy on the corrupted windows of each kind
"""

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp

from grpo_jax import checkpoint as ckpt_lib
from grpo_jax.encoder import SCORE_HEAD, Encoder
from grpo_jax.train_step import TrainState, keep_if_finite

CORRUPTIONS = ("random", "unigram", "swap")


def make_judge_model(judge_cfg, vocab_size: int, window_len: int) -> Encoder:
    return Encoder(
        vocab_size=vocab_size,
        num_layers=judge_cfg.num_layers,
        num_heads=judge_cfg.num_heads,
        d_model=judge_cfg.d_model,
        max_len=window_len,
        head="score",
    )


def random_spans(key, batch: int, window_len: int, span_min: int, span_max: int):
    """[B, L] float masks of one contiguous span per row, length ~ U{span_min..span_max}."""
    k_len, k_start = jax.random.split(key)
    length = jax.random.randint(k_len, (batch, 1), span_min, span_max + 1)
    start = jax.random.randint(k_start, (batch, 1), 0, window_len - length + 1)
    pos = jnp.arange(window_len)[None]
    return ((pos >= start) & (pos < start + length)).astype(jnp.float32)


def random_windows(key, tokens, batch: int, width: int):
    starts = jax.random.randint(key, (batch,), 0, tokens.shape[0] - width + 1)
    return jax.vmap(lambda s: jax.lax.dynamic_slice(tokens, (s,), (width,)))(starts)


def corrupt(key, windows, span, tokens, log_unigram, kinds):
    """Corrupted copies of ``windows`` [B, L] inside ``span`` [B, L].

    Returns (corrupted [B, L], kind index [B], changed [B] bool)."""
    b, length = windows.shape
    v = log_unigram.shape[0]
    k_kind, k_rand, k_uni, k_swap = jax.random.split(key, 4)
    kind = jax.random.randint(k_kind, (b,), 0, len(kinds))
    options = {
        "random": jax.random.randint(k_rand, (b, length), 0, v),
        "unigram": jax.random.categorical(k_uni, log_unigram, shape=(b, length)),
        "swap": random_windows(k_swap, tokens, b, length),
    }
    stacked = jnp.stack([options[k] for k in kinds])  # [K, B, L]
    repl = jnp.take_along_axis(stacked, kind[None, :, None], axis=0)[0]
    out = jnp.where(span > 0, repl, windows).astype(jnp.int32)
    return out, kind, jnp.any(out != windows, axis=-1)


def log_unigram_of(tokens, vocab_size: int):
    counts = np.bincount(np.asarray(tokens), minlength=vocab_size).astype(np.float64) + 1.0
    return jnp.asarray(np.log(counts / counts.sum()), jnp.float32)


def window_logit(token_logits, params):
    """The window logit of encoder.py's score head from its per-char logits [..., L]."""
    return jnp.sum(jax.nn.log_sigmoid(token_logits), -1) + params["score_bias"]


def make_judge_step(config, model, tx, schedule, kinds, vocab_size):
    """Returns step(state, train_tokens) -> (state, metrics): one BCE step (pure; jit it)."""
    j, d = config.judge, config.data
    b, length = j.batch_size, d.window_len

    def loss_fn(params, x, y):
        logits = model.apply({"params": params}, x, per_token=True)  # [2B, L]
        bce = optax.sigmoid_binary_cross_entropy(logits, y)
        pos, neg = y, 1.0 - y  # original / corrupted chars
        token_loss = 0.5 * (jnp.sum(bce * pos) / jnp.maximum(pos.sum(), 1.0)) + 0.5 * (
            jnp.sum(bce * neg) / jnp.maximum(neg.sum(), 1.0)
        )
        window = window_logit(logits, params)  # [2B], as model.apply(x) without a 2nd pass
        label = y.min(-1)  # 1: no char changed
        window_loss = optax.sigmoid_binary_cross_entropy(window, label).mean()
        acc = jnp.mean(((window > 0) == (label > 0.5)).astype(jnp.float32))
        return token_loss + window_loss, acc

    def step(state: TrainState, inputs):
        tokens, log_uni = inputs
        key = jax.random.fold_in(state.rng, state.step)
        k_win, k_span, k_cor = jax.random.split(key, 3)
        real = random_windows(k_win, tokens, b, length)
        span = random_spans(k_span, b, length, d.span_min, d.span_max)
        fake, _, _ = corrupt(k_cor, real, span, tokens, log_uni, kinds)
        x = jnp.concatenate([real, fake])
        y = jnp.concatenate([jnp.ones_like(real), (fake == real)]).astype(jnp.float32)
        (loss, acc), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params, x, y)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        finite = jnp.isfinite(loss)
        params = keep_if_finite(finite, optax.apply_updates(state.params, updates), state.params)
        opt_state = keep_if_finite(finite, opt_state, state.opt_state)
        metrics = {
            "loss": loss,
            "train_accuracy": acc,
            "grad_norm": optax.tree.norm(grads),
            "learning_rate": schedule(state.step),
        }
        return TrainState(state.step + 1, params, opt_state, state.rng), metrics

    return step


def make_judge_eval(config, model, val_windows, train_tokens, log_uni, kinds, seed):
    """Held-out real-vs-corrupted metrics on fixed windows; returns evaluate(params)."""
    d = config.data
    key = jax.random.PRNGKey(seed + 7919)
    k_span, k_cor = jax.random.split(key)
    real = jnp.asarray(val_windows)
    span = random_spans(k_span, real.shape[0], d.window_len, d.span_min, d.span_max)
    fake, kind, changed = corrupt(k_cor, real, span, jnp.asarray(train_tokens), log_uni, kinds)
    fake, kind, changed = np.asarray(fake), np.asarray(kind), np.asarray(changed)
    keep = changed  # only windows whose corruption changed something
    score = jax.jit(lambda p, x: model.apply({"params": p}, x))

    def evaluate(params):
        s_real, s_fake = np.asarray(score(params, real)), np.asarray(score(params, fake))
        right_real, right_fake = s_real > 0, s_fake <= 0
        out = {
            "eval/judge_accuracy": float(
                (right_real.sum() + right_fake[keep].sum()) / (len(right_real) + keep.sum())
            ),
            "eval/judge_pair_accuracy": float(np.mean((s_real > s_fake)[keep])),
            "eval/judge_real_prob": float(np.mean(1 / (1 + np.exp(-s_real)))),
        }
        for i, name in enumerate(kinds):
            sel = keep & (kind == i)
            if sel.any():
                out[f"eval/judge_accuracy/{name}"] = float(right_fake[sel].mean())
        text = (
            f"held-out judge accuracy {out['eval/judge_accuracy']:.4f} "
            f"(pairwise {out['eval/judge_pair_accuracy']:.4f}) on {len(real)} real and "
            f"{int(keep.sum())} corrupted windows"
        )
        return out, {"samples": text, "best_char": ""}

    return evaluate


def _checkpoint_dir(path: str) -> Path:
    p = Path(path).expanduser().absolute()
    return p / "checkpoints" if (p / "checkpoints").is_dir() else p


def saved_param_names(path: str) -> set:
    """Top-level names of the params saved in the latest checkpoint (metadata only)."""
    directory = _checkpoint_dir(path)
    if not directory.is_dir():
        raise ValueError(
            f"judge.checkpoint={path!r} has no checkpoint directory; train a judge first with "
            "--mode=train_judge --workdir=DIR and pass --config.judge.checkpoint=DIR"
        )
    options = ocp.CheckpointManagerOptions(read_only=True, create=False, save_interval_steps=0)
    handlers = {"state": ocp.PyTreeCheckpointHandler(), "extra": ocp.JsonCheckpointHandler()}
    with ocp.CheckpointManager(directory, item_handlers=handlers, options=options) as mngr:
        step = mngr.latest_step()
        if step is None:
            raise ValueError(f"judge.checkpoint={path!r}: no checkpoint found in {directory}")
        try:
            tree = mngr.item_metadata(step)["state"].tree
        except Exception as err:  # unreadable metadata: one line
            raise ValueError(
                f"judge.checkpoint={path!r} is unreadable ({type(err).__name__})"
            ) from err
    params = tree.get("params") if isinstance(tree, dict) else None
    return set(params) if isinstance(params, dict) else set()


def load_judge(config, model, vocab_size: int):
    """The frozen judge's params from ``judge.checkpoint``; one-line ValueError otherwise."""
    path = config.judge.checkpoint
    if not path:
        raise ValueError(
            "judge.checkpoint is empty: train a judge with --mode=train_judge --workdir=DIR, "
            "then pass --config.judge.checkpoint=DIR"
        )
    names = saved_param_names(path)
    if SCORE_HEAD not in names:
        raise ValueError(
            f"judge.checkpoint={path!r} is not a sequence scorer (its params have no "
            f"{SCORE_HEAD!r}; found {sorted(names)[:4]}); train one with --mode=train_judge"
        )
    template = model.init(jax.random.PRNGKey(0), jnp.zeros((1, config.data.window_len), jnp.int32))
    return ckpt_lib.load_params(path, template["params"])
