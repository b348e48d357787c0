"""The exhaustive-GRPO guide's scaling table: iteration time and peak memory vs vocabulary V.

One exhaustive GRPO train step (group = all V first tokens, each continued for horizon - 1
sampled tokens; the whole step jitted once, state donated) for a model with vocabulary V on
synthetic data: ``train_tokens`` is a random int32 array in [0, V), the reward is ``match``
(per-char agreement with the window's true continuation), and there is NO reference model
(``reference=None``), so the step has no KL term at all (no exact KL over V, no reference
log-probs): the figures are rollout + reward + policy gradient + optimizer update only.
``group.vocab_chunk`` bounds both the rollout and the loss's training forward over the
continuations (members in chunks, rematerialised in the backward pass; see loss.py).
The model is the plain config's (4 layers, 4 heads, width 128 unless overridden), B=8,
context 100, horizon 70. ``group.vocab_chunk`` per V comes from ``--chunk_for_v`` (V not
listed: 0 = all V actions at once).

Each V runs in its own subprocess, so the process peak RSS is that V's own. Memory: on GPU
``device.memory_stats()["peak_bytes_in_use"]``; on CPU the step executable's
``compiled.memory_analysis()`` argument + output + temp (- aliased), plus the process peak RSS.

This CPU's run (2 cores), each V all at once and chunked (``V:chunk``):

  python experiments/scaling.py --vocab_sizes=65,65:13,256,256:32 --warmup=1 --steps=2

On one GPU (H100/H200), the full table:

  python experiments/scaling.py --vocab_sizes=65,256,1000,50000 \
      --chunk_for_v=1000:250,50000:500 --warmup=1 --steps=3

Writes ``--out_dir/<name>.md`` and ``--out_dir/<name>.json``; ``--report_only`` re-renders the
markdown from the JSON (``--note="..."`` appends a line, e.g. earlier runs' times).
"""

import json
import os
import shlex
import statistics
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
from absl import app, flags
from measure import memory, time_train_step
from ml_collections import config_flags

from grpo_jax import groups, rewards
from grpo_jax.loss import make_loss
from grpo_jax.model import init_params, make_model
from grpo_jax.train_step import (
    StepInputs,
    init_state,
    make_optimizer,
    make_train_step,
    parts_forced_flags,
)

FLAGS = flags.FLAGS
config_flags.DEFINE_config_file(
    "config", "configs/shakespeare.py:exhaustive", "Config file (model, group, grpo settings)."
)
flags.DEFINE_list(
    "vocab_sizes",
    ["65", "256", "1000", "50000"],
    "Runs as V or V:chunk (a V may appear with several chunks, e.g. 65,65:13).",
)
flags.DEFINE_string(
    "chunk_for_v", "1000:250,50000:500", "group.vocab_chunk per V as V:chunk,...; unlisted: 0."
)
flags.DEFINE_integer("batch_size", 8, "Prompts per step (B).", lower_bound=1)
flags.DEFINE_integer("context_len", 100, "Context length.", lower_bound=1)
flags.DEFINE_integer("horizon", 70, "Horizon.", lower_bound=1)
flags.DEFINE_integer("corpus_len", 200_000, "Length of the synthetic token array.")
flags.DEFINE_integer("warmup", 1, "Untimed steps after compilation.", lower_bound=0)
flags.DEFINE_integer("steps", 2, "Timed steps (median reported).", lower_bound=1)
flags.DEFINE_string("out_dir", "experiments/results", "Where the table and JSON go.")
flags.DEFINE_string("name", "scaling", "Basename of the output files.")
flags.DEFINE_string("note", "", "A line appended to the markdown (e.g. earlier runs' times).")
flags.DEFINE_bool("report_only", False, "Only re-render the markdown from <out_dir>/<name>.json.")
flags.DEFINE_string("one_run", "", "Internal: measure V:chunk in this process, print JSON.")

GUIDE = {  # V -> (feasible?, memory GB, time/iteration) as the guide states them
    65: ("yes", "12", "6 s"),
    256: ("yes", "48", "24 s"),
    1000: ("marginal", "190", "95 s"),
    50000: ("no (one 80 GB GPU)", "≈9,500", "~1 h"),
}
GIB = 2**30


def parse_chunks(spec: str) -> dict:
    out = {}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        v, _, c = item.partition(":")
        out[int(v)] = int(c)
    return out


def parse_runs(entries) -> list:
    """--vocab_sizes entries "V" or "V:chunk" -> [(V, chunk)]; a bare V takes --chunk_for_v."""
    chunks = parse_chunks(FLAGS.chunk_for_v)
    runs = []
    for item in entries:
        v, _, c = str(item).partition(":")
        runs.append((int(v), int(c) if c else chunks.get(int(v), 0)))
    return runs


def step_config(v: int, chunk: int):
    config = FLAGS.config
    config.group.mode = "exhaustive"
    config.group.vocab_chunk = chunk
    config.train.batch_size = FLAGS.batch_size
    config.data.context_len = FLAGS.context_len
    config.data.horizon = FLAGS.horizon
    config.reference.kind = "none"
    config.reward.terms = "match"
    return config


def measure(v: int, chunk: int) -> dict:
    config = step_config(v, chunk)
    c, h = config.data.context_len, config.data.horizon
    max_len = config.model.max_len or c + h
    model = make_model(config.model, v, max_len)
    params = init_params(model, jax.random.PRNGKey(config.seed))
    collect = groups.make_collect(config, model, v, None, rewards.make_reward_fn(config.reward))
    loss_fn = make_loss(config, model, has_reference=False)
    tx, schedule = make_optimizer(config.optim, FLAGS.warmup + FLAGS.steps)
    step = make_train_step(config, collect, loss_fn, tx, schedule, parts_forced_flags(config), v)
    state = init_state(params, tx, config.seed)
    tokens = jax.random.randint(jax.random.PRNGKey(1), (FLAGS.corpus_len,), 0, v, jnp.int32)
    inputs = StepInputs(tokens, None)

    load_before = os.getloadavg()
    compiled, state, metrics, compile_s, times = time_train_step(
        jax.jit(step, donate_argnums=0), state, inputs, FLAGS.warmup, FLAGS.steps
    )
    med = statistics.median(times)
    gen = float(metrics["generated_tokens"])
    dev = jax.devices()[0]
    return {
        "vocab_size": v,
        "vocab_chunk": int(config.group.vocab_chunk),
        "device": f"{dev.device_kind} ({dev.platform})",
        "params": int(sum(x.size for x in jax.tree.leaves(params))),
        "batch_size": config.train.batch_size,
        "context_len": c,
        "horizon": h,
        "model": f"{config.model.num_layers}x{config.model.num_heads}x{config.model.d_model} "
        f"{config.model.dtype}",
        "train_continuations": bool(config.group.train_continuations),
        "exhaustive_estimator": config.grpo.exhaustive_estimator,
        "num_iterations": int(config.grpo.num_iterations),
        "compile_s": compile_s,
        "step_times_s": times,
        "median_step_s": med,
        "generated_tokens_per_step": gen,
        "tokens_per_s": gen / med,
        "loss": float(metrics["loss"]),
        "loadavg_1m_before_after": [load_before[0], os.getloadavg()[0]],
        **memory(compiled),
    }


def command_line():
    """The command as run, without --note (its text is the markdown's last line)."""
    args = [a for a in sys.argv[1:] if not a.startswith(("--note", "--report_only"))]
    return "python experiments/scaling.py " + " ".join(map(shlex.quote, args))


def fmt_bytes(b):
    return f"{b / GIB:.2f} GiB" if b >= GIB / 4 else f"{b / 2**20:.0f} MiB"


def write_outputs(results: dict, device: str, command: str | None = None):
    out_dir = Path(FLAGS.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    raw = {
        "device": device,
        "command": command or command_line(),
        "overrides": dict(config_flags.get_override_values(FLAGS["config"])),
        "guide_claims": {str(k): v for k, v in GUIDE.items()},
        "results": {f"{v}:{c}": r for (v, c), r in results.items()},
    }
    (out_dir / f"{FLAGS.name}.json").write_text(json.dumps(raw, indent=1))
    any_r = next((r for r in results.values() if "median_step_s" in r), {})
    lines = [
        "# Exhaustive GRPO scaling with the vocabulary size V",
        "",
        f"- Device: **{device}** (jax {jax.__version__}).",
        f"- Command: `{raw['command']}`",
        f"- Setup: one exhaustive GRPO train step (jitted once, state donated): B="
        f"{FLAGS.batch_size} prompts × V forced first tokens, each continued for "
        f"{FLAGS.horizon - 1} sampled tokens (horizon {FLAGS.horizon}), context "
        f"{FLAGS.context_len}; model {any_r.get('model', '?')}; synthetic data (uniform "
        "random int32 tokens in [0, V)); reward `match`; "
        f"estimator `{any_r.get('exhaustive_estimator', '?')}`, train_continuations="
        f"{any_r.get('train_continuations', '?')}; "
        f"{any_r.get('num_iterations', 1)} optimizer update(s) per rollout (grpo.num_iterations); "
        f"{FLAGS.warmup} warm-up + {FLAGS.steps} "
        "timed steps, median reported.",
        "- **No reference model** (`reference=None`): the step has no KL term, so the exact "
        "KL over V at the decision point (and the reference's [B, V, H, V] log-probs) is "
        "**off** here; figures with the n-gram reference would be higher.",
        "- Memory on CPU: the step executable's `compiled.memory_analysis()` argument + "
        "output + temp − aliased (XLA's figure for the step), and the process peak RSS "
        "(ru_maxrss, one process per V, includes JAX/XLA runtime and compilation); on GPU "
        "`memory_stats()['peak_bytes_in_use']`.",
        "- `vocab_chunk` bounds the rollout's and the loss's memory: members are rolled out, "
        "and their training forward is run (rematerialised in the backward pass), that many "
        "at a time.",
        "",
        "| V | vocab_chunk | guide: feasible | guide: memory (GB) | guide: time / iteration "
        "| measured: time / iteration (s, median) | measured: step executable memory "
        "| measured: process peak RSS | compile (s) | generated tokens/s | load avg (1 min) "
        "before → after |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    rows = sorted(results) + [(v, None) for v in GUIDE if v not in {k[0] for k in results}]
    for v, chunk in sorted(rows, key=lambda k: (k[0], k[1] if k[1] is not None else -1)):
        g = GUIDE.get(v, ("–", "–", "–"))
        r = results.get((v, chunk))
        if r is None or "median_step_s" not in r:
            why = r["error"] if r else "not run"
            if r is None and v > 256:
                why = "not run on this device (needs a GPU)"
            lines.append(f"| {v} | – | {g[0]} | {g[1]} | {g[2]} | {why} | – | – | – | – | – |")
            continue
        lines.append(
            f"| {v} | {r['vocab_chunk']} | {g[0]} | {g[1]} | {g[2]} | "
            f"{r['median_step_s']:.2f} ({', '.join(f'{t:.2f}' for t in r['step_times_s'])}) | "
            f"{fmt_bytes(r.get('executable_bytes', r['peak_memory_bytes']))} | "
            f"{fmt_bytes(r['process_peak_rss_bytes'])} | {r['compile_s']:.1f} | "
            f"{r['tokens_per_s']:,.0f} | "
            + " → ".join(f"{x:.1f}" for x in r.get("loadavg_1m_before_after", []))
            + " |"
        )
    lines += [
        "",
        "The guide's figures are claims for an 80 GB GPU with an unstated model; nothing "
        "here is extrapolated to the V that were not run. On a shared machine the times "
        "depend on the other jobs' load (the load-average column; "
        f"{os.cpu_count()} CPU cores); the memory figures do not.",
    ]
    if FLAGS.note:
        lines += ["", FLAGS.note]
    if any(
        "peak_memory_source" in r and "memory_stats" in r["peak_memory_source"]
        for r in results.values()
    ):
        lines.append("Memory column: device peak_bytes_in_use.")
    md = "\n".join(lines) + "\n"
    (out_dir / f"{FLAGS.name}.md").write_text(md)
    return md


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    if FLAGS.report_only:
        raw = json.loads((Path(FLAGS.out_dir) / f"{FLAGS.name}.json").read_text())
        results = {}
        for key, r in raw["results"].items():  # "V:chunk" (older files: "V")
            v, _, c = key.partition(":")
            results[(int(v), int(c) if c else int(r.get("vocab_chunk", 0)))] = r
        args = [a for a in shlex.split(raw["command"]) if not a.startswith("--note")]
        print(write_outputs(results, raw["device"], shlex.join(args)))
        return
    if FLAGS.one_run:
        print(json.dumps(measure(*parse_runs([FLAGS.one_run])[0])), flush=True)
        return
    results = {}
    env = dict(os.environ)
    for v, chunk in parse_runs(FLAGS.vocab_sizes):
        cmd = [sys.executable, os.path.abspath(__file__), *sys.argv[1:], f"--one_run={v}:{chunk}"]
        print(f"V={v} chunk={chunk}: {shlex.join(cmd)}", flush=True)
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
        if proc.returncode or not lines:
            err = (proc.stderr.strip().splitlines() or ["no output"])[-1][:200]
            print(f"  failed: {err}", flush=True)
            results[(v, chunk)] = {"vocab_size": v, "error": f"failed: {err}"}
            continue
        r = results[(v, chunk)] = json.loads(lines[-1])
        print(
            f"  median {r['median_step_s']:.2f}s/step, executable "
            f"{fmt_bytes(r.get('executable_bytes', 0))}, RSS "
            f"{fmt_bytes(r['process_peak_rss_bytes'])}",
            flush=True,
        )
    dev = jax.devices()[0]
    device = f"{dev.device_kind} ({dev.platform})"
    if dev.platform == "cpu":
        device += f", {os.cpu_count()} CPU cores visible"
    print(write_outputs(results, device))


if __name__ == "__main__":
    app.run(main)
