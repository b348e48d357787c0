"""grpo_jax's GRPO step against TRL's GRPOTrainer on the same work, side by side in one run.

The work (issue 15): a 4 x 4 x 128 char GPT, 8 prompts x G = 8 sampled completions, context
100, horizon 70 (forced), mu = 1, beta = 0.04, k3 KL to the frozen initial policy, the
``match`` reward. Alternating rounds, each side a fresh process per round: grpo_jax's
experiments/benchmark.py (its LAST line is a JSON object with median_step_s), then
experiments/trl_grpo.py (TRL's GRPOTrainer on a random GPT-2 of the same shape, a char
tokenizer, min_new_tokens forcing the horizon; its LAST line is a JSON object too), possibly
in another Python (--trl_python: a venv with torch/transformers/trl). Writes
<out_dir>/<name>.json and .md: per-round figures, medians, the ratio TRL s/step / grpo_jax
s/step, device, versions, thread counts, load averages and the exact commands (the markdown:
versus_trl_report.py).

  GRPO_JAX_DATA=/work/shared/data/tinyshakespeare.txt python experiments/versus_trl.py \\
      --trl_python=/work/trl_venv/bin/python --rounds=3 --steps=10 --warmup=2

(the venv: ``python -m venv /work/trl_venv && /work/trl_venv/bin/pip install torch==2.13.0``,
then ``/work/trl_venv/bin/pip install trl -c <(echo torch==2.13.0)``). On a GPU:
``--dtype=bfloat16`` runs both sides in bf16 compute with fp32 parameters, and --layers,
--heads, --width scale the model on both sides.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import resource
import shlex
import subprocess
import sys
import time

from trl_grpo import cpu_name  # stdlib-only at import: torch loads inside its run()
from versus_trl_report import NOTES, summary_of, write_md

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent

JAX_VERSIONS = (
    "import json, jax, jaxlib, flax, optax; d = jax.devices()[0]; print(json.dumps({"
    "'jax': jax.__version__, 'jaxlib': jaxlib.__version__, 'flax': flax.__version__, "
    "'optax': optax.__version__, 'device': f'{d.device_kind} / {d.platform}', "
    "'num_devices': jax.device_count()}))"
)


def jax_command(a) -> list[str]:
    cmd = [
        a.jax_python,
        str(HERE / "benchmark.py"),
        "--config=configs/shakespeare.py:sampled",
        f"--config.group.size={a.group}",
        "--config.reference.kind=policy",
        "--config.grpo.kl_estimator=k3",
        "--config.reward.terms=match",
        f"--config.grpo.beta={a.beta}",
        f"--config.train.batch_size={a.batch_prompts}",
        "--config.grpo.num_iterations=1",
        f"--config.data.context_len={a.context}",
        f"--config.data.horizon={a.horizon}",
        f"--config.model.num_layers={a.layers}",
        f"--config.model.num_heads={a.heads}",
        f"--config.model.d_model={a.width}",
        f"--config.model.dtype={a.dtype}",
        f"--steps={a.steps}",
        f"--warmup={a.warmup}",
        f"--breakdown_runs={a.breakdown_runs}",
    ]
    return cmd + shlex.split(a.jax_args)


def trl_command(a) -> list[str]:
    cmd = [
        a.trl_python,
        str(HERE / "trl_grpo.py"),
        f"--steps={a.steps}",
        f"--warmup={a.warmup}",
        f"--device={a.trl_device}",
        f"--dtype={a.dtype}",
        f"--batch_prompts={a.batch_prompts}",
        f"--group={a.group}",
        f"--context={a.context}",
        f"--horizon={a.horizon}",
        f"--layers={a.layers}",
        f"--heads={a.heads}",
        f"--width={a.width}",
        f"--beta={a.beta}",
    ]
    return cmd + shlex.split(a.trl_args)


def last_json(stdout: str) -> dict:
    lines = [ln for ln in stdout.strip().splitlines() if ln.strip()]
    if not lines:
        raise RuntimeError("the command printed nothing")
    return json.loads(lines[-1])


def busy_cpu_s() -> float | None:
    """CPU seconds all processes have been busy since boot (/proc/stat), None off Linux."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def children_cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def wait_quiet(max_wait_s: float, share: float, window_s: float = 3.0) -> dict:
    """Waits (up to max_wait_s) until the other processes' CPU share over a window is below
    `share` (nothing of ours runs meanwhile, so all busy time is theirs)."""
    t0 = time.perf_counter()
    while True:
        b0 = busy_cpu_s()
        time.sleep(window_s)
        b1 = busy_cpu_s()
        if b0 is None or b1 is None:
            return {"waited_s": 0.0, "idle_check_share": None}
        used = (b1 - b0) / (window_s * (os.cpu_count() or 1))
        waited = time.perf_counter() - t0
        if used < share or waited >= max_wait_s:
            return {"waited_s": waited, "idle_check_share": used, "quiet": used < share}


def run_side(cmd: list[str], env: dict, a) -> tuple[dict, dict]:
    """Runs one side (once the host is quiet, see --wait_quiet); returns its JSON line and the
    process's wall time, its CPU time and the CPU time every other process on the machine
    used meanwhile (a check for a quiet host)."""
    quiet = wait_quiet(a.wait_quiet, a.quiet_share) if a.wait_quiet > 0 else {}
    timeout = a.timeout
    busy0, own0, t0 = busy_cpu_s(), children_cpu_s(), time.perf_counter()
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    wall = time.perf_counter() - t0
    busy1, own = busy_cpu_s(), children_cpu_s() - own0
    if p.returncode != 0:
        sys.stderr.write(p.stdout[-4000:] + p.stderr[-8000:])
        raise RuntimeError(f"exit {p.returncode}: {shlex.join(cmd)}")
    proc = {"process_wall_s": wall, "process_cpu_s": own, **quiet}
    if busy0 is not None and busy1 is not None:
        other = max(busy1 - busy0 - own, 0.0)
        proc["other_processes_cpu_s"] = other
        proc["other_processes_cpu_share"] = other / (wall * (os.cpu_count() or 1))
    return last_json(p.stdout), proc


def shell_line(cmd: list[str], data: str) -> str:
    """The command as one would type it from the repository root."""
    rel = [os.path.relpath(c, ROOT) if c.startswith(str(ROOT) + os.sep) else c for c in cmd]
    rel[0] = "python" if rel[0] == sys.executable else rel[0]
    return f"GRPO_JAX_DATA={data} " + shlex.join(rel)


def git_state() -> dict:
    """The checkout measured: HEAD and the tracked files that differ from it (HEAD None where
    there is no git checkout, e.g. a device machine's copy of the working tree)."""

    def git(*args):
        try:
            r = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)
        except OSError:  # no git at all
            return None
        return r.stdout.rstrip() if r.returncode == 0 else None

    dirty = git("status", "--porcelain", "--untracked-files=no")
    lines = [ln.strip() for ln in dirty.splitlines()] if dirty else []
    return {"head": git("rev-parse", "HEAD"), "dirty": lines}


JAX_KEEP = ("median_step_s", "tokens_per_s", "step_times_s", "compile_s", "params", "device")
JAX_KEEP += ("tokens_per_step", "breakdown")
TRL_KEEP = ("median_step_s", "min_step_s", "max_step_s", "tokens_per_s", "step_times_s")
TRL_KEEP += ("warmup_step_times_s", "median_loop_s", "mean_completion_length", "params", "device")
TRL_KEEP += ("threads", "tokens_per_step", "vocab_size", "model", "dropout")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=10, help="timed steps per side per round")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per side per round")
    p.add_argument("--breakdown_runs", type=int, default=1, help="benchmark.py's breakdown")
    p.add_argument("--jax_python", default=sys.executable)
    p.add_argument("--trl_python", default=sys.executable)
    p.add_argument("--trl_device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--batch_prompts", type=int, default=8)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--context", type=int, default=100)
    p.add_argument("--horizon", type=int, default=70)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--beta", type=float, default=0.04)
    p.add_argument("--jax_args", default="", help="extra benchmark.py flags (one string)")
    p.add_argument("--trl_args", default="", help="extra trl_grpo.py flags (one string)")
    p.add_argument("--data", default=os.environ.get("GRPO_JAX_DATA", ""))
    p.add_argument("--out_dir", default=str(HERE / "results"))
    p.add_argument("--name", default="versus_trl_cpu")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per subprocess")
    p.add_argument(
        "--wait_quiet",
        type=float,
        default=600,
        help="before each side, wait up to this many seconds for other processes' CPU share "
        "(3 s windows) to fall below --quiet_share (0: do not wait)",
    )
    p.add_argument("--quiet_share", type=float, default=0.1)
    p.add_argument("--note", default="", help="a remark written into the JSON and the .md")
    p.add_argument(
        "--md_from",
        default="",
        help="measure nothing: rewrite this JSON's .md beside it (and its note, if --note)",
    )
    return p


def rewrite_md(json_path: str, note: str):
    src = pathlib.Path(json_path)
    res = json.loads(src.read_text())
    if note:
        res["note"] = note
        src.write_text(json.dumps(res, indent=1) + "\n")
    write_md(res, src.with_suffix(".md"))
    print(f"wrote {src.with_suffix('.md')}")


def jax_versions(a, env) -> dict:
    cmd = [a.jax_python, "-c", JAX_VERSIONS]
    return last_json(
        subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
    )


def run_rounds(a, env, jcmd, tcmd) -> tuple[list[dict], dict]:
    """``a.rounds`` alternating rounds, grpo_jax then TRL, each side a fresh process. Returns
    the rounds and TRL's versions, device and threads (as its last round reported them)."""
    rounds, trl_env = [], {}
    for r in range(a.rounds):
        load_before = os.getloadavg()
        gj, gj_proc = run_side(jcmd, env, a)
        tr, tr_proc = run_side(tcmd, env, a)
        if tr["mean_completion_length"] != a.horizon:
            raise RuntimeError(f"TRL completions average {tr['mean_completion_length']} tokens")
        row = {
            "round": r + 1,
            "load_before": load_before,
            "grpo_jax": {k: gj.get(k) for k in JAX_KEEP} | gj_proc,
            "trl": {k: tr.get(k) for k in TRL_KEEP} | tr_proc,
            "ratio": tr["median_step_s"] / gj["median_step_s"],
        }
        row["grpo_jax"]["min_step_s"] = min(gj["step_times_s"])
        row["grpo_jax"]["max_step_s"] = max(gj["step_times_s"])
        rounds.append(row)
        print(
            f"round {r + 1}: grpo_jax {gj['median_step_s']:.4f} s/step, TRL "
            f"{tr['median_step_s']:.4f} s/step, ratio {row['ratio']:.2f} "
            f"(load {load_before[0]:.2f})",
            flush=True,
        )
        trl_env = {k: tr[k] for k in ("trl", "transformers", "torch", "python", "device")}
        trl_env["threads"] = tr["threads"]
    return rounds, trl_env


def main(argv=None):
    p = parser()
    a = p.parse_args(argv)
    if a.md_from:
        return rewrite_md(a.md_from, a.note)
    if not a.data:
        p.error("no corpus: pass --data or set GRPO_JAX_DATA")
    data = str(pathlib.Path(a.data).resolve())
    env = {**os.environ, "GRPO_JAX_DATA": data}
    jax_env = jax_versions(a, env)
    jcmd, tcmd = jax_command(a), trl_command(a)
    git_start, load_start = git_state(), os.getloadavg()
    print(f"load average at start: {load_start}", flush=True)
    rounds, trl_env = run_rounds(a, env, jcmd, tcmd)
    summary = summary_of(rounds)
    argv_line = sys.argv[1:] if argv is None else argv
    res = {
        "name": a.name,
        "date": time.strftime("%Y-%m-%d %H:%M %Z"),
        "work": {
            k: getattr(a, k)
            for k in ("rounds", "steps", "warmup", "batch_prompts", "group", "context")
            + ("horizon", "layers", "heads", "width", "beta", "dtype")
        },
        "host": {
            "cpu": cpu_name(),
            "cpu_count": os.cpu_count(),
            "python": sys.version.split()[0],
            "platform": platform.platform(),
        },
        "grpo_jax_env": jax_env,
        "trl_env": trl_env,
        "git": {"start": git_start, "end": git_state()},
        "note": a.note,
        "load_start": load_start,
        "wait_quiet_s": a.wait_quiet,
        "quiet_share": a.quiet_share,
        "load_end": os.getloadavg(),
        "summary": summary,
        "rounds": rounds,
        "command": f"GRPO_JAX_DATA={data} python experiments/versus_trl.py "
        + shlex.join(argv_line),
        "commands": {"grpo_jax": shell_line(jcmd, data), "trl": shell_line(tcmd, data)},
        "notes": NOTES,
    }
    out = pathlib.Path(a.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{a.name}.json").write_text(json.dumps(res, indent=1) + "\n")
    write_md(res, out / f"{a.name}.md")
    print(
        f"grpo_jax {summary['grpo_jax_s_per_step']['median']:.4f} s/step, TRL "
        f"{summary['trl_s_per_step']['median']:.4f} s/step: ratio "
        f"{summary['ratio_of_medians']:.2f} -> {out / a.name}.json/.md"
    )
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
