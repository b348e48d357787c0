"""Supervised steps for the policy model: the baselines GRPO is compared with, and its
initialisation (``init_from``, or a task's warm-up). Same TrainState and trainer as GRPO.

  make_pretrain_step            next-token cross-entropy on random corpus windows
  make_completion_sft_step      cross-entropy on a task's reference completions given their
                                prompts, through the policy's own training forward (the
                                same left-padded prompts and masks GRPO samples with)
"""

import jax
import jax.numpy as jnp
import optax

from grpo_jax import data as data_lib
from grpo_jax import objective
from grpo_jax.policy import token_logits
from grpo_jax.sharding import unsharded
from grpo_jax.train_state import StepInputs, TrainState, supervised_update


def seq_len(config, max_len: int) -> int:
    """Supervised window length: ``pretrain.seq_len``, or the model's whole window when 0."""
    return int(config.pretrain.seq_len) or int(max_len)


def make_pretrain_step(config, model, tx, schedule, shard_batch=unsharded):
    """Returns step(state, inputs) -> (state, metrics): one AdamW step on a random batch.

    ``shard_batch`` (sharding.StepHooks.shard_batch on a mesh) splits the batch's rows over
    the data axis, as the GRPO step's prompts; without it every device ran the whole batch."""
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
        x, y = shard_batch(data_lib.lm_batch(k_data, inputs.data, b, seq))
        (loss, acc), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params, x, y, k_drop)
        return supervised_update(state, loss, grads, tx, schedule, train_accuracy=acc)

    return step


def make_completion_sft_step(policy, tx, schedule, sample_batch, shard_batch=unsharded):
    """Returns step(state, inputs) -> (state, metrics).

    ``sample_batch(key, data) -> (prompts, tokens [B, T], mask [B, T])``: prompts and their
    reference completions (e.g. the answer then EOS). The loss is the token-mean
    cross-entropy over the completion's real tokens; ``train_accuracy`` is the share of
    completions whose every token is the argmax (what greedy decoding would reproduce).
    ``shard_batch``: as make_pretrain_step's."""

    def loss_fn(params, prompts, tokens, mask):
        _, logits = token_logits(policy, params, prompts, tokens[:, None])
        logits, lp = logits[:, 0], jax.nn.log_softmax(logits[:, 0], -1)
        nll = -jnp.take_along_axis(lp, tokens[..., None], -1)[..., 0]
        hit = (jnp.argmax(logits, -1) == tokens) | (mask == 0)
        return objective.aggregate(nll, mask, "token-mean"), jnp.mean(jnp.all(hit, -1))

    def step(state: TrainState, inputs: StepInputs):
        key = jax.random.fold_in(state.rng, state.step)
        prompts, tokens, mask = shard_batch(sample_batch(key, inputs.data))
        grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
        (loss, acc), grads = grad_fn(state.params, prompts, tokens, mask)
        return supervised_update(state, loss, grads, tx, schedule, train_accuracy=acc)

    return step
