"""What a task gives the trainer: the one interface between a task plug-in and the host loop.

A task (grpo_jax/tasks/) builds its prompts, tokenizer, model, reward terms and evaluation
from its config and returns a ``Task``. The trainer jits ``build``'s step once (an
engine.Step for GRPO, a plain step function for supervised modes), feeds it ``inputs`` and
calls ``evaluate`` and the host ``hooks`` at its cadences; it never names a task.
"""

from collections.abc import Callable
from typing import Any, NamedTuple


class Hooks(NamedTuple):
    """Host-side extras of a task, called by the trainer on process 0 only.

    on_step(workdir, step, metrics): after every step, with that step's metrics (device
      arrays: pull only what is needed, e.g. a [V] vector to accumulate);
    on_end(workdir): after the last step (e.g. draw a figure from what on_step wrote)."""

    on_step: Callable | None = None
    on_end: Callable | None = None


class Task(NamedTuple):
    """Everything the trainer needs; ``build``'s step and ``evaluate``'s core are pure."""

    init_params: Callable[[Any], Any]  # key -> params (before init_from)
    make_state: Callable[[Any], Any]  # params -> fresh TrainState
    build: Callable[..., tuple[Any, Any]]  # (initial params, mesh=None) -> (step, inputs)
    evaluate: Callable[[Any], tuple[dict, dict]]  # params -> (scalars, {"samples": text, ...})
    tokens_per_step: int  # generated (or supervised) tokens per step, for tokens_per_s
    num_steps: int
    vocab: Any  # the task's tokenizer (decode) or None
    hooks: Hooks = Hooks()
    log_keys: tuple = ()  # the task's headline metrics for the progress line
    heldout_key: str = ""  # the held-out metric the reward-hacking diagnostic watches
    data_sha256: str = ""  # sha256 of the data file read (checkpoints record it), "" for none
    # ((name, text), ...) the run keeps in its workdir, e.g. a trained tokenizer.json: written
    # once the run goes ahead, when absent (a resume built its task from them)
    files: tuple = ()
    # the setting whose rows (prompts, windows) build's step splits over a mesh's data axis
    batch_setting: str = "train.batch_size"
