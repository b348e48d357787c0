"""grpo_jax: Group Relative Policy Optimization (sampled and exhaustive groups) in JAX/Flax."""

from setuptools import find_packages, setup

setup(
    name="grpo_jax",
    version="0.1.0",
    description="GRPO with sampled and exhaustive (whole-vocabulary) groups, in JAX/Flax.",
    packages=find_packages(include=["grpo_jax", "grpo_jax.*"]),
    python_requires=">=3.10",
    install_requires=[
        "jax>=0.4.30",
        "flax>=0.8.5",
        "optax>=0.2.2",
        "orbax-checkpoint>=0.5.20",
        "chex>=0.1.86",
        "ml_collections>=0.1.1",
        "absl-py>=2.0",
        "numpy>=1.24",
        "tensorboardX>=2.6",
        "tqdm>=4.60",
        "matplotlib>=3.7",
    ],
    extras_require={
        "test": ["pytest>=7", "nbclient>=0.9", "nbformat>=5.9", "ipykernel>=6", "ruff>=0.4"],
        "wandb": ["wandb"],
    },
)
