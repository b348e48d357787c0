"""A trained char policy against the n-gram baselines on the same held-out predictions.

  GRPO_JAX_DATA=../shared/data/tinyshakespeare.txt python experiments/versus_ngram.py \
      --config=configs/shakespeare.py --workdir=runs/shakespeare

Scores the latest checkpoint of ``--workdir`` (its config's model, context C and horizon H)
twice: on the run's own eval windows (``eval.num_windows`` evenly spaced val windows, the
figures the run logged), and on the whole val split cut into windows of C + H chars at stride
H, so that every val char after the first C is predicted once from C or more chars of history.
For each n-gram order it prints both accuracies, their paired difference and its standard error
clustered by window (predictions inside a window are correlated), so "above the bigram" is a
measured statement about the same predictions.
"""

import numpy as np
from absl import app, flags
from ml_collections import config_flags

from grpo_jax import data, reference, trainer
from grpo_jax.model import make_model

_CONFIG = config_flags.DEFINE_config_file("config", "configs/shakespeare.py", "the run's config")
flags.DEFINE_string("workdir", "runs/shakespeare", "workdir whose latest checkpoint is scored")
flags.DEFINE_string("orders", "1,2,3", "n-gram orders to compare with")
FLAGS = flags.FLAGS


def policy_hits(model, params, context, target, batch=128):
    """bool [W, H]: the policy's teacher-forced argmax equals target."""
    full = np.concatenate([context, target], axis=1)
    c = context.shape[1]
    out = []
    for i in range(0, len(full), batch):
        logits = model.apply({"params": params}, full[i : i + batch, :-1])[:, c - 1 :]
        out.append(np.asarray(logits.argmax(-1)))
    return np.concatenate(out) == target


def compare(name, hits, baselines):
    print(f"{name}: {hits.size:,} predictions in {len(hits):,} windows")
    print(f"  policy            {100 * hits.mean():6.2f} %")
    for order, ref in baselines.items():
        d = hits.astype(np.float64) - ref
        se = d.mean(1).std(ddof=1) / np.sqrt(len(d))
        print(
            f"  {order}-gram {100 * ref.mean():6.2f} %   policy - {order}-gram "
            f"{100 * d.mean():+.2f} ± {100 * se:.2f} points (SE, clustered by window)"
        )


def main(_):
    config = _CONFIG.value
    params = trainer.restore_params(config, FLAGS.workdir)
    corpus = data.load_corpus(config.data)
    c, h = config.data.context_len, config.data.horizon
    model = make_model(config.model, corpus.vocab.size, config.model.max_len or c + h)
    val = np.asarray(corpus.val)
    n = (len(val) - c - h) // h + 1
    whole = val[np.arange(n)[:, None] * h + np.arange(c + h)]
    splits = {
        f"eval windows ({config.eval.num_windows})": data.eval_windows(
            val, config.eval.num_windows, c, h
        ),
        "whole val split": (whole[:, :c], whole[:, c:]),
    }
    lms = {
        int(k): reference.fit_ngram(corpus.train, corpus.vocab.size, int(k))
        for k in FLAGS.orders.split(",")
    }
    for name, (ctx, tgt) in splits.items():
        hits = policy_hits(model, params, ctx, tgt)
        compare(name, hits, {k: reference.window_hits(lm, ctx, tgt) for k, lm in lms.items()})


if __name__ == "__main__":
    app.run(main)
