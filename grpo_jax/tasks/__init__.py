"""Tasks as plug-ins: each module builds a ``Task`` (grpo_jax/task.py) from its config.

To add one, write ``grpo_jax/tasks/<name>.py`` with ``build(config, mode, workdir) -> Task``
(``workdir``: the run's, for what a task keeps there, e.g. a trained tokenizer; None outside
a run) and
register it below; its config file sets ``config.task = "<name>"``. The trainer and the GRPO
step know no task by name.
"""

from pathlib import Path

from grpo_jax.run_spec import RunSpec
from grpo_jax.tasks import arithmetic, fill_in, shakespeare, toy_bandit

TASKS = {
    "shakespeare": shakespeare.build,
    "toy_bandit": toy_bandit.build,
    "fill_in": fill_in.build,
    "arithmetic": arithmetic.build,
}


def build_task(config, mode: str = "train", workdir=None):
    """The task ``config.task`` names, built for ``mode`` in ``workdir`` (a path, or None: no
    run, nothing to load); an unknown name is one line."""
    if config.task not in TASKS:
        raise ValueError(f"task={config.task!r} is unknown; choose from {', '.join(TASKS)}")
    RunSpec.from_config(config)  # the shared settings; the task checks its own first thing
    path = Path(workdir).expanduser() if str(workdir or "").strip() else None
    return TASKS[config.task](config, mode, path)
