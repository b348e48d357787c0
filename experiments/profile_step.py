"""Where one GRPO step's time goes: a jax.profiler trace of the jitted step, summed per kind
of work and per stage of the step.

The step is built as experiments/benchmark.py builds it (the task's own ``task.build``), jitted
once (``jax.jit(step.fused, donate_argnums=0)``: rollout, rewards and update in one program),
warmed up, then ``--steps`` steps run under ``jax.profiler.trace`` (no Python tracer). XLA:CPU
executes a program as thunks, one per HLO instruction (a fusion, a matmul, a copy), and the
trace times each one (its ``hlo_op``); this script maps every thunk to its instruction in the
compiled HLO and classifies it (on a GPU or TPU only the device tracks' kernels count, each
named by the ``hlo_op`` it runs: that path has not run on an accelerator yet):

- kind: ``matmul`` (a dot, or a YNNPACK fusion holding one: such a fusion may hold several
  matmuls and the elementwise work between them), ``batched matmul`` (a dot with batch
  dimensions: attention's scores and values), ``layout`` (copies, transposes, pads,
  slices, broadcasts, dynamic-update-slice: moving data, computing nothing), ``reduction``,
  ``gather/scatter``, ``elementwise`` (every other fusion);
- stage, from the instruction's op_name (the engine's named scopes and JAX's transformations):
  ``rollout: decode loop`` (the model's decode steps and the sampler), ``rollout: prefill``,
  ``rollout: reference`` (π_ref on the completions), ``rollout: other`` (rewards), ``update:
  forward``, ``update: backward``, ``update: reference`` (exact KL estimators), ``update:
  optimizer``, ``update: other``; ``other``: what XLA left unnamed.

Figures are thunk-ms per step: the sum of the thunks' own durations. Independent thunks run
concurrently on the CPU's threads (the sum can exceed the wall time; both are reported) and one
thunk may use several threads, so a share is a share of the program's busy time, not of cores.
Beside them, the step's matmul FLOPs (measure.matmul_flops_of, dense and batched apart) give
each matmul kind's FLOP rate per thunk-second. Control flow (while, conditional, call)
is not summed: its time is its body's. Writes ``--out_dir/<name>.json`` and ``.md``; with
``--hlo``, also the compiled HLO text beside them (an XLA dump of the one program). The last
line printed is the JSON (``--out_dir=`` prints only: experiments/gpu_suite.py's profile part).

  GRPO_JAX_DATA=/work/shared/data/tinyshakespeare.txt python experiments/profile_step.py \\
      --config=configs/shakespeare.py:sampled --config.group.size=8 \\
      --config.reference.kind=policy --config.grpo.kl_estimator=k3 \\
      --config.reward.terms=match --config.grpo.beta=0.04 --config.train.batch_size=8 \\
      --config.grpo.num_iterations=1            # the TRL-comparable step
"""

import collections
import gzip
import json
import platform
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

import jax
from absl import app, flags
from measure import matmul_flops_of
from ml_collections import config_flags

from grpo_jax import trainer
from grpo_jax.tasks import build_task

FLAGS = flags.FLAGS
config_flags.DEFINE_config_file("config", None, "Config file (path[:variant,...]).")
flags.DEFINE_integer("warmup", 2, "Untimed steps after compilation.", lower_bound=0)
flags.DEFINE_integer("steps", 3, "Steps traced (figures are per step).", lower_bound=1)
flags.DEFINE_string(
    "out_dir", "experiments/results", "Where the JSON and markdown go ('': print only)."
)
flags.DEFINE_string("name", "profile_cpu", "Basename of the results files.")
flags.DEFINE_bool("hlo", False, "Also write the compiled HLO text (<name>.hlo.txt).")
flags.DEFINE_integer("top", 15, "Instructions listed in the markdown.", lower_bound=0)

KIND_BATCHED = {"matmul": False, "batched matmul": True}  # measure.matmul_flops_of's split
CONTROL = {"while", "conditional", "call"}
LAYOUT = {"copy", "bitcast", "transpose", "pad", "slice", "concatenate", "broadcast", "reshape"}
LAYOUT |= {"dynamic-update-slice", "dynamic-slice", "iota", "wrapped"}
STAGES = (  # the first whose marks all occur in the op_name
    ("rollout: reference", ("rollout", "reference")),
    ("rollout: decode loop", ("rollout", "Transformer.decode")),
    ("rollout: decode loop", ("rollout/while",)),  # its ops without names: sampling, caches
    ("rollout: prefill", ("rollout", "Transformer.prefill")),
    ("rollout: other", ("rollout",)),
    ("update: reference", ("update", "reference")),
    ("update: backward", ("transpose(",)),  # the backward pass loses the outer scopes
    ("update: optimizer", ("optimizer",)),
    ("update: forward", ("jvp(",)),
    ("update: other", ("update",)),
)
_INSTR = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (.+?) ([\w\-]+)\(")  # tuple shapes have spaces
_COMP = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) .*\{\s*$")


def parse_hlo(text: str) -> dict:
    """{instruction name: {"shape", "opcode", "op_name", "body", "batched"}} for every
    instruction of every computation. "body" lists the opcodes of the computation a fusion
    calls (does it hold a dot, a reduce, a gather); "batched": a dot with batch dimensions,
    the instruction's own or one in its body. An instruction without an op_name (XLA drops
    some inside loop bodies) takes the op_name of the instruction that calls its computation,
    so a decode step's ops still name their stage."""
    instrs, bodies, caller, comp = {}, collections.defaultdict(list), {}, None
    for line in text.splitlines():
        c = _COMP.match(line)
        if c:
            comp = c.group(1)
            continue
        m = _INSTR.match(line)
        if not m:
            continue
        name, shape, opcode = m.groups()
        batched = "lhs_batch_dims" in line
        bodies[comp].append((opcode, batched))
        op_name = re.search(r'op_name="([^"]*)"', line)
        called = re.findall(
            r"(?:calls|body|condition|to_apply|branch_computations)=\{?%?([\w.\-]+)", line
        )
        for callee in called:
            caller.setdefault(callee, name)
        op_name = op_name.group(1) if op_name else ""
        instrs[name] = dict(shape=shape, opcode=opcode, comp=comp, batched=batched,
                            op_name=op_name, calls=called)  # fmt: skip
    for name, info in instrs.items():
        body = [op for callee in info.pop("calls") for op in bodies.get(callee, [])]
        info["body"] = sorted({op for op, _ in body})
        info["batched"] |= any(b for op, b in body if op == "dot")
        up = name
        while not info["op_name"] and up in instrs and instrs[up]["comp"] in caller:
            up = caller[instrs[up]["comp"]]
            info["op_name"] = instrs[up]["op_name"] if up in instrs else ""
    for info in instrs.values():
        info.pop("comp")
    return instrs


def kind_of(name: str, info: dict) -> str:
    """The kind of work one instruction does (see the module docstring)."""
    ops = set(info["body"]) | {info["opcode"]}
    if "dot" in ops or "convolution" in ops:
        return "batched matmul" if info["batched"] else "matmul"
    if ops & {"gather", "scatter"} or re.search(r"gather|scatter", name):
        return "gather/scatter"
    if ops & {"reduce", "reduce-window"} or "reduce" in name:
        return "reduction"
    words = set(re.sub(r"\.\d+$", "", name).split("_")) - {"fusion"}
    body = set(info["body"]) - {"parameter", "constant"}
    if (body and body <= LAYOUT) or (not body and words and words <= LAYOUT):
        return "layout"
    return "elementwise"


def stage_of(op_name: str) -> str:
    for stage, marks in STAGES:
        if all(m in op_name for m in marks):
            return stage
    return "other"


def module_name(text: str) -> str:
    """The compiled module's name (``HloModule jit_fused, ...``): the trace's ``hlo_module``."""
    return re.match(r"HloModule ([\w.\-]+)", text).group(1)


def thunk_times(trace_dir: str, instrs: dict, module: str, steps: int) -> dict:
    """{instruction name: (thunk-ms per step, calls per step)} from the perfetto trace: every
    complete event of ``module`` whose ``hlo_op`` is an instruction other than control flow.
    Where the trace has device tracks (a GPU's or TPU's kernels), only their events count:
    the host's launches of them would count the same instructions twice."""
    (path,) = Path(trace_dir).rglob("perfetto_trace.json.gz")
    with gzip.open(path) as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    devices = {
        e["pid"]
        for e in events
        if e.get("ph") == "M" and e.get("args", {}).get("name", "").startswith("/device:")
    }
    ms, calls = collections.Counter(), collections.Counter()
    for e in events:
        args = e.get("args") or {}
        name = args.get("hlo_op", "")
        if (
            e.get("ph") != "X"
            or args.get("hlo_module") != module
            or (devices and e.get("pid") not in devices)
            or name not in instrs
            or instrs[name]["opcode"] in CONTROL
        ):
            continue
        ms[name] += e.get("dur", 0) / 1e3 / steps
        calls[name] += 1 / steps
    return {n: (ms[n], calls[n]) for n in ms}


def traced(run, steps: int) -> tuple[str, float]:
    """Calls ``run()`` (one step, blocking) ``steps`` times under jax.profiler.trace with a
    perfetto trace and no Python tracer; returns (trace dir, wall seconds per step)."""
    options = jax.profiler.ProfileOptions()
    options.python_tracer_level = 0  # the step's thunks, not the Python around them
    trace_dir = tempfile.mkdtemp(prefix="grpo_jax_profile_")
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True, profiler_options=options):
        t0 = time.perf_counter()
        for _ in range(steps):
            run()
        wall = (time.perf_counter() - t0) / steps
    return trace_dir, wall


def trace_step(config, steps: int, warmup: int):
    """Builds, compiles and traces the step; returns (compiled HLO text, trace dir, wall s per
    step, matmul FLOPs per step by kind)."""
    task = build_task(config, "train")
    params0 = trainer.initial_params(config, task)
    step, inputs = task.build(params0)
    if step.host is not None:
        raise app.UsageError(
            "a Python reward splits the step in two programs: profile the device part with a "
            "jittable reward (--config.reward.terms)"
        )
    state = [task.make_state(params0)]  # each step consumes (donates) the state it is given
    jaxpr = jax.make_jaxpr(step.fused)(state[0], inputs).jaxpr
    flops = {k: matmul_flops_of(jaxpr, b) for k, b in KIND_BATCHED.items()}
    compiled = jax.jit(step.fused, donate_argnums=0).lower(state[0], inputs).compile()

    def run():
        state[0] = jax.block_until_ready(compiled(state[0], inputs))[0]

    for _ in range(warmup):
        run()
    return (compiled.as_text(), *traced(run, steps), flops)


def summarise(instrs: dict, times: dict, wall_s: float, top: int) -> dict:
    """Core-ms per step by kind, by stage, by stage and kind, and the costliest instructions."""
    by_kind, by_stage = collections.Counter(), collections.Counter()
    cross = collections.defaultdict(collections.Counter)
    rows = []
    for name, (ms, calls) in times.items():
        info = instrs[name]
        kind, stage = kind_of(name, info), stage_of(info["op_name"])
        by_kind[kind] += ms
        by_stage[stage] += ms
        cross[stage][kind] += ms
        rows.append(dict(instruction=name, kind=kind, stage=stage, thunk_ms=ms, calls=calls,
                         shape=info["shape"], op_name=info["op_name"]))  # fmt: skip
    rows.sort(key=lambda r: -r["thunk_ms"])
    return {
        "wall_ms_per_step": 1e3 * wall_s,
        "thunk_ms_per_step": sum(by_kind.values()),
        "by_kind": dict(by_kind.most_common()),
        "by_stage": dict(by_stage.most_common()),
        "by_stage_and_kind": {st: dict(cross[st]) for st in by_stage},
        "top": rows[:top],
    }


def markdown(res: dict) -> str:
    total, kinds = res["thunk_ms_per_step"], list(res["by_kind"])
    lines = [
        f"# Where the GRPO step's time goes ({res['name']})",
        "",
        f"{res['when']} on {res['machine']}; jax {res['jax']}; {res['device']}; compute dtype "
        f"{res['dtype']}. Command: `{res['command']}`.",
        "",
        f"Wall time {res['wall_ms_per_step']:.1f} ms per step ({res['steps']} traced steps); "
        f"the thunks' own durations add up to {total:.1f} thunk-ms per step (thunks overlap on "
        "the CPU's threads). Thunk-ms per step by stage (rows) and kind of work (columns):",
        "",
        "| stage | " + " | ".join(kinds) + " | total | share |",
        "| --- " * (len(kinds) + 3) + "|",
    ]
    cell = lambda ms: f"{ms:.1f}" if ms else "–"
    for stage, ms in res["by_stage"].items():
        row = res["by_stage_and_kind"][stage]
        cells = " | ".join(cell(row.get(k, 0.0)) for k in kinds)
        lines.append(f"| {stage} | {cells} | {ms:.1f} | {100 * ms / total:.0f} % |")
    cells = " | ".join(f"{res['by_kind'][k]:.1f}" for k in kinds)
    lines += [f"| all | {cells} | {total:.1f} | 100 % |", ""]
    gflop = res["matmul_gflop_per_step"]
    for kind, g in gflop.items():
        ms = res["by_kind"].get(kind, 0.0)
        lines.append(
            f"- {kind}: {g:.2f} GFLOP per step ({100 * g / sum(gflop.values()):.0f} % of the "
            f"matmul FLOPs) in {100 * ms / total:.0f} % of the thunk time: "
            f"{g / max(ms, 1e-9) * 1e3:.0f} GFLOP per thunk-second"
        )
    lines.append("")
    lines += ["| instruction | kind | stage | thunk-ms | calls | shape |", "| --- " * 6 + "|"]
    lines += [
        f"| {r['instruction']} | {r['kind']} | {r['stage']} | {r['thunk_ms']:.2f} | "
        f"{r['calls']:.0f} | `{r['shape']}` |"
        for r in res["top"]
    ]
    return "\n".join(lines) + "\n"


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    config = FLAGS.config
    hlo, trace_dir, wall, flops = trace_step(config, FLAGS.steps, FLAGS.warmup)
    instrs = parse_hlo(hlo)
    res = {
        "name": FLAGS.name,
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{platform.machine()}, {jax.local_devices()[0].device_kind}",
        "device": f"{jax.device_count()} x {jax.devices()[0].platform}",
        "jax": jax.__version__,
        "dtype": config.model.get("dtype", "float32"),
        "command": "python experiments/profile_step.py " + " ".join(sys.argv[1:]),
        "steps": FLAGS.steps,
        **summarise(
            instrs, thunk_times(trace_dir, instrs, module_name(hlo), FLAGS.steps), wall, FLAGS.top
        ),
        "matmul_gflop_per_step": {k: f / 1e9 for k, f in flops.items()},
    }
    shutil.rmtree(trace_dir)  # tens of MB per traced step
    if FLAGS.out_dir:
        out = Path(FLAGS.out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{FLAGS.name}.json").write_text(json.dumps(res, indent=1) + "\n")
        (out / f"{FLAGS.name}.md").write_text(markdown(res))
        if FLAGS.hlo:
            (out / f"{FLAGS.name}.hlo.txt").write_text(hlo)
    print(markdown(res))
    print(json.dumps(res))  # the last line: what gpu_suite.py's profile part reads


if __name__ == "__main__":
    flags.mark_flags_as_required(["config"])
    app.run(main)
