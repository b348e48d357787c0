"""The smallest config an engine test needs (group, grpo and train blocks), shared by the tests
that build the GRPO step directly (test_engine.py, test_single_step.py)."""

from ml_collections import ConfigDict


def engine_config(batch_size, group_size=4, mode="sampled", kl="k3", beta=0.0, scale="group",
                  mu=1, agg="sequence-mean-token-mean"):  # fmt: skip
    sampling = {"temperature": 1.0, "top_k": 0, "top_p": 1.0}
    cadence = dict.fromkeys(("log_every", "eval_every", "checkpoint_every"), 1)
    return ConfigDict(
        {
            "group": {"mode": mode, "size": group_size, **sampling},
            "grpo": {
                "beta": beta,
                "epsilon": 0.2,
                "epsilon_high": None,
                "kl_estimator": kl,
                "loss_agg": agg,
                "num_iterations": mu,
                "advantage_scale": scale,
                "entropy_coef": 0.0,
            },
            "train": {"batch_size": batch_size, "num_steps": 1, "keep_checkpoints": 1, **cadence},
        }
    )
