"""One half of the GRPO step (``--half``: the rollout or the update) compiled twice in one
process, as the checkout has it (A) and with one module attribute swapped before tracing (B),
then timed in alternating rounds (ABBA ..., ``--calls`` calls a side a round) on the same
state and batch. One process, one state and interleaved calls take out what moves separate
benchmark.py processes by several per cent on a shared machine (their medians drift run to
run), so a change of a few per cent in one half can be seen.

  # the dense layers' CPU weight gradient (products.dense_dot) against autodiff's
  python experiments/half_ab.py --config=configs/shakespeare.py --half=update \\
      --swap=grpo_jax.model.dense_dot=jax.lax.dot_general

The swap replaces the attribute (``module.name=module.name``: the replacement is imported
too) and clears jax's caches, so the second trace reads it. Prints each side's median and
minimum and the ratio A/B of the medians, and says so when the swap left the compiled half
as it was (``same_program``: then nothing was compared); the last line is the JSON record.
"""

import importlib
import json
import statistics
import time

import jax
from absl import app, flags
from measure import build_step, canonical_hlo, configure_host
from ml_collections import config_flags

FLAGS = flags.FLAGS
config_flags.DEFINE_config_file("config", None, "Config file (path[:variant,...]).")
flags.DEFINE_enum("half", "update", ["rollout", "update"], "Which half of the step to time.")
flags.DEFINE_string("swap", None, "module.attr=module.attr: B's replacement.", required=True)
flags.DEFINE_integer("rounds", 12, "Alternating rounds (A then B, then B then A, ...).")
flags.DEFINE_integer("calls", 3, "Timed calls of each side per round.")


def resolve(dotted: str):
    """(module, attribute name) of ``package.module.attr``, which must exist."""
    module, _, name = dotted.rpartition(".")
    try:
        mod = importlib.import_module(module)
    except ImportError as e:
        raise SystemExit(f"error: --swap: cannot import {module!r} ({e})") from None
    if not hasattr(mod, name):
        raise SystemExit(f"error: --swap: {module} has no attribute {name!r}")
    return mod, name


def compile_half(step, state, inputs, batch, host):
    """(the half compiled, its arguments)."""
    if FLAGS.half == "rollout":
        return jax.jit(step.rollout).lower(state, inputs).compile(), (state, inputs)
    args = (state, inputs, batch, host)
    return jax.jit(step.update).lower(*args).compile(), args


def main(_):
    target, _, replacement = FLAGS.swap.partition("=")
    if not replacement:
        raise SystemExit(f"error: --swap={FLAGS.swap}: write it as module.attr=module.attr")
    module, name = resolve(target)
    new = getattr(*resolve(replacement))
    configure_host(FLAGS.config)
    _, step, _, state, inputs, _, _ = build_step(FLAGS.config)
    batch = jax.block_until_ready(jax.jit(step.rollout)(state, inputs))
    host = None if step.host is None else step.host(batch)
    progs = {"A": compile_half(step, state, inputs, batch, host)}
    setattr(module, name, new)
    jax.clear_caches()  # the step's inner jits would otherwise reuse A's trace
    progs["B"] = compile_half(step, state, inputs, batch, host)
    same = canonical_hlo(progs["A"][0].as_text()) == canonical_hlo(progs["B"][0].as_text())
    if same:
        print(f"the swap left the compiled {FLAGS.half} as it was: A and B are one program")
    times = {"A": [], "B": []}
    for side in "AB":  # one untimed call each
        fn, args = progs[side]
        jax.block_until_ready(fn(*args))
    for r in range(FLAGS.rounds):
        for side in "AB" if r % 2 == 0 else "BA":
            fn, args = progs[side]
            for _ in range(FLAGS.calls):
                t0 = time.perf_counter()
                jax.block_until_ready(fn(*args))
                times[side].append(time.perf_counter() - t0)
    med = {side: statistics.median(t) for side, t in times.items()}
    for side in "AB":
        print(f"{side}: median {med[side]:.4f} s, min {min(times[side]):.4f} s")
    print(f"A/B {med['A'] / med['B']:.4f} ({FLAGS.half}, {len(times['A'])} calls a side)")
    record = {
        "half": FLAGS.half,
        "swap": FLAGS.swap,
        "times_s": times,
        "ratio": med["A"] / med["B"],
        "same_program": same,
    }
    print(json.dumps(record))


if __name__ == "__main__":
    app.run(main)
