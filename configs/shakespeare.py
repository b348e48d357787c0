"""The packaged config grpo_jax/configs/shakespeare.py, kept loadable by path from a checkout:
`--config=configs/shakespeare.py[:variant]` is the same as `--config=shakespeare[:variant]`."""

from grpo_jax.configs.shakespeare import get_config  # noqa: F401
