"""The fill-in task's judge: a sequence scorer of real vs. corrupted windows.

Trained by ``--mode=train_judge`` (the common trainer, a supervised step) and then loaded,
frozen, as the reward of the fill-in GRPO run (``judge.checkpoint``).

Corruptions replace the chars of a random span (the same span distribution as the
generator's masks) by one of ``judge.corruptions``:
  random   uniform chars of the vocabulary
  unigram  chars drawn from the train split's char frequencies
  bigram   chars drawn left to right from the train split's bigram model P(c | previous char)
           (plausible spellings, blind to the right-hand context)
  swap     the chars at the same positions of another random train window (real text, wrong
           place: the judge must read the context, not only the chars)
  generator  the fill that a frozen supervised generator (``judge.negatives_from``, a
           ``--mode=pretrain`` workdir) samples for the masked span, at
           ``judge.negatives_temperature``: exactly the plausible-but-wrong chars that a GRPO
           run starting from that generator proposes (chars it gets right stay labelled real)
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
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp

from grpo_jax import checkpoint as ckpt_lib
from grpo_jax import data as data_lib
from grpo_jax import integrity
from grpo_jax.encoder import SCORE_HEAD, Encoder
from grpo_jax.sharding import unsharded
from grpo_jax.train_state import TrainState, supervised_update

CORRUPTIONS = ("random", "unigram", "bigram", "swap", "generator")


class CorruptionData(NamedTuple):
    """What the corruptions read (frozen step inputs, never trained)."""

    tokens: Any  # the train split [N] int32 (swap windows)
    log_unigram: Any  # [V] log char frequencies of the train split
    log_bigram: Any  # [V + 1, V] log P(next | previous); row V = the unigram (no previous)
    gen_params: Any = None  # the frozen generator's params (kind "generator"), or None


def parse_corruptions(spec: str, negatives_from: str | None = None) -> tuple:
    """``judge.corruptions`` as a tuple of kinds; a one-line ValueError on bad names, and
    (when ``negatives_from`` is given, i.e. the judge is being trained) on a "generator" kind
    without a generator or a generator without that kind."""
    kinds = tuple(k.strip() for k in spec.split(",") if k.strip())
    bad = [k for k in kinds if k not in CORRUPTIONS]
    if not kinds or bad:
        what = f"unknown corruption {bad[0]!r}; " if bad else ""
        raise ValueError(
            f"judge.corruptions={spec!r}: {what}name one or more of {', '.join(CORRUPTIONS)} "
            "(comma-separated)"
        )
    if len(set(kinds)) != len(kinds):
        raise ValueError(f"judge.corruptions={spec!r} names a kind twice")
    if negatives_from is None:
        return kinds
    if "generator" in kinds and not negatives_from:
        raise ValueError(
            "judge.corruptions includes 'generator', which needs judge.negatives_from=DIR "
            "(a --mode=pretrain workdir of this config); or drop 'generator'"
        )
    if negatives_from and "generator" not in kinds:
        raise ValueError(
            f"judge.negatives_from={negatives_from!r} is set but judge.corruptions="
            f"{spec!r} lacks 'generator'; add it or clear judge.negatives_from"
        )
    return kinds


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


def bigram_fill(key, windows, span, log_bigram):
    """Left-to-right bigram samples in ``span``: each masked char ~ P(· | the char before it,
    itself sampled when masked); a span at position 0 starts from the unigram (row V)."""
    b, length = windows.shape
    v = log_bigram.shape[1]
    keys = jax.random.split(key, length)

    def body(prev, xs):
        k, col, m = xs
        c = jax.random.categorical(k, log_bigram[prev])  # [B]
        out = jnp.where(m > 0, c, col).astype(jnp.int32)
        return out, out

    start = jnp.full((b,), v, jnp.int32)
    _, cols = jax.lax.scan(body, start, (keys, windows.T, span.T))
    return cols.T


def generator_fill(key, generator, gen_params, windows, span, mask_id: int, temperature=1.0):
    """The frozen generator's sampled fill of ``span`` (masked with ``mask_id``) [B, L]."""
    masked = jnp.where(span > 0, mask_id, windows).astype(jnp.int32)
    logits = generator.apply({"params": gen_params}, masked) / temperature  # [B, L, V]
    fill = jax.random.categorical(key, logits)
    return jnp.where(span > 0, fill, windows).astype(jnp.int32)


def corrupt(key, windows, span, data: CorruptionData, kinds, gen_fill=None):
    """Corrupted copies of ``windows`` [B, L] inside ``span`` [B, L].

    ``gen_fill(key, gen_params, windows, span) -> [B, L]`` samples kind "generator".
    Returns (corrupted [B, L], kind index [B], changed [B] bool)."""
    b, length = windows.shape
    v = data.log_unigram.shape[0]
    k_kind, k_rand, k_uni, k_swap, k_bi, k_gen = jax.random.split(key, 6)
    kind = jax.random.randint(k_kind, (b,), 0, len(kinds))
    options = {  # only the kinds in use are computed
        "random": lambda: jax.random.randint(k_rand, (b, length), 0, v),
        "unigram": lambda: jax.random.categorical(k_uni, data.log_unigram, shape=(b, length)),
        "bigram": lambda: bigram_fill(k_bi, windows, span, data.log_bigram),
        "swap": lambda: data_lib.random_windows(k_swap, data.tokens, b, length),
        "generator": lambda: gen_fill(k_gen, data.gen_params, windows, span),
    }
    stacked = jnp.stack([options[k]().astype(jnp.int32) for k in kinds])  # [K, B, L]
    repl = jnp.take_along_axis(stacked, kind[None, :, None], axis=0)[0]
    out = jnp.where(span > 0, repl, windows).astype(jnp.int32)
    return out, kind, jnp.any(out != windows, axis=-1)


def log_unigram_of(tokens, vocab_size: int):
    counts = np.bincount(np.asarray(tokens), minlength=vocab_size).astype(np.float64) + 1.0
    return jnp.asarray(np.log(counts / counts.sum()), jnp.float32)


def log_bigram_of(tokens, vocab_size: int, smoothing: float = 0.01):
    """[V + 1, V] log P(next | previous) of ``tokens`` (add-``smoothing``); row V is the
    unigram, the distribution of a char with no previous one."""
    t = np.asarray(tokens).astype(np.int64)
    counts = np.zeros((vocab_size + 1, vocab_size), np.float64)
    np.add.at(counts, (t[:-1], t[1:]), 1.0)
    counts[vocab_size] = np.bincount(t, minlength=vocab_size)
    counts += smoothing
    return jnp.asarray(np.log(counts / counts.sum(1, keepdims=True)), jnp.float32)


def window_logit(token_logits, params):
    """The window logit of encoder.py's score head from its per-char logits [..., L]."""
    return jnp.sum(jax.nn.log_sigmoid(token_logits), -1) + params["score_bias"]


def make_judge_step(
    config, model, tx, schedule, kinds, vocab_size, gen_fill=None, shard_batch=unsharded
):
    """Returns step(state, data: CorruptionData) -> (state, metrics): one BCE step (pure;
    jit it). ``gen_fill`` samples the "generator" corruption (see ``corrupt``);
    ``shard_batch`` (a mesh's StepHooks.shard_batch) splits the windows over the data axis."""
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

    def step(state: TrainState, data: CorruptionData):
        key = jax.random.fold_in(state.rng, state.step)
        k_win, k_span, k_cor = jax.random.split(key, 3)
        real = data_lib.random_windows(k_win, data.tokens, b, length)
        span = random_spans(k_span, b, length, d.span_min, d.span_max)
        real, span = shard_batch((real, span))  # the corruptions split over data too
        fake, _, _ = corrupt(k_cor, real, span, data, kinds, gen_fill)
        x = jnp.concatenate([real, fake])
        y = jnp.concatenate([jnp.ones_like(real), (fake == real)]).astype(jnp.float32)
        # [real; fake] re-split over data moves a few int windows between devices, and keeps
        # one device's summation order (and the committed fill-in figures) bit for bit
        x, y = shard_batch((x, y))
        (loss, acc), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params, x, y)
        return supervised_update(state, loss, grads, tx, schedule, train_accuracy=acc)

    return step


def make_judge_eval(config, model, val_windows, data: CorruptionData, kinds, seed, gen_fill=None):
    """Held-out real-vs-corrupted metrics on fixed windows (corrupted by the same kinds as in
    training, the generator's fills included); returns evaluate(params)."""
    d = config.data
    key = jax.random.PRNGKey(seed + 7919)
    k_span, k_cor = jax.random.split(key)
    real = jnp.asarray(val_windows)
    span = random_spans(k_span, real.shape[0], d.window_len, d.span_min, d.span_max)
    fake, kind, changed = corrupt(k_cor, real, span, data, kinds, gen_fill)
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
        return out, {"samples": text, "summary": ""}

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


def load_judge(config, model, vocab):
    """The frozen judge's params from ``judge.checkpoint``, trained on ``vocab`` (a judge of
    another corpus gives the same shapes, but its ids mean other characters); one-line
    ValueError otherwise."""
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
    try:
        return ckpt_lib.load_params(path, template["params"], integrity.run_identity(vocab))
    except ckpt_lib.CheckpointError as err:
        raise ValueError(
            f"judge.checkpoint={path!r}: {str(err).splitlines()[0]}; train a judge on this "
            "corpus with --mode=train_judge"
        ) from err
