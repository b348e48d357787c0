"""Supervised next-char pretraining of the policy model: the baseline GRPO is compared with,
and an initialisation for it (``init_from``). Same TrainState and trainer as GRPO."""

import jax
import jax.numpy as jnp
import optax

from grpo_jax import data as data_lib
from grpo_jax.train_step import StepInputs, TrainState, supervised_update


def seq_len(config, max_len: int) -> int:
    """Supervised window length: ``pretrain.seq_len``, or the model's whole window when 0."""
    return int(config.pretrain.seq_len) or int(max_len)


def make_pretrain_step(config, model, tx, schedule):
    """Returns step(state, inputs) -> (state, metrics): one AdamW step on a random batch."""
    b, seq = config.pretrain.batch_size, seq_len(config, model.max_len)

    def loss_fn(params, inputs, labels, dropout_key):
        logits = model.apply(
            {"params": params}, inputs, deterministic=False, rngs={"dropout": dropout_key}
        )
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
        acc = jnp.mean((jnp.argmax(logits, -1) == labels).astype(jnp.float32))
        return loss, acc

    def step(state: TrainState, inputs: StepInputs):
        key = jax.random.fold_in(state.rng, state.step)
        k_data, k_drop = jax.random.split(key)
        x, y = data_lib.lm_batch(k_data, inputs.train_tokens, b, seq)
        (loss, acc), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params, x, y, k_drop)
        return supervised_update(state, loss, grads, tx, schedule, train_accuracy=acc)

    return step
