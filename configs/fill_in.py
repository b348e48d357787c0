"""The packaged config grpo_jax/configs/fill_in.py, kept loadable by path from a checkout:
`--config=configs/fill_in.py[:variant]` is the same as `--config=fill_in[:variant]`."""

from grpo_jax.configs.fill_in import get_config  # noqa: F401
