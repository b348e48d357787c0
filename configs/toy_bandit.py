"""The packaged config grpo_jax/configs/toy_bandit.py, kept loadable by path from a checkout:
`--config=configs/toy_bandit.py[:variant]` is the same as `--config=toy_bandit[:variant]`."""

from grpo_jax.configs.toy_bandit import get_config  # noqa: F401
