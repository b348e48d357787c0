"""Equal-compute runs for experiments/exhaustive_vs_sampled.py (``--budget=wall:S|tokens:N``).

Every mode trains its seeds as one vmapped program (``sharding.make_multi_seed_step``) until
its budget is spent: ``wall:S`` gives each mode S seconds of training (the set of seeds
together; compilation and evaluations excluded), ``tokens:N`` gives each seed N generated
tokens. The budget is checked on the host between steps; the step itself is the library's
jitted step with nothing added but a running count of the generated tokens, so no host
sync happens inside it. Each mode is evaluated at the same fractions of the budget
(1/n, 2/n, ..., 1: the first step at which the spent amount reaches the fraction), plus the
initial policy at fraction 0.

A generated token is counted as the task counts it for its throughput figures
(``task.tokens_per_step``: B prompts x each group's members x the tokens each member
generates, per step and seed; the group mode's members from ``groups.py``), which is what a
step costs. ``generated_tokens`` (the engine's metric: the members that count, up to
EOS) is recorded beside it; the two differ for guided groups (masked candidate slots) and
for EOS-terminated tasks.

The learning-rate schedule spans each mode's own budget, as it spans a step-count run: for
a tokens budget ``train.num_steps`` is set to the steps the budget buys; for a wall budget
it is estimated from a few timed steps of a first compilation (the run still stops on the
clock, and the lr stays at its final value should it outlast the estimate).
"""

import dataclasses
import math
import shutil
import statistics
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from equal_compute_report import budget_summary

from grpo_jax import sharding, trainer
from grpo_jax.tasks import build_task

# the eval metrics the report shows by default, per task (the first one the tables lead with);
# a task not named here reports its held-out key (task.heldout_key)
DEFAULT_METRICS = {
    # next_token_accuracy: BPE vocabularies only (next_char_accuracy compares across them)
    "shakespeare": ("eval/next_char_accuracy", "eval/rollout_accuracy", "eval/next_token_accuracy"),
    "arithmetic": ("eval/accuracy", "eval/pass_at_1", "eval/pass_at_8"),
}
TRAIN_KEYS = ("loss", "reward", "kl", "entropy")  # the last step's figures at each eval point
CALIBRATION_STEPS = 10  # timed steps that estimate a wall budget's step count (schedule length)


class Budget(NamedTuple):
    kind: str  # "wall" (seconds of training, per mode) | "tokens" (generated, per seed)
    amount: float

    def reached(self, spent, i: int, n: int) -> bool:
        """Whether ``spent`` has reached the fraction i/n of the budget (exact for integer
        token counts: compared as spent * n >= amount * i)."""
        have = spent.seconds if self.kind == "wall" else spent.tokens
        return have * n >= self.amount * i

    def describe(self) -> str:
        if self.kind == "wall":
            return f"{self.amount:g} s of training per mode"
        return f"{int(self.amount):,} generated tokens per seed"


def parse_budget(text: str) -> Budget:
    """``wall:<seconds>`` or ``tokens:<n>`` (``tokens:2e6`` is fine); ValueError otherwise."""
    kind, _, value = text.partition(":")
    try:
        amount = float(value)
        amount = float(int(amount)) if kind == "tokens" else amount  # whole tokens
    except (ValueError, OverflowError):
        amount = -1.0
    if kind not in ("wall", "tokens") or not amount > 0 or not math.isfinite(amount):
        raise ValueError(f"--budget={text}: give wall:<seconds> or tokens:<n>, a positive number")
    return Budget(kind, amount)


@dataclasses.dataclass
class Spent:
    steps: int = 0
    seconds: float = 0.0
    tokens: int = 0


class Clock:
    """Training seconds: laps wait for the dispatched steps, and time between a lap and a
    ``restart`` (evaluations) is not counted."""

    def __init__(self):
        self.t = time.perf_counter()

    def lap(self, states) -> float:
        jax.block_until_ready(states)  # dispatch is asynchronous: wait for the work itself
        now = time.perf_counter()
        dt, self.t = now - self.t, now
        return dt

    def restart(self):
        self.t = time.perf_counter()


def shared_reference(params0, inputs) -> bool:
    """Whether the step's frozen reference is a params set (the initial policy's: the same
    tree as the params), i.e. one set all vmapped seeds would share."""
    ref = inputs.ref_state
    return ref is not None and jax.tree.structure(ref) == jax.tree.structure(params0)


def vmapped_setup(config, seeds, task):
    """(engine step, inputs, stacked states) for one mode's seeds in one program: each seed
    its own rng and init (or all load ``init_from``), exactly as separate runs would."""
    params0 = trainer.initial_params(config, task)
    step, inputs = task.build(params0)
    if step.host is not None:
        raise ValueError(
            "vmapped seeds need a step of jittable rewards only (one program): a Python reward "
            "is configured (arithmetic: use its :jax variant)"
        )
    if not config.init_from and shared_reference(params0, inputs):
        raise ValueError(
            "vmapped seeds with a policy reference need --config.init_from: the frozen "
            "reference is one params set shared by the seeds, not each seed's own init"
        )
    per_seed_init = None if config.init_from else task.init_params
    states = sharding.seed_states(task.make_state, params0, seeds, init_params=per_seed_init)
    return step, inputs, states


def compile_program(step, inputs, states):
    """The vmapped step, also adding each seed's generated_tokens to a running count (inside
    the one program: nothing is read back per step). int32 is exact; the host empties it at
    every eval point, so it never holds more than one eval interval's tokens. Returns
    (compiled, compile seconds)."""
    multi = sharding.make_multi_seed_step(step.fused)

    def program(states, inputs, generated):
        states, metrics = multi(states, inputs)
        return states, metrics, generated + metrics["generated_tokens"].astype(jnp.int32)

    t0 = time.perf_counter()
    generated = jnp.zeros(states.step.shape, jnp.int32)
    compiled = jax.jit(program, donate_argnums=(0, 2)).lower(states, inputs, generated).compile()
    return compiled, time.perf_counter() - t0


def evaluate_seeds(eval_task, states) -> list[dict]:
    n = states.step.shape[0]
    return [eval_task.evaluate(sharding.unstack_state(states, i).params)[0] for i in range(n)]


def point(fraction, spent, generated, evals, metrics, i) -> dict:
    """One eval point of seed i: where in the budget it is, the eval, the last step's figures."""
    return {
        "fraction": fraction,
        "step": spent.steps,
        "seconds": spent.seconds,
        "tokens": spent.tokens,
        "generated_tokens": int(generated[i]),
        "eval": evals[i],
        "train": {k: float(metrics[k][i]) for k in TRAIN_KEYS if k in metrics},
    }


def train_to_budget(program, states, inputs, budget, tokens_per_step, eval_task, n_points):
    """Steps until the budget is spent; per seed the eval points at fractions 1/n .. 1.

    A wall budget waits for every step (the clock must see it done, as the trainer's
    per-step loss read does); a tokens budget is known on the host and waits only at the
    eval points. Returns (states, per-seed points, Spent)."""
    n = states.step.shape[0]
    spent, clock, points = Spent(), Clock(), [[] for _ in range(n)]
    generated, total = jnp.zeros(n, jnp.int32), np.zeros(n, np.int64)
    done = 0  # eval points taken
    while done < n_points:
        states, metrics, generated = program(states, inputs, generated)
        spent.steps += 1
        spent.tokens += tokens_per_step
        if budget.kind == "wall":
            spent.seconds += clock.lap(states)
        if not budget.reached(spent, done + 1, n_points):
            continue
        if budget.kind == "tokens":
            spent.seconds += clock.lap(states)
        host = jax.device_get({k: v for k, v in metrics.items() if v.ndim == 1})
        if not np.all(np.isfinite(host["loss"])):
            raise FloatingPointError(f"non-finite loss at step {spent.steps}: {host['loss']}")
        total += jax.device_get(generated)
        generated = jnp.zeros(n, jnp.int32)
        evals = evaluate_seeds(eval_task, states)
        while done < n_points and budget.reached(spent, done + 1, n_points):
            done += 1  # one step can reach several fractions: they share its evaluation
            for i in range(n):
                points[i].append(point(done / n_points, spent, total, evals, host, i))
        clock.restart()
    return states, points, spent


def schedule_steps(config, seeds, budget, tokens_per_step, n_points) -> tuple[int, dict]:
    """Steps for the lr schedule to span the budget, and how they were found: the steps a
    tokens budget buys, or those a few timed steps predict for a wall budget."""
    if budget.kind == "tokens":
        return math.ceil(budget.amount / tokens_per_step), {"schedule": "exact"}
    step, inputs, states = vmapped_setup(config, seeds, build_task(config, "train"))
    program, compile_s = compile_program(step, inputs, states)
    generated, clock, times = jnp.zeros(states.step.shape, jnp.int32), Clock(), []
    for _ in range(CALIBRATION_STEPS + 1):  # the first call is left out (allocations)
        states, _, generated = program(states, inputs, generated)
        times.append(clock.lap(states))
        if sum(times[1:]) > 0.05 * budget.amount:  # calibration must stay cheap
            break
    step_s = statistics.median(times[1:] or times)
    steps = max(n_points, round(budget.amount / step_s))
    return steps, {"schedule": "estimated", "calibration_step_s": step_s,
                   "calibration_compile_s": compile_s}  # fmt: skip


def run_mode(config, seeds, budget, eval_task, init_evals, n_points):
    """One mode's seeds trained to the budget: (per-seed records, its config, its info)."""
    config = config.copy_and_resolve_references()
    per_step = build_task(config, "train").tokens_per_step  # the library's own count
    steps, info = schedule_steps(config, seeds, budget, per_step, n_points)
    config.train.num_steps = steps  # the lr schedule spans the budget
    task = build_task(config, "train")
    step, inputs, states = vmapped_setup(config, seeds, task)
    program, compile_s = compile_program(step, inputs, states)
    _, points, spent = train_to_budget(
        program, states, inputs, budget, per_step, eval_task, n_points
    )
    info.update(
        schedule_steps=steps,
        compile_s=compile_s,
        tokens_per_step=per_step,
        **dataclasses.asdict(spent),
    )
    records = []
    for seed, pts in zip(seeds, points, strict=True):
        origin = {"fraction": 0.0, "step": 0, "seconds": 0.0, "tokens": 0,
                  "generated_tokens": 0, "eval": init_evals[seed], "train": {}}  # fmt: skip
        records.append({"seed": seed, "points": [origin, *pts], "final": pts[-1]["eval"]})
    return records, config, info


def pick_metrics(requested, config, scalars: dict, heldout_key: str) -> list[str]:
    """The metrics to report: the requested ones (each must be an eval scalar), else the
    task's defaults that its evaluation reports, else its held-out key."""
    if requested:
        missing = [k for k in requested if k not in scalars]
        if missing:
            raise ValueError(f"--metrics: {missing} not among the eval scalars {sorted(scalars)}")
        return list(requested)
    found = [k for k in DEFAULT_METRICS.get(config.task, ()) if k in scalars]
    return found or [heldout_key]


def initial_evals(config, seeds, eval_task) -> dict:
    """Each seed's initial policy evaluated (the same for every mode at a seed)."""
    out = {}
    for seed in seeds:
        c = config.copy_and_resolve_references()
        c.seed = seed
        out[seed] = eval_task.evaluate(trainer.initial_params(c, eval_task))[0]
    return out


def run_comparison(configs: dict, seeds, budget, n_points, requested_metrics=()):
    """Every mode of ``configs`` ({mode: its config}) trained to the same budget.

    Returns (runs {mode: per-seed records}, {mode: config as run}, {mode: info}, metrics)."""
    first = next(iter(configs.values()))
    eval_task = build_task(first, "train")  # one evaluation, compiled once, for every mode
    init_evals = initial_evals(first, seeds, eval_task)
    metrics = pick_metrics(requested_metrics, first, init_evals[seeds[0]], eval_task.heldout_key)
    runs, ran, infos = {}, {}, {}
    for mode, config in configs.items():
        print(f"[{mode} seeds {list(seeds)}] {budget.describe()}, vmapped", flush=True)
        runs[mode], ran[mode], infos[mode] = run_mode(
            config, seeds, budget, eval_task, init_evals, n_points
        )
        info = infos[mode]
        print(
            f"  {info['steps']} steps (schedule {info['schedule_steps']}), "
            f"{info['seconds']:.1f} s, {info['tokens']:,} tokens/seed; "
            + "; ".join(
                f"{k} " + " / ".join(f"{r['final'][k]:.4f}" for r in runs[mode]) for k in metrics
            ),
            flush=True,
        )
    return runs, ran, infos, metrics


def warm_start(config, root, fresh: bool) -> str:
    """The checkpoint every mode and seed starts from: ``init_from``, or, for a config with
    a supervised warm-up (``pretrain.before_train``, e.g. arithmetic), that warm-up run once
    in ``<root>/pretrain`` with the first seed (the trainer's own warm-up). "" for neither."""
    if config.init_from or not config.get("pretrain", {}).get("before_train", False):
        return config.init_from
    target = root / "pretrain"
    if fresh and target.exists():
        shutil.rmtree(target)
    print(f"[warm-up] supervised pretraining in {target}, shared by every mode and seed")
    return trainer.warm_up(config, root).init_from


def comparison_record(results, seeds, budget, n_points, meta: dict) -> dict:
    """The run's JSON: ``meta`` (device, command, overrides, note), this process's jax version
    (the report names it, not the rendering process's) and ``results`` of run_comparison,
    with the summary against the sampled mode (else the first mode)."""
    runs, ran, infos, metrics = results
    reference = "sampled" if "sampled" in runs else next(iter(runs))
    return {
        **meta,
        "jax": jax.__version__,
        "seeds": list(seeds),
        "seeds_parallel": True,
        "modes": list(runs),
        "budget": {
            "kind": budget.kind,
            "amount": budget.amount,
            "points": n_points,
            "text": budget.describe(),
        },
        "metrics": metrics,
        "reference_mode": reference,
        "configs": {m: c.to_dict() for m, c in ran.items()},
        "summary": budget_summary(runs, metrics, reference),
        "spent": infos,
        "runs": runs,
    }
