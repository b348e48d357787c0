"""Reading an XLA:CPU (or GPU/TPU) profile of one jitted program: the compiled HLO parsed into
instructions, each classified by kind of work and by stage of the GRPO step, the
``jax.profiler`` trace's per-instruction times summed per kind and stage, and the markdown
report. experiments/profile_step.py runs it on the GRPO step (its docstring defines the kinds
and stages); this module has no flags, so tests and other scripts import it freely."""

import collections
import gzip
import json
import re
import tempfile
import time
from pathlib import Path

import jax

KIND_BATCHED = {"matmul": False, "batched matmul": True}  # flop_count.matmul_flops_of's split
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
# XLA:GPU runs most matmuls as library calls, custom-calls that hold no dot: cuBLAS(Lt) GEMMs
# (their batch dimensions in the backend config's JSON) and cuDNN's fused attention
_GEMM_CALL = re.compile(r"^__cublas\$")
_ATTENTION_CALL = re.compile(r"^__cudnn\$fmha")
_JSON_BATCH = re.compile(r'"lhs_batch_dimensions":\[\s*"?\d')
_INSTR = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (.+?) ([\w\-]+)\(")  # tuple shapes have spaces
_COMP = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) .*\{\s*$")


def parse_hlo(text: str) -> dict:
    """{instruction name: {"shape", "opcode", "op_name", "comp", "calls", "body", "batched",
    "target", "loop_body", "trip", "constant", ...}} for every instruction of every
    computation. "comp": the computation it is in; "calls": the computations it calls;
    "body" lists the opcodes of the computation a fusion calls (does it hold a dot, a
    reduce, a gather); "batched": a dot with batch dimensions, the instruction's own, one in
    its body, or a cuBLAS call's (its backend config's ``lhs_batch_dimensions``); "target":
    a custom-call's ``custom_call_target``; a while's "loop_body" (its body computation)
    and "trip" (XLA's known trip count; where XLA names none, as on a TPU, a scan's
    (scan_trip); else None); "constant": an integer scalar constant's value.
    An instruction without an op_name (XLA drops some inside loop bodies) takes the op_name
    of the instruction that calls its computation, so a decode step's ops still name their
    stage."""
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
        target = re.search(r'custom_call_target="([^"]*)"', line)
        target = target.group(1) if target else ""
        batched = "lhs_batch_dims" in line or bool(_JSON_BATCH.search(line))
        bodies[comp].append((opcode, batched))
        op_name = re.search(r'op_name="([^"]*)"', line)
        called = re.findall(r"(?:calls|body|condition|to_apply)=%?([\w.\-]+)", line)
        branches = re.search(r"branch_computations=\{([^}]*)\}", line)
        called += re.findall(r"%?([\w.\-]+)", branches.group(1)) if branches else []
        for callee in called:
            caller.setdefault(callee, name)
        op_name = op_name.group(1) if op_name else ""
        loop = re.search(r"body=%?([\w.\-]+)", line)
        cond = re.search(r"condition=%?([\w.\-]+)", line)
        trip = re.search(r'known_trip_count":\{"n":"(\d+)"', line)
        value = re.search(r"\bconstant\((-?\d+)\)", line) if shape.startswith("s32[]") else None
        instrs[name] = dict(shape=shape, opcode=opcode, comp=comp, batched=batched,
                            op_name=op_name, calls=called, target=target,
                            loop_body=loop.group(1) if loop else None,
                            loop_cond=cond.group(1) if cond else None,
                            trip=int(trip.group(1)) if trip else None,
                            constant=int(value.group(1)) if value else None,
                            less_than="direction=LT" in line)  # fmt: skip
    in_comp = collections.defaultdict(list)
    for info in instrs.values():
        in_comp[info["comp"]].append(info)
    for info in instrs.values():
        if info["opcode"] == "while" and info["trip"] is None:
            info["trip"] = scan_trip(in_comp[info["loop_cond"]])
    for name, info in instrs.items():
        body = [op for callee in info["calls"] for op in bodies.get(callee, [])]
        info["body"] = sorted({op for op, _ in body})
        info["batched"] |= any(b for op, b in body if op == "dot")
        up = name
        while not info["op_name"] and up in instrs and instrs[up]["comp"] in caller:
            up = caller[instrs[up]["comp"]]
            info["op_name"] = instrs[up]["op_name"] if up in instrs else ""
    return instrs


def scan_trip(cond: list) -> int | None:
    """A ``lax.scan``'s trip count from its while's condition (the condition computation's
    parsed instructions), for HLO whose whiles carry no known_trip_count (XLA:TPU's): a
    scan's counter runs from 0 by 1, and its condition is ``counter < N`` with N its one
    integer constant. None for any other condition."""
    ops = [i for i in cond if i["opcode"] != "parameter"]
    consts = [i["constant"] for i in ops if i["opcode"] == "constant"]
    compares = [i for i in ops if i["opcode"] == "compare"]
    if len(consts) == 1 and consts[0] is not None and len(compares) == 1:
        return consts[0] if compares[0]["less_than"] else None
    return None


def kind_of(name: str, info: dict) -> str:
    """The kind of work one instruction does (see the module docstring)."""
    ops = set(info["body"]) | {info["opcode"]}
    target = info.get("target", "")
    if _ATTENTION_CALL.match(target):  # its scores and values are batched dots
        return "batched matmul"
    if "dot" in ops or "convolution" in ops or _GEMM_CALL.match(target):
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


# instructions that launch no work of their own: a loop body's kernels are the others
NO_KERNEL = {"parameter", "get-tuple-element", "tuple", "bitcast", "constant"}


def decode_loops(instrs: dict) -> list:
    """The rollout's decode loops (one per cache segment), in the module's order: for each
    while of the rollout whose body runs the model's decode step (its other loops, such as a
    reference's, are left out), its trip count and the instructions its body runs at every
    decode step (NO_KERNEL's left out), each as (name, kind, layer or None, source op,
    shape); the layer from the op's ``blocks_<i>`` scope, None outside the layers (the
    sampler, the logits, the cache bookkeeping)."""
    in_comp = collections.defaultdict(list)
    for k, ki in instrs.items():
        if ki["opcode"] not in NO_KERNEL:
            in_comp[ki["comp"]].append(k)
    loops = []
    for name, info in instrs.items():
        # by its body, not its own name: inside a shard_map the while is named by the map
        if info["opcode"] != "while" or "rollout" not in info["op_name"]:
            continue
        kernels = []
        for k in in_comp[info["loop_body"]]:
            ki = instrs[k]
            layer = re.search(r"blocks_(\d+)", ki["op_name"])
            layer = int(layer.group(1)) if layer else None
            kernels.append((k, kind_of(k, ki), layer, source_op(ki["op_name"]), ki["shape"]))
        if any("Transformer.decode" in k[3] for k in kernels):  # not another rollout loop
            loops.append(dict(name=name, trip=info["trip"], kernels=kernels))
    return loops


def write_results(out_dir: str, name: str, res: dict, md: str, hlo: str | None = None):
    """``res`` as ``<out_dir>/<name>.json``, its markdown as ``.md`` and, given, the compiled
    HLO as ``.hlo.txt``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(res, indent=1) + "\n")
    (out / f"{name}.md").write_text(md)
    if hlo is not None:
        (out / f"{name}.hlo.txt").write_text(hlo)


def module_name(text: str) -> str:
    """The compiled module's name (``HloModule jit_fused, ...``): the trace's ``hlo_module``."""
    return re.match(r"HloModule ([\w.\-]+)", text).group(1)


def thunk_times(trace_dir: str, instrs: dict, module: str, steps: int) -> tuple[dict, dict]:
    """({instruction name: (thunk-ms per step, calls per step)}, what matched none) from the
    perfetto trace: every complete event of ``module`` whose ``hlo_op`` (or its last ``/``
    part) is an instruction other than control flow. Where the trace has device tracks (a
    GPU's or TPU's kernels), only their events count: the host's launches of them would count
    the same instructions twice.

    The second dict (ms and events per step, a few of their names) is the time this could not
    attribute: on device tracks every kernel that names no instruction of ``module`` (a CUDA
    graph's kernels may carry no ``hlo_op``: on one H100 with command buffers on, 15.6 of the
    step's 19.9 ms), on a CPU the module's events of instructions not in its HLO."""
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
    lost = {"ms_per_step": 0.0, "events_per_step": 0.0, "names": collections.Counter()}
    for e in events:
        args = e.get("args") or {}
        name = args.get("hlo_op", "")
        name = name if name in instrs else name.rsplit("/", 1)[-1]
        ours = args.get("hlo_module") == module
        if e.get("ph") != "X" or (e.get("pid") not in devices if devices else not ours):
            continue
        if not ours or name not in instrs:
            lost["ms_per_step"] += e.get("dur", 0) / 1e3 / steps
            lost["events_per_step"] += 1 / steps
            lost["names"][name or e.get("name", "?")] += 1
        elif instrs[name]["opcode"] not in CONTROL:
            ms[name] += e.get("dur", 0) / 1e3 / steps
            calls[name] += 1 / steps
    lost["names"] = [n for n, _ in lost["names"].most_common(5)]
    return {n: (ms[n], calls[n]) for n in ms}, lost


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


def source_op(op_name: str) -> str:
    """An op_name without the jit's name, its layer indices and the loops' scopes, so that
    one op of the model sums over its layers and loop bodies into one row:
    ``rollout/Transformer.decode/blocks_*/bghts,bghsd->bgthd/dot_general``."""
    name = re.sub(r"^jit\([^)]*\)/", "", op_name)
    name = re.sub(r"(while/body/|eval_jaxpr/|closed_call/|checkpoint/|remat/)", "", name)
    return re.sub(r"blocks_\d+", "blocks_*", name) or "(unnamed)"


def summarise(instrs: dict, timing: tuple, wall_s: float, top: int) -> dict:
    """Core-ms per step by kind, by stage, by stage and kind, the costliest instructions, the
    costliest source ops of each stage (every layer's and loop segment's instructions of one
    op summed: ``by_op``, ``top`` per stage, costliest first) and the time no instruction
    claimed (``timing``: thunk_times's pair)."""
    times, unattributed = timing
    by_kind, by_stage = collections.Counter(), collections.Counter()
    cross = collections.defaultdict(collections.Counter)
    rows, ops = [], collections.defaultdict(lambda: [0.0, 0])
    for name, (ms, calls) in times.items():
        info = instrs[name]
        kind, stage = kind_of(name, info), stage_of(info["op_name"])
        by_kind[kind] += ms
        by_stage[stage] += ms
        cross[stage][kind] += ms
        rows.append(dict(instruction=name, kind=kind, stage=stage, thunk_ms=ms, calls=calls,
                         shape=info["shape"], op_name=info["op_name"]))  # fmt: skip
        op = ops[(source_op(info["op_name"]), kind, stage)]
        op[0] += ms
        op[1] += 1
    rows.sort(key=lambda r: -r["thunk_ms"])
    by_op = [dict(op=o, kind=k, stage=st, thunk_ms=ms, instructions=n)
             for (o, k, st), (ms, n) in ops.items()]  # fmt: skip
    by_op.sort(key=lambda r: -r["thunk_ms"])
    # each stage's own costliest: a cut over all stages can leave a stage out where its ops
    # time close to another's, which changes from run to run
    seen, kept = collections.Counter(), []
    for r in by_op:
        seen[r["stage"]] += 1
        if seen[r["stage"]] <= top:
            kept.append(r)
    return {
        "wall_ms_per_step": 1e3 * wall_s,
        "thunk_ms_per_step": sum(by_kind.values()),
        "by_kind": dict(by_kind.most_common()),
        "by_stage": dict(by_stage.most_common()),
        "by_stage_and_kind": {st: dict(cross[st]) for st in by_stage},
        "top": rows[:top],
        "by_op": kept,
        "by_op_per_stage": top,
        "unattributed": unattributed,
    }


def matmul_busy(res: dict) -> tuple[float, float]:
    """(matmul GFLOP per step, ms per step of the kernels or thunks filed as matmuls of either
    kind): the only rate the two splits support together. The FLOPs split dense / batched by
    the jaxpr's dot_generals (flop_count.is_batched), the times by the compiled instructions
    (kind_of), and the compiler does not keep that line: XLA:GPU runs the H100 decode loop's
    plain qkv and out products as batched cuBLAS GEMMs (20.4 ms a step of the large model), so
    a rate per kind divided one kind's FLOPs by another's kernels (761 TFLOP/s "dense")."""
    kinds = res["matmul_gflop_per_step"]
    return sum(kinds.values()), sum(res["by_kind"].get(k, 0.0) for k in kinds)


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
    total = total or float("nan")  # nothing attributed: the shares say so, no crash
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
            f"matmul FLOPs) in {100 * ms / total:.0f} % of the thunk time"
        )
    g, ms = matmul_busy(res)
    lines.append(
        f"- all matmuls: {g:.2f} GFLOP per step in {ms:.1f} thunk-ms: "
        f"{g / max(ms, 1e-9) * 1e3:.0f} GFLOP per thunk-second (no rate per kind: the "
        "FLOPs split by the jaxpr, the thunks by the compiled HLO)"
    )
    if "unattributed" in res:  # records from before it was measured make no claim
        lines.append(unattributed_line(res["unattributed"]))
    lines.append("")
    lines += ["| instruction | kind | stage | thunk-ms | calls | shape |", "| --- " * 6 + "|"]
    lines += [
        f"| {r['instruction']} | {r['kind']} | {r['stage']} | {r['thunk_ms']:.2f} | "
        f"{r['calls']:.0f} | `{r['shape']}` |"
        for r in res["top"]
    ]
    if "by_op" in res:  # records from before it was kept
        n = res.get("by_op_per_stage")  # records from before it cut over the whole step: None
        cut = f" of each stage ({n} per stage)" if n else ""
        lines += [
            "",
            f"The costliest source ops{cut}, every layer's and loop segment's instructions summed:",
        ]
        lines += ["", "| op | kind | stage | thunk-ms | instructions |", "| --- " * 5 + "|"]
        lines += [
            f"| `{r['op']}` | {r['kind']} | {r['stage']} | {r['thunk_ms']:.2f} | "
            f"{r['instructions']} |"
            for r in res["by_op"]
        ]
    return "\n".join(lines) + "\n"


def unattributed_line(lost: dict) -> str:
    """The traced time no instruction of the step's module claimed, in one line."""
    if not lost["events_per_step"]:
        return "- every traced event of the step was attributed to an instruction"
    return (
        f"- not attributed to an instruction: {lost['ms_per_step']:.2f} ms per step in "
        f"{lost['events_per_step']:.0f} events (e.g. {', '.join(lost['names'])})"
    )
