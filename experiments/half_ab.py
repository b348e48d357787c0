"""The halves of the GRPO step (``--halves``: rollout, update) each compiled twice in one
process, as the checkout has it (A) and with one module attribute swapped before tracing (B),
then timed in alternating rounds (ABBA ..., ``--calls`` calls a side a round) on the same
state and batch. One process, one state and interleaved calls take out what moves separate
benchmark.py processes by several per cent on a shared machine (their medians drift run to
run), so a change of a few per cent in one half can be seen.

  # the dense layers' CPU weight gradient (products.dense_dot) against autodiff's
  python experiments/half_ab.py --config=configs/shakespeare.py --halves=update \\
      --swap=grpo_jax.model.dense_dot=jax.lax.dot_general

Both halves compile on each side (measure.compile_halves, as benchmark.py's breakdown). The
swap replaces the attribute (``module.name=module.name``: the replacement is imported
too) and clears jax's caches, so that the second trace reads it. Per half: each side's median
and minimum and the ratio A/B of the medians, or, where the swap left the compiled half as it
was (``same_program``, measure.canonical_hlo: up to names and metadata), that nothing was
compared. The last line is the JSON record.
"""

import importlib
import json
import statistics

import jax
from absl import app, flags
from measure import alternate_calls, build_step, canonical_hlo, compile_halves, configure_host
from ml_collections import config_flags

FLAGS = flags.FLAGS
config_flags.DEFINE_config_file("config", None, "Config file (path[:variant,...]).")
flags.DEFINE_list("halves", ["update"], "The halves to compare: rollout, update or both.")
flags.DEFINE_string("swap", None, "module.attr=module.attr: B's replacement.", required=True)
flags.DEFINE_integer(
    "rounds", 12, "Alternating rounds (A then B, then B then A, ...).", lower_bound=1
)
flags.DEFINE_integer("calls", 3, "Timed calls of each side per round.", lower_bound=1)


def resolve(dotted: str):
    """(module, attribute name) of ``package.module.attr``, which must exist."""
    module, _, name = dotted.rpartition(".")
    if not module or not name:
        raise SystemExit(f"error: --swap: {dotted!r} is not module.attr")
    try:
        mod = importlib.import_module(module)
    except ImportError as e:
        raise SystemExit(f"error: --swap: cannot import {module!r} ({e})") from None
    if not hasattr(mod, name):
        raise SystemExit(f"error: --swap: {module} has no attribute {name!r}")
    return mod, name


def main(_):
    if not FLAGS.halves or set(FLAGS.halves) - {"rollout", "update"}:
        raise SystemExit(f"error: --halves={','.join(FLAGS.halves)}: rollout, update or both")
    target, _, replacement = FLAGS.swap.partition("=")
    module, name = resolve(target)
    new = getattr(*resolve(replacement))
    if not callable(new):
        raise SystemExit(f"error: --swap: {replacement} is not callable")
    configure_host(FLAGS.config)
    _, step, _, state, inputs, _, _ = build_step(FLAGS.config)
    shapes = jax.eval_shape(step.rollout, state, inputs)
    sides = {"A": compile_halves(step, state, inputs, shapes)}
    setattr(module, name, new)
    jax.clear_caches()  # the step's inner jits would otherwise reuse A's trace
    sides["B"] = compile_halves(step, state, inputs, shapes)
    batch = jax.block_until_ready(sides["A"][0](state, inputs))
    host = None if step.host is None else step.host(batch)
    args = {"rollout": (state, inputs), "update": (state, inputs, batch, host)}
    record = {"swap": FLAGS.swap, "halves": {}}
    for half in FLAGS.halves:
        i = ("rollout", "update").index(half)
        progs = {side: (sides[side][i], args[half]) for side in "AB"}
        texts = {side: canonical_hlo(fn.as_text()) for side, (fn, _) in progs.items()}
        if texts["A"] == texts["B"]:
            print(f"{half}: the swap left its compiled program as it was; nothing compared")
            record["halves"][half] = {"same_program": True}
            continue
        times = alternate_calls(progs, FLAGS.rounds, FLAGS.calls)
        med = {side: statistics.median(t) for side, t in times.items()}
        for side in "AB":
            print(f"{half} {side}: median {med[side]:.4f} s, min {min(times[side]):.4f} s")
        print(f"{half} A/B {med['A'] / med['B']:.4f} ({len(times['A'])} calls a side)")
        ratio = med["A"] / med["B"]
        record["halves"][half] = {"same_program": False, "times_s": times, "ratio": ratio}
    print(json.dumps(record))


if __name__ == "__main__":
    app.run(main)
