"""Two configs' whole train steps compiled in one process and timed in alternating rounds
(ABBA ..., ``--calls`` steps a side a round), each side stepping its own donated state: their
generated tokens/s and the ratio A ÷ B. Separate benchmark.py processes drift by more than a
few per cent on a shared machine (the plain exhaustive step has run at two speed levels,
0.61-0.64 and 0.77-0.82 s, whatever the checkout), and a ratio of two such processes moves
with them; in one process, with the rounds interleaved, both sides see the same machine.

  # issue 15's exhaustive ÷ sampled generated tokens/s, the plain config's two modes
  python experiments/modes_ab.py --config=configs/shakespeare.py \\
      --other=configs/shakespeare.py:sampled

Both configs must agree on ``cpu_buffers`` (host memory is set once, before jax starts).
Prints each side's median step and tokens/s, the ratio and its range over the round pairs,
then the JSON record (each round pair's ratio, and the steps each side's state has taken).
"""

import json
import statistics

from absl import app, flags
from measure import alternate, build_step, configure_host, stepping_round, time_train_step
from ml_collections import config_flags

FLAGS = flags.FLAGS
config_flags.DEFINE_config_file("config", None, "Side A's config file (path[:variant,...]).")
config_flags.DEFINE_config_file("other", None, "Side B's config file (path[:variant,...]).")
flags.DEFINE_integer("warmup", 2, "Untimed steps a side after compilation.", lower_bound=0)
flags.DEFINE_integer(
    "rounds", 8, "Alternating rounds (A then B, then B then A, ...).", lower_bound=1
)
flags.DEFINE_integer("calls", 3, "Timed steps of each side per round.", lower_bound=1)


def side(config) -> dict:
    """One side: its compiled donating step (measure.time_train_step, with --warmup untimed
    steps), state, inputs and tokens per step."""
    task, _, jstep, state, inputs, _, _ = build_step(config)
    compiled, state, _, compile_s, _ = time_train_step(jstep, state, inputs, FLAGS.warmup, 0)
    run = compiled if compiled is not None else jstep
    return dict(
        run=run, state=state, inputs=inputs, tokens=task.tokens_per_step, compile_s=compile_s
    )


def main(_):
    a, b = FLAGS.config, FLAGS.other
    if a is None or b is None:
        raise SystemExit("error: pass both --config=FILE[:variants] and --other=FILE[:variants]")
    if a.get("cpu_buffers") != b.get("cpu_buffers"):
        raise SystemExit(
            f"error: cpu_buffers differ ({a.get('cpu_buffers')} against "
            f"{b.get('cpu_buffers')}): set --other.cpu_buffers={a.get('cpu_buffers')}"
        )
    configure_host(a)
    sides = {"A": side(a), "B": side(b)}
    rounds = {name: stepping_round(s, FLAGS.calls) for name, s in sides.items()}
    times = alternate(rounds, FLAGS.rounds)
    record = {"rounds": FLAGS.rounds, "calls": FLAGS.calls, "sides": {}}
    for name, s in sides.items():
        med = statistics.median(times[name])
        tps = s["tokens"] / med
        record["sides"][name] = dict(
            tokens_per_step=s["tokens"], median_step_s=med, min_step_s=min(times[name]),
            tokens_per_s=tps, compile_s=s["compile_s"], times_s=times[name],
            state_steps=int(s["state"].step),
        )  # fmt: skip
        print(f"{name}: median {med:.4f} s, min {min(times[name]):.4f} s, {tps:.0f} tokens/s")
    # each round pair's ratio (A and B timed next to each other) shows the spread
    n = FLAGS.calls
    pairs = [
        (sides["A"]["tokens"] / statistics.median(times["A"][i : i + n]))
        / (sides["B"]["tokens"] / statistics.median(times["B"][i : i + n]))
        for i in range(0, len(times["A"]), n)
    ]
    record["ratio"] = record["sides"]["A"]["tokens_per_s"] / record["sides"]["B"]["tokens_per_s"]
    record["round_ratios"] = pairs
    print(
        f"A ÷ B tokens/s {record['ratio']:.3f} (rounds {min(pairs):.3f} to {max(pairs):.3f}, "
        f"{len(times['A'])} steps a side)"
    )
    print(json.dumps(record))


if __name__ == "__main__":
    app.run(main)
