"""grpo_jax: Group Relative Policy Optimization (sampled and exhaustive groups) in JAX/Flax.

The entry points are the ``grpo-jax`` console script (``grpo_jax.main``) and, from Python,
``grpo_jax.trainer.train_and_evaluate(config, workdir)`` with a config from
``grpo_jax.config_blocks.load_config(name, variant)``.
"""

__version__ = "0.2.0"
