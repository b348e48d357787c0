"""The packaged configs, loadable by name: ``--config=shakespeare:sampled`` (the CLI) or
``config_blocks.load_config("shakespeare", "sampled")`` (Python). Each file's ``get_config(arg)``
takes comma-separated variant tokens, listed in its docstring; from a checkout a config is also
loadable by path (``--config=grpo_jax/configs/shakespeare.py:sampled``)."""
