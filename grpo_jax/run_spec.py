"""The settings every run shares beside the engine's, validated once like the engine's specs
(specs.py): the root seed, the host loop's cadences, reporting, the supervised warm-up's sizes
and the host's CPU buffers. tasks.build_task checks them for every task and mode before the
task reads its data; host.py reads ``cpu_buffers`` before jax starts.
"""

from __future__ import annotations

import dataclasses

from grpo_jax.specs import TrainSpec
from grpo_jax.validate import boolean, choice, integer, integers, number, require

CPU_BUFFERS = ("retain", "release")  # grpo_jax/host.py


def cpu_buffers(config) -> str:
    """``config.cpu_buffers`` (absent: "release", jax's and glibc's defaults); the process's
    entry point applies it (host.configure) before jax starts, ahead of the other checks."""
    return choice("cpu_buffers", config.get("cpu_buffers", "release"), CPU_BUFFERS)


@dataclasses.dataclass(frozen=True)
class ReportSpec:
    """How a run reports: the evaluation's shared fields, logging and diagnostics. Fields a
    task's config lacks take the default its code would use."""

    pass_k: tuple[int, ...]
    num_samples: int
    char_stats_every: int
    kl_bound: float
    patience: int

    @classmethod
    def from_config(cls, config) -> ReportSpec:
        e, lg, d = config.eval, config.logging, config.diagnostics
        for name in ("num_windows", "batch_size"):
            if name in e:
                integer(f"eval.{name}", e[name], 1)
        if "seed" in e:
            integer("eval.seed", e.seed)
        if "temperature" in e:
            number("eval.temperature", e.temperature, 0.0, open_low=True)
        if "ngram_baselines" in e:
            integers("eval.ngram_baselines", e.ngram_baselines, 1)
        for name in ("tensorboard", "wandb", "progress"):
            boolean(f"logging.{name}", lg[name])
        project = lg.get("wandb_project", "grpo_jax")
        require(
            isinstance(project, str) and project.strip(),
            "logging.wandb_project",
            project,
            "must be a non-empty project name",
        )
        low = number("diagnostics.reward_std_low", d.reward_std_low, 0.0)
        number("diagnostics.reward_std_high", d.reward_std_high, low, open_low=True)
        number("diagnostics.heldout_min_drop", d.heldout_min_drop, 0.0)
        return cls(
            pass_k=integers("eval.pass_k", e.get("pass_k", ()), 1),
            num_samples=integer("eval.num_samples", e.get("num_samples", 0)),
            char_stats_every=integer("logging.char_stats_every", lg.get("char_stats_every", 0)),
            kl_bound=number("diagnostics.kl_bound", d.kl_bound, 0.0, open_low=True),
            patience=integer("diagnostics.patience", d.patience, 1),
        )


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """The settings every task shares beside the engine's: the root seed, the host loop's
    cadences, reporting and the supervised warm-up's sizes. tasks.build_task checks them for
    every task and mode before the task reads its data."""

    seed: int
    train: TrainSpec
    report: ReportSpec
    cpu_buffers: str

    @classmethod
    def from_config(cls, config) -> RunSpec:
        require(
            isinstance(config.get("init_from", ""), str),
            "init_from",
            config.init_from,
            "must be a workdir path or ''",
        )
        boolean("distributed", config.get("distributed", False))
        if "pretrain" in config:
            p = config.pretrain
            integer("pretrain.batch_size", p.batch_size, 1)
            integer("pretrain.num_steps", p.num_steps)
            integer("pretrain.seq_len", p.get("seq_len", 0))
            number("pretrain.learning_rate", p.learning_rate, 0.0, open_low=True)
            boolean("pretrain.before_train", p.get("before_train", False))
        return cls(
            seed=integer("seed", config.seed),
            train=TrainSpec.from_config(config.train),
            report=ReportSpec.from_config(config),
            cpu_buffers=cpu_buffers(config),
        )
