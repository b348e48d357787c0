"""The exhaustive-GRPO guide's scaling table: iteration time and peak memory vs vocabulary V.

One exhaustive GRPO train step (group = all V first tokens, each continued for horizon - 1
sampled tokens; the whole step jitted once, state donated) for a model with vocabulary V on
synthetic data: the train tokens are uniform random ids in [0, V), the reward is ``match``
(per-char agreement with the window's true continuation), and the KL reference is the frozen
initial policy with the ``k3`` estimator by default (``--reference=policy --kl_estimator=k3``,
β = the config's ``grpo.beta``): the rollout carries log π_ref of each generated token,
computed member chunk by member chunk beside the policy's own (the reference's log-probs are
never materialised as [B, V, H, V]). ``--kl_estimator=exact`` (or ``exact_forward``) runs the
reference inside the loss's member chunks instead; ``--reference=none`` drops the KL term
(rollout + reward + policy gradient + optimizer update only), as the table's rows before
the KL reference at any V did.

The step is the Shakespeare task's own (``build_task(config, "train")``, ``task.build``,
``task.make_state``; ``step.fused`` jitted with the state donated), so the table times exactly
what the trainer runs. The task's vocabulary is its corpus's distinct characters, so a
synthetic V is a synthetic corpus: ``--corpus_len`` characters over V distinct Unicode code
points (each once, the rest uniform at random), written to a temporary file that
``config.data.path`` names; the task's ids are then uniform random in [0, V).
``group.vocab_chunk`` bounds the rollout (members decoded that many at a time) and
``group.loss_chunk`` the loss's training forward over the continuations (members in chunks,
each chunk's gradient taken after its forward; see chunking.accumulated). The model is the plain
config's (4 layers, 4 heads, width 128 unless overridden), B=8, context 100, horizon 70. A run
is ``V``, ``V:chunk`` or ``V:chunk:loss_chunk`` (a bare V takes its chunks from ``--chunk_for_v``;
unlisted: 0 = all V actions at once; loss_chunk 0 = the rollout's chunk).

``--compile_only`` runs are compiled but not executed: XLA's buffer plan for the step
(``memory_analysis``) on this device, with no time. On a CPU that cannot run V = 50,000 in
reasonable time this still shows whether the chunked step's buffers fit a given memory.

Each run goes in its own subprocess, so the process peak RSS is that run's own. Memory: on GPU
``device.memory_stats()["peak_bytes_in_use"]``; on CPU the step executable's
``compiled.memory_analysis()`` argument + output + temp (- aliased), plus the process peak RSS.
Each run also counts the step's matmul FLOPs (``flop_count.step_flops``: every dot_general the
traced step executes, loops and the backward pass's recomputation included).

One run alone (what experiments/gpu_suite.py calls, one subprocess per V): ``--one_run=
V:chunk:loss_chunk@run`` (or ``@compile``) measures it in this process and prints its JSON
as the last line.

This CPU's run (2 cores), each V all at once and chunked (``V:chunk:loss_chunk``):

  python experiments/scaling.py --vocab_sizes=65,65:13:13,256,256:32:32 \
      --compile_only=1000:0:0,1000:250:25,50000:2500:25,50000:5000:10 --warmup=1 --steps=2

On one GPU (H100/H200), the full table:

  python experiments/scaling.py --vocab_sizes=65,256,1000,50000 --warmup=1 --steps=3

Writes ``--out_dir/<name>.md`` and ``--out_dir/<name>.json``; ``--report_only`` re-renders the
markdown from the JSON alone, which holds the setup and the note (a new ``--note`` replaces
the stored one).
"""

import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import device_lock
import jax
import numpy as np
from absl import app, flags
from flop_count import step_flops
from measure import configure_host, memory, time_train_step
from ml_collections import config_flags
from scaling_report import GUIDE, fmt_bytes, markdown

from grpo_jax.tasks import build_task

FLAGS = flags.FLAGS
config_flags.DEFINE_config_file(
    "config", "configs/shakespeare.py:exhaustive", "Config file (model, group, grpo settings)."
)
flags.DEFINE_list(
    "vocab_sizes",
    ["65", "256", "1000", "50000"],
    "Runs as V, V:chunk or V:chunk:loss_chunk (a V may appear several times, e.g. 65,65:13).",
)
flags.DEFINE_list(
    "compile_only", [], "Runs (same syntax) only compiled: XLA's memory plan, no time."
)
flags.DEFINE_string(
    "chunk_for_v",
    "1000:250:25,50000:2500:25",
    "Chunks of a bare V as V:chunk[:loss_chunk],...; unlisted: 0 (all at once).",
)
flags.DEFINE_enum(
    "reference",
    "policy",
    ["none", "policy"],
    "KL reference: the frozen initial policy (policy) or no KL term at all (none).",
)
flags.DEFINE_enum(
    "kl_estimator",
    "k3",
    ["k1", "k2", "k3", "exact", "exact_forward"],
    "grpo.kl_estimator with --reference=policy (k*: sampled-token; exact*: the loss's chunks).",
)
flags.DEFINE_bool("flops", True, "Count the step's matmul FLOPs (flop_count.step_flops).")
flags.DEFINE_integer("batch_size", 8, "Prompts per step (B).", lower_bound=1)
flags.DEFINE_integer("context_len", 100, "Context length.", lower_bound=1)
flags.DEFINE_integer("horizon", 70, "Horizon.", lower_bound=1)
flags.DEFINE_integer("corpus_len", 200_000, "Length of the synthetic corpus (chars).")
flags.DEFINE_integer("warmup", 1, "Untimed steps after compilation.", lower_bound=0)
flags.DEFINE_integer("steps", 2, "Timed steps (median reported).", lower_bound=1)
flags.DEFINE_string("out_dir", "experiments/results", "Where the table and JSON go.")
flags.DEFINE_string("name", "scaling", "Basename of the output files.")
flags.DEFINE_string("note", "", "A line appended to the markdown (e.g. earlier runs' times).")
flags.DEFINE_bool("report_only", False, "Only re-render the markdown from <out_dir>/<name>.json.")
flags.DEFINE_string(
    "one_run", "", "Internal: V:chunk:loss_chunk@run|compile, measured here; prints JSON."
)


def parse_run(item: str, defaults: dict | None = None) -> tuple[int, int, int]:
    """ "V[:chunk[:loss_chunk]]" -> (V, chunk, loss_chunk); a bare V takes ``defaults[V]``."""
    fields = [int(x) for x in str(item).split(":")]
    if not 1 <= len(fields) <= 3:
        raise app.UsageError(f"run {item!r}: expected V, V:chunk or V:chunk:loss_chunk")
    if len(fields) == 1 and defaults and fields[0] in defaults:
        return defaults[fields[0]]
    v, chunk, loss_chunk = (fields + [0, 0])[:3]
    return v, chunk, loss_chunk


def parse_runs(entries) -> list:
    defaults = [parse_run(s) for s in FLAGS.chunk_for_v.split(",") if s.strip()]
    by_v = {r[0]: r for r in defaults}
    return [parse_run(item, by_v) for item in entries]


def synthetic_corpus(path: Path, v: int, length: int, seed: int) -> None:
    """``length`` characters over V distinct code points (from U+0100 on, surrogates skipped):
    each of the V once (so the task's vocabulary is exactly V), the rest uniform at random."""
    if length < v:
        raise app.UsageError(f"--corpus_len={length} must be >= V={v}: every char must occur")
    cps = np.arange(0x100, 0x100 + v + 0x800)
    cps = cps[(cps < 0xD800) | (cps >= 0xE000)][:v].astype(np.uint32)
    rng = np.random.default_rng(seed)
    ids = np.concatenate([rng.permutation(v), rng.integers(0, v, length - v)])
    path.write_bytes(cps[ids].tobytes().decode("utf-32-le").encode("utf-8"))


def step_config(data_path: Path, chunk: int, loss_chunk: int):
    config = FLAGS.config
    config.data.path = str(data_path)
    config.group.mode = "exhaustive"
    config.group.vocab_chunk = chunk
    config.group.loss_chunk = loss_chunk
    config.train.batch_size = FLAGS.batch_size
    # the optimizer's schedule spans the steps made here, as it always has in this table
    config.train.num_steps = FLAGS.warmup + FLAGS.steps
    config.data.context_len = FLAGS.context_len
    config.data.horizon = FLAGS.horizon
    config.reference.kind = FLAGS.reference
    config.grpo.kl_estimator = FLAGS.kl_estimator
    config.reward.terms = "match"
    # the task also builds its (unused here) held-out evaluation: keep it small, and fit no
    # n-gram baselines over a V-char alphabet
    config.eval.num_windows = 1
    config.eval.ngram_baselines = ()
    return config


def measure(v: int, chunk: int, loss_chunk: int, compile_only: bool = False) -> dict:
    with tempfile.TemporaryDirectory(prefix="scaling_") as tmp:
        data_path = Path(tmp) / f"synthetic_v{v}.txt"
        synthetic_corpus(data_path, v, FLAGS.corpus_len, seed=1)
        config = step_config(data_path, chunk, loss_chunk)
        task = build_task(config, "train")
    if task.vocab.size != v:
        raise RuntimeError(f"the synthetic corpus has {task.vocab.size} distinct chars, not {v}")
    c, h = config.data.context_len, config.data.horizon
    params = jax.jit(task.init_params)(jax.random.PRNGKey(config.seed))  # one program
    n_params = int(sum(x.size for x in jax.tree.leaves(params)))
    step, inputs = task.build(params)
    state = task.make_state(params)

    load_before = os.getloadavg()
    jstep = jax.jit(step.fused, donate_argnums=0)
    warmup, steps = (0, 0) if compile_only else (FLAGS.warmup, FLAGS.steps)
    compiled, state, metrics, compile_s, times = time_train_step(
        jstep, state, inputs, warmup, steps
    )
    dev = jax.devices()[0]
    out = {
        "vocab_size": v,
        "vocab_chunk": int(config.group.vocab_chunk),
        "loss_chunk": int(config.group.loss_chunk),
        "compile_only": compile_only,
        "device": f"{dev.device_kind} ({dev.platform})",
        "params": n_params,
        "batch_size": config.train.batch_size,
        "context_len": c,
        "horizon": h,
        "model": f"{config.model.num_layers}x{config.model.num_heads}x{config.model.d_model} "
        f"{config.model.dtype}",
        "train_continuations": bool(config.group.train_continuations),
        "exhaustive_estimator": config.grpo.exhaustive_estimator,
        "num_iterations": int(config.grpo.num_iterations),
        "reference": config.reference.kind,
        "kl_estimator": config.grpo.kl_estimator if config.reference.kind != "none" else None,
        "beta": float(config.grpo.beta),
        "compile_s": compile_s,
        "loadavg_1m_before_after": [load_before[0], os.getloadavg()[0]],
        **memory(compiled),
        **device_lock.report(),
    }
    if FLAGS.flops:  # traced again (shapes only): the state handed back is a live one
        out.update(step_flops(step.fused, state, inputs, compiled=compiled))
    if times:
        med = statistics.median(times)
        gen = float(metrics["generated_tokens"])
        out.update(
            step_times_s=times,
            median_step_s=med,
            generated_tokens_per_step=gen,
            tokens_per_s=gen / med,
            loss=float(metrics["loss"]),
        )
    return out


def command_line():
    """The command as run, without --note (its text is the markdown's last line)."""
    args = [a for a in sys.argv[1:] if not a.startswith("--note")]
    return "python experiments/scaling.py " + " ".join(map(shlex.quote, args))


def run_key(v, chunk, loss_chunk):
    return f"{v}:{chunk}:{loss_chunk}"


def write_json(raw: dict):
    out_dir = Path(FLAGS.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{FLAGS.name}.json").write_text(json.dumps(raw, indent=1))


def write_markdown(raw: dict) -> str:
    """Writes <name>.md from the run record (write_json's); returns its text."""
    md = markdown(raw)
    (Path(FLAGS.out_dir) / f"{FLAGS.name}.md").write_text(md)
    return md


def run_plan() -> dict:
    """Every --vocab_sizes run, then every --compile_only one, each in its own subprocess
    (this script with --one_run): {(V, rollout chunk, loss chunk): its JSON result, or an
    {"error": ...} row when the subprocess failed (out of memory, say)}."""
    results = {}
    plan = [(r, "run") for r in parse_runs(FLAGS.vocab_sizes)]
    plan += [(r, "compile") for r in parse_runs(FLAGS.compile_only)]
    for run, how in plan:
        one = f"--one_run={run_key(*run)}@{how}"
        cmd = [sys.executable, os.path.abspath(__file__), *sys.argv[1:], one]
        print(f"V={run[0]} chunks={run[1]}/{run[2]} ({how}): {shlex.join(cmd)}", flush=True)
        proc = subprocess.run(cmd, capture_output=True, text=True)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
        if proc.returncode or not lines:
            err = (proc.stderr.strip().splitlines() or ["no output"])[-1][:200]
            print(f"  failed: {err}", flush=True)
            results[run] = {"vocab_size": run[0], "error": f"failed: {err}"}
            continue
        r = results[run] = json.loads(lines[-1])
        timing = f"median {r['median_step_s']:.2f}s/step, " if "median_step_s" in r else ""
        print(
            f"  {timing}executable {fmt_bytes(r.get('executable_bytes', 0))}, RSS "
            f"{fmt_bytes(r['process_peak_rss_bytes'])}",
            flush=True,
        )
    return results


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    if FLAGS.report_only:
        raw = json.loads((Path(FLAGS.out_dir) / f"{FLAGS.name}.json").read_text())
        if FLAGS.note:
            raw["note"] = FLAGS.note
            write_json(raw)
        print(write_markdown(raw))
        return
    if FLAGS.one_run:
        configure_host(FLAGS.config)  # this subprocess measures: the CLI's host settings
        spec, _, how = FLAGS.one_run.partition("@")
        print(json.dumps(measure(*parse_run(spec), compile_only=how == "compile")), flush=True)
        return
    results = run_plan()
    dev = jax.devices()[0]
    device = f"{dev.device_kind} ({dev.platform})"
    if dev.platform == "cpu":
        device += f", {os.cpu_count()} CPU cores visible"
    raw = {
        "device": device,
        "jax": jax.__version__,
        "command": command_line(),
        "overrides": dict(config_flags.get_override_values(FLAGS["config"])),
        "setup": {
            "batch_size": FLAGS.batch_size,
            "context_len": FLAGS.context_len,
            "horizon": FLAGS.horizon,
            "warmup": FLAGS.warmup,
            "steps": FLAGS.steps,
            "reference": FLAGS.reference,
            "kl_estimator": FLAGS.kl_estimator if FLAGS.reference != "none" else None,
            "cpu_count": os.cpu_count(),
        },
        "note": FLAGS.note,
        "guide_claims": {str(k): v for k, v in GUIDE.items()},
        "results": {run_key(*k): r for k, r in results.items()},
    }
    write_json(raw)
    print(write_markdown(raw))


if __name__ == "__main__":
    app.run(main)
