"""The packaged config grpo_jax/configs/arithmetic.py, kept loadable by path from a checkout:
`--config=configs/arithmetic.py[:variant]` is the same as `--config=arithmetic[:variant]`."""

from grpo_jax.configs.arithmetic import get_config  # noqa: F401
