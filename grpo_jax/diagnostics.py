"""Training diagnostics from the GRPO training guide, available to every task.

``Monitor.update(step, metrics)`` returns warning lines (the trainer logs them):
  * the KL to the reference exceeds ``diagnostics.kl_bound``;
  * the group reward std stays below ``reward_std_low`` (or above ``reward_std_high``) for
    ``patience`` consecutive logged steps, with the likely causes;
  * the reward rises while a held-out metric falls by more than ``heldout_min_drop`` between
    two evaluations (reward hacking). The tolerance keeps evaluation noise from crying wolf:
    an accuracy near 30 % over 1,024 windows × 70 chars has a binomial standard error of
    0.17 points, more where a window's chars are correlated.
"""


class Monitor:
    """``heldout_key``: the task's held-out metric for the reward-hacking check (the task names
    it, Task.heldout_key; "" disables the check)."""

    def __init__(self, diag_cfg, heldout_key: str = ""):
        self.cfg = diag_cfg
        self.heldout_key = heldout_key
        self.low = self.high = self.kl_over = 0
        self.prev_eval = None  # (reward, held-out value) at the previous evaluation
        self.reward = None

    def update(self, step: int, metrics: dict) -> list[str]:
        c, out = self.cfg, []
        kl = metrics.get("kl")
        if kl is not None:
            self.kl_over = self.kl_over + 1 if kl > c.kl_bound else 0
        if kl is not None and self.kl_over > 0 and (self.kl_over - 1) % c.patience == 0:
            # the first crossing, then every `patience` logged steps while it stays above
            out.append(
                f"step {step}: kl={kl:.4f} exceeds diagnostics.kl_bound={c.kl_bound}; "
                "the policy drifts from the reference: raise grpo.beta or lower the learning rate"
            )
        std = metrics.get("reward_std")
        if std is not None:
            self.reward = metrics.get("reward", self.reward)
            self.low = self.low + 1 if std < c.reward_std_low else 0
            self.high = self.high + 1 if std > c.reward_std_high else 0
            if self.low == c.patience:
                out.append(
                    f"step {step}: group reward std < {c.reward_std_low} for {c.patience} logged "
                    "steps: little signal per group. Likely causes: temperature too low, "
                    "verifier too strict or too loose, groups too small"
                )
            if self.high == c.patience:
                out.append(
                    f"step {step}: group reward std > {c.reward_std_high} for {c.patience} logged "
                    "steps: noisy rewards; check the reward scale or use larger groups"
                )
        key = self.heldout_key
        if key and key in metrics and self.reward is not None:
            if self.prev_eval is not None:
                r0, h0 = self.prev_eval
                if self.reward > r0 and metrics[key] < h0 - c.heldout_min_drop:
                    out.append(
                        f"step {step}: reward rose ({r0:.4f} -> {self.reward:.4f}) while "
                        f"{key} fell ({h0:.4f} -> {metrics[key]:.4f}): possible reward hacking"
                    )
            self.prev_eval = (self.reward, metrics[key])
        return out
