"""The CPU roofline of the GRPO step, before and after a change, in one run.

For each workload below, ``experiments/benchmark.py`` runs in a fresh process on this
checkout and (``--before=DIR``) on another checkout of the package (its ``grpo_jax`` first on
PYTHONPATH, this checkout's benchmark script), alternating A B A B over ``--rounds``. Each run
reports its step time and its roofline (benchmark.roofline: matmul FLOPs counted through the
traced program, XLA's cost analysis, the machine's matmul peak at the model's shapes).

  git worktree add /tmp/before c2b650e          # the tree before the host-memory change
  GRPO_JAX_DATA=/work/shared/data/tinyshakespeare.txt python experiments/roofline.py \\
      --before=/tmp/before --release_side --rounds=3 --matmul_floor

``--matmul_floor`` adds one run per workload on this checkout that also times every distinct
matmul of the step alone at its own shape (benchmark.py --matmul_floor): how much of the step's
time its matmuls need at the rates those shapes allow, apart from everything else.

``--before_python=PY`` runs the 'before' side in another interpreter (a venv with another
jax; with no ``--before``, on this checkout): what the installed packages alone change.

  /tmp/venv_jax012/bin/python experiments/roofline.py \\
      --before_python=/usr/bin/python3.11 --rounds=3 --matmul_floor --name=roofline_jax012

``--release_side`` adds a third side, this checkout with ``--config.cpu_buffers=release``
(jax's and glibc's memory defaults, as every earlier checkout ran): the code's own changes
apart from the host-memory setting (grpo_jax/host.py).

Workloads: ``trl_step`` (the TRL-comparable step: 8 prompts x G = 8, context 100, horizon 70,
mu = 1, beta = 0.04, k3 to the frozen initial policy, reward match), ``exhaustive`` and
``sampled`` (the plain config's own modes, B = 2, mu = 2, exact forward KL to the trigram,
whose generated tokens/s ratio the issue tracks). Writes ``--out_dir/<name>.json`` and ``.md``.
"""

import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

from absl import app, flags
from trl_grpo import cpu_name  # stdlib-only at import

FLAGS = flags.FLAGS
flags.DEFINE_string("before", "", "Another checkout whose grpo_jax is the 'before' side.")
flags.DEFINE_string(
    "before_python",
    "",
    "The 'before' side's interpreter (another venv: another jax); without --before, that side "
    "runs this checkout, so the two sides differ in their packages alone.",
)
flags.DEFINE_integer("rounds", 2, "Alternating rounds per workload.", lower_bound=1)
flags.DEFINE_string("out_dir", "experiments/results", "Where the JSON and markdown go.")
flags.DEFINE_string("name", "roofline_cpu", "Basename of the results files.")
flags.DEFINE_bool(
    "release_side",
    False,
    "Also run this checkout with --config.cpu_buffers=release (side 'after, release'): "
    "the code's changes apart from the host memory setting (grpo_jax/host.py).",
)

flags.DEFINE_bool(
    "matmul_floor",
    False,
    "Also, once per workload on this checkout, time every distinct matmul of the step alone "
    "at its own shape (benchmark.py --matmul_floor): the step's time if everything but its "
    "matmuls were free.",
)

HERE = Path(__file__).resolve().parent
TRL_STEP = (
    "--config=configs/shakespeare.py:sampled --config.group.size=8 "
    "--config.reference.kind=policy --config.grpo.kl_estimator=k3 --config.reward.terms=match "
    "--config.grpo.beta=0.04 --config.train.batch_size=8 --config.grpo.num_iterations=1 "
    "--steps=7 --warmup=2"
)
WORKLOADS = {
    "trl_step": TRL_STEP,
    "exhaustive": "--config=configs/shakespeare.py --steps=4 --warmup=1",
    "sampled": "--config=configs/shakespeare.py:sampled --steps=9 --warmup=2",
}


def bench(args: str, side: tuple[str, str, str]) -> dict:
    """One benchmark.py process on side (PYTHONPATH, extra flags, interpreter); its last line
    is the JSON result."""
    pythonpath, extra, python = side
    env = {**os.environ, "PYTHONPATH": pythonpath}
    cmd = [python, str(HERE / "benchmark.py"), *args.split(), *extra.split()]
    cmd.append("--breakdown_runs=1")
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def summary(rows: list[dict]) -> dict:
    """Medians over the rounds of one workload on one side."""
    med = lambda f: statistics.median(f(r) for r in rows)
    roof = lambda key: med(lambda r: r["roofline"][key])
    return {
        "step_s": med(lambda r: r["median_step_s"]),
        "tokens_per_s": med(lambda r: r["tokens_per_s"]),
        "matmul_gflop": roof("matmul_flops") / 1e9,
        "xla_gflop": roof("xla_flops") / 1e9,
        "achieved_gflops": roof("achieved_gflops"),
        "peak_gflops": roof("matmul_peak_gflops"),
        "fraction_of_peak": roof("fraction_of_peak"),
        "rounds_step_s": [r["median_step_s"] for r in rows],
    }


def matmul_floor(args: str, side: tuple[str, str, str], step_s: float) -> dict:
    """One more benchmark.py run with --matmul_floor: its floor and peak, and the floor's share
    of ``step_s`` (the side's median step time over the rounds)."""
    roof = bench(f"{args} --matmul_floor", side)["roofline"]
    out = {k: roof[k] for k in ("distinct_matmuls", "matmul_floor_s", "floor_gflops")}
    return {
        **out,
        "peak_gflops": roof["matmul_peak_gflops"],
        "share_of_step": out["matmul_floor_s"] / step_s,
    }


def described(side: tuple[str, str, str]) -> str:
    """A side as the record names it: PYTHONPATH, extra flags, another interpreter if any."""
    pythonpath, extra, python = side
    other = f"with {python}" if python != sys.executable else ""
    return " ".join(filter(None, (pythonpath, extra, other)))


def jax_versions(res: dict) -> str:
    """The jax the runs used: one version, or each side's where they differ (--before_python).
    A record without side_jax names the jax of the roofline.py process that wrote it."""
    by_side = res.get("side_jax", {})
    if len({v for vs in by_side.values() for v in vs}) <= 1:
        return f"jax {res['jax']}"
    return "jax by side: " + ", ".join(f"{s} {'/'.join(v)}" for s, v in by_side.items())


def markdown(res: dict) -> str:
    lines = [
        f"# CPU roofline of the GRPO step ({res['name']})",
        "",
        f"Measured {res['date']} on {res['host']}; {jax_versions(res)}; float32; "
        f"{res['rounds']} alternating rounds per workload (medians). Command: `{res['command']}`.",
        "",
        "Sides: "
        + "; ".join(f"{name}: `{where}`" for name, where in res["sides"].items())
        + " (PYTHONPATH, then extra benchmark.py flags).",
        "",
        "| workload | side | s/step | generated tokens/s | matmul GFLOP | XLA GFLOP (loops once) "
        "| achieved GFLOP/s | matmul peak GFLOP/s | of peak |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for w, sides in res["workloads"].items():
        for side, s in sides.items():
            lines.append(
                f"| {w} | {side} | {s['step_s']:.4f} | {s['tokens_per_s']:,.0f} | "
                f"{s['matmul_gflop']:.2f} | {s['xla_gflop']:.2f} | {s['achieved_gflops']:.1f} | "
                f"{s['peak_gflops']:.1f} | {100 * s['fraction_of_peak']:.0f} % |"
            )
    if res.get("matmul_floor"):
        lines += [
            "",
            "Matmul floor (this checkout, one more run per workload, `benchmark.py "
            "--matmul_floor`): every distinct matmul of the step timed alone at its own shape, "
            "times how often the step runs it; the step's time if all else were free.",
            "",
            "| workload | distinct matmuls | floor s/step | floor GFLOP/s | of peak | of the "
            "step's time (after) |",
            "| --- | --- | --- | --- | --- | --- |",
        ]
        for w, f in res["matmul_floor"].items():
            lines.append(
                f"| {w} | {f['distinct_matmuls']} | {f['matmul_floor_s']:.4f} | "
                f"{f['floor_gflops']:.1f} | {100 * f['floor_gflops'] / f['peak_gflops']:.0f} % | "
                f"{100 * f['share_of_step']:.0f} % |"
            )
    lines += ["", "Exhaustive ÷ sampled generated tokens/s (the plain config's two modes):", ""]
    for side, ratio in res["exhaustive_over_sampled"].items():
        lines.append(f"- {side}: {ratio:.2f}x")
    lines += ["", res["note"], ""]
    return "\n".join(lines)


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    import jax

    root = str(HERE.parent)
    sides = {"after": (root, "", sys.executable)}
    if FLAGS.before or FLAGS.before_python:
        before = str(Path(FLAGS.before).resolve()) if FLAGS.before else root
        sides = {"before": (before, "", FLAGS.before_python or sys.executable), **sides}
    if FLAGS.release_side:
        sides["after, release"] = (root, "--config.cpu_buffers=release", sys.executable)
    raw = {w: {s: [] for s in sides} for w in WORKLOADS}
    for w, args in WORKLOADS.items():
        for _ in range(FLAGS.rounds):
            for side, where in sides.items():
                raw[w][side].append(bench(args, where))
                print(w, side, f"{raw[w][side][-1]['median_step_s']:.4f} s/step", flush=True)
    workloads = {w: {s: summary(rows) for s, rows in by.items()} for w, by in raw.items()}
    floors = {}
    if FLAGS.matmul_floor:
        for w, args in WORKLOADS.items():
            floors[w] = matmul_floor(args, sides["after"], workloads[w]["after"]["step_s"])
    ratio = {
        s: workloads["exhaustive"][s]["tokens_per_s"] / workloads["sampled"][s]["tokens_per_s"]
        for s in sides
    }
    res = {
        "name": FLAGS.name,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "host": f"{cpu_name()}, {platform.machine()}, {os.cpu_count()} CPUs",
        "jax": jax.__version__,
        "rounds": FLAGS.rounds,
        "command": " ".join(["python experiments/roofline.py", *sys.argv[1:]]),
        "sides": {name: described(side) for name, side in sides.items()},
        "side_jax": {s: sorted({r["jax"] for w in raw for r in raw[w][s]}) for s in sides},
        "workloads": workloads,
        "exhaustive_over_sampled": ratio,
        "matmul_floor": floors,
        "raw": raw,
        "note": (
            "matmul GFLOP: every dot_general the step executes (scan bodies times their "
            "length, the backward pass included; flop_count.step_flops). XLA's cost analysis "
            "counts a loop body once, so it undercounts a step with a decode loop. The peak "
            "is the best of this machine's matmuls at the model's own shapes "
            "(measure.matmul_peak: one call of 8 plain matmuls, nothing else in it, best of "
            "20 calls), measured in the same process."
        ),
    }
    out = Path(FLAGS.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{FLAGS.name}.json").write_text(json.dumps(res, indent=1) + "\n")
    (out / f"{FLAGS.name}.md").write_text(markdown(res))
    print(markdown(res))


if __name__ == "__main__":
    app.run(main)
