"""The GPU suite's outputs (experiments/gpu_suite.py writes them): the figures of each part
from its children's records (MFU from gpu_suite_parts), the targets (value, threshold, met),
and the JSON and markdown written after every measurement."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

from gpu_suite_markdown import markdown
from gpu_suite_parts import decode_bytes, rollout_floor, utilisation
from gpu_suite_plan import LARGE_PARTS, SUITE_BUDGET_S

# the exhaustive-GRPO guide's figures: V -> (seconds per iteration, bytes); None = infeasible
GUIDE = {65: (6.0, 12e9), 256: (24.0, 48e9), 1000: (95.0, 190e9), 50000: None}
GPU_MEMORY_TARGET = 80e9  # "within 80 GB"


# ---- figures from the children's records


def bench_figures(r: dict, dtype: str, info: dict) -> dict:
    """A benchmark.py record's figures: s/step, tokens/s, memory, MFU (the step and each of
    its halves, from the record's own FLOP counts, against the peak of every device of the
    record's mesh)."""
    if "error" in r:
        return r
    med, roof, bd = r["median_step_s"], r.get("roofline") or {}, r["breakdown"]
    devices = (r.get("per_device") or {}).get("num_devices", 1)  # benchmark.py's mesh
    peak = roof.get("matmul_peak_gflops")  # at the model's shapes; a CPU's only
    out = {
        "dtype": dtype,
        "params": r["params"],
        "median_step_s": med,
        "steps_per_s": 1 / med,
        "generated_tokens_per_step": r["tokens_per_step"],
        "tokens_per_s": r["tokens_per_s"],
        "compile_s": r["compile_s"],
        "step_times_s": r["step_times_s"],
        "peak_memory_bytes": r["peak_memory_bytes"],
        "peak_memory_source": r["peak_memory_source"],
        "matmul_flops": roof.get("matmul_flops"),
        "xla_flops": roof.get("xla_flops"),
        "matmul_peak_at_model_shapes_flops_per_s": None if peak is None else peak * 1e9,
        "step": utilisation(roof.get("matmul_flops"), med, dtype, info, devices),
        "rollout_s": bd["rollout_s"],
        "update_s": bd["update_s"],
        "benchmark_device": r["device"],
        "wall_s": r["wall_s"],
        "command": r["command"],
    }
    if r.get("note"):  # how a measurement made outside the suite was made
        out["note"] = r["note"]
    for half in ("rollout", "update"):
        flops = roof.get(f"{half}_matmul_flops")
        out[f"{half}_matmul_flops"] = flops
        out[half] = utilisation(flops, bd[f"{half}_s"], dtype, info, devices)
        if roof.get(f"{half}_matmul_uncounted"):  # left out of its FLOPs and MFU: say so
            out[f"{half}_matmul_uncounted"] = roof[f"{half}_matmul_uncounted"]
    nbytes = decode_bytes(r.get("overrides", {}), r["params"])
    loop = roof.get("rollout_loop_matmul_flops")
    out["rollout_floor"] = None  # decode_bytes models one device's reads
    if devices == 1:
        out["rollout_floor"] = rollout_floor(
            out["rollout_matmul_flops"], loop, bd["rollout_s"], nbytes, dtype, info
        )
    return out


def exhaustive_figures(r: dict, v: int, info: dict) -> dict:
    """A scaling.py run's record with MFU and the guide's figures beside it."""
    if "error" in r:
        return r
    dtype = r["model"].split()[-1]
    r["utilisation"] = utilisation(r.get("matmul_flops"), r["median_step_s"], dtype, info)
    guide = GUIDE.get(v)  # (at --smoke's tiny sizes the ratios mean nothing)
    r["guide"] = {"s_per_iteration": guide[0], "bytes": guide[1]} if guide else "infeasible"
    if guide:
        r["speedup_vs_guide"] = guide[0] / r["median_step_s"]
        r["memory_vs_guide"] = guide[1] / r["peak_memory_bytes"]
    return r


def assemble(jobs: list) -> tuple[dict, dict]:
    """(results by part, each part's summed child wall time) of the jobs done so far."""
    by_part: dict = {}
    for j in jobs:
        if "result" in j:
            by_part.setdefault(j["part"], {})[j["key"]] = j["result"]
    info = by_part.get("probe", {}).get("device", {"error": "not run yet"})
    peaks = by_part.get("peak", {})  # a failed peak leaves that dtype's measured MFU unknown
    info = {**info, "measured_peak": {d: r for d, r in peaks.items() if "error" not in r}}
    results = {"probe": info}
    if peaks:
        results["peak"] = peaks
    if "step" in by_part:
        results["step"] = {d: bench_figures(r, d, info) for d, r in by_part["step"].items()}
    if "trl" in by_part:
        results["trl"] = by_part["trl"]
    if "exhaustive" in by_part:
        results["exhaustive"] = {
            v: exhaustive_figures(r, int(v), info) for v, r in by_part["exhaustive"].items()
        }
    for part in LARGE_PARTS:  # keyed by prompts per step
        if part in by_part:
            results[part] = {
                b: bench_figures(r, r.get("overrides", {}).get("model.dtype"), info)  # None: error
                for b, r in by_part[part].items()
            }
    if "profile" in by_part:
        results["profile"] = by_part["profile"]
    wall = {part: sum(r.get("wall_s", 0.0) for r in rs.values()) for part, rs in by_part.items()}
    return results, wall


# ---- the outputs


def record(jobs: list, p: dict, *, smoke: bool, final: bool, t0: float, **run) -> dict:
    """The suite's JSON record of the jobs done so far (``run``: its command, the checkout's
    git state, child_env, workers and the device lock's summary, None with one worker; ``t0``:
    its start, ``time.perf_counter()``)."""
    results, part_wall = assemble(jobs)
    info, wall = results["probe"], time.perf_counter() - t0
    # a resumed record holds earlier calls' measurements: this call's time is not the suite's
    kept = sorted(
        {j["result"]["resumed_from"] for j in jobs if "resumed_from" in j.get("result", {})}
    )
    why = f"not one run: measurements kept from {', '.join(kept)}" if kept else ""
    return {
        "suite": "experiments/gpu_suite.py (issue 15)",
        "smoke": smoke,
        "complete": final,
        "command": run["command"],
        "git": run["git"],
        "device": {k: v for k, v in info.items() if k != "command"},
        "dtypes": list(p["dtypes"]),
        "child_env": run["child_env"],
        "workers": run["workers"],
        "device_lock": run["device_lock"],
        "plan": p,
        "part_wall_s": part_wall,
        "wall_s": wall,
        "targets": targets(
            results, info.get("platform") == "gpu", None if kept else wall, smoke, why
        ),
        "results": results,
        "commands": [j["result"]["command"] for j in jobs if "command" in j.get("result", {})],
        # each child's own record, as it printed it (what --resume reads back)
        "child_records": [
            {"part": j["part"], "key": j["key"], "result": j["result"]}
            for j in jobs
            if "result" in j
        ],
    }


def fold(calls: list, paths: list, drop_parts=()) -> dict:
    """The last call's record with the first call's suite wall time (``calls``: the records,
    the first a default suite in one call; ``paths``: where each was read, for the record).
    ``drop_parts``: parts left out everywhere, the targets recomputed without them."""
    first, raw = calls[0], json.loads(json.dumps(calls[-1]))  # a copy: the input stays whole
    if not raw["complete"] or not first["complete"]:
        raise SystemExit("error: a call's record is partial (complete: false); resume it first")
    if any(flag in first["command"] for flag in ("--resume", "--parts")):
        raise SystemExit(
            f"error: {paths[0]} ran `{first['command']}`, not the default suite; give the "
            "default suite's call first"
        )
    for part in drop_parts:
        raw["child_records"] = [r for r in raw["child_records"] if r["part"] != part]
        for key in ("results", "part_wall_s", "plan"):
            raw[key].pop(part, None)
        expect = raw["plan"].get("expect", {})
        raw["plan"]["expect"] = {k: v for k, v in expect.items() if k.split()[0] != part}
    raw["commands"] = [c for r in raw["child_records"] for c in [r["result"].get("command")] if c]
    later = ", ".join(
        f"{Path(p).stem} {c['wall_s']:.0f} s" for p, c in zip(paths[1:], calls[1:], strict=True)
    )
    raw["wall_s"], raw["device_lock"] = None, first["device_lock"]
    gpu = raw["device"].get("platform") == "gpu"
    raw["targets"] = targets(raw["results"], gpu, first["wall_s"], raw["smoke"])
    raw["targets"]["suite wall time (s)"]["note"] = (
        f"{Path(paths[0]).stem} alone, the default suite {first['workers']} at a time: "
        f"{first['wall_s']:.0f} s; later calls resumed it: {later}"
    )
    raw["assembled_from"] = [str(p) for p in paths]
    return raw


def write(raw: dict, out_dir: Path, name: str = "") -> Path:
    """Writes ``<out_dir>/<name>.json`` and ``.md`` (``name`` '': gpu_suite_<device>[_smoke]);
    returns their path less the suffix."""
    name = name or f"gpu_suite_{slug(raw['device'].get('device_kind', 'unknown'))}" + (
        "_smoke" if raw["smoke"] else ""
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{name}.json").write_text(json.dumps(raw, indent=1, default=str))
    (out_dir / f"{name}.md").write_text(markdown(raw))
    return out_dir / name


def slug(device_kind: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", device_kind.lower()).strip("-") or "unknown"


# ---- targets


def target(value, threshold, op: str, gpu: bool, why: str = "", smoke: bool = False) -> dict:
    """One check: met is True/False on a GPU run, "n/a (...)" otherwise or without a value."""
    t = {"value": value, "threshold": f"{op} {threshold:g}"}
    if smoke:
        t["met"] = "n/a (smoke)"
    elif value is None:
        t["met"] = f"n/a ({why or 'not measured'})"
    elif not gpu:
        t["met"] = "n/a (not a GPU)"
    else:
        t["met"] = bool(value >= threshold if op == ">=" else value <= threshold)
    return t


def targets(results: dict, gpu: bool, wall_s, smoke: bool, wall_why: str = "") -> dict:
    """The issue's targets, by name (all "n/a (smoke)" with --smoke). ``wall_s``: the suite's
    wall time, or None with ``wall_why`` for a record that is not one run."""

    def check(value, threshold, op: str, why: str = "") -> dict:
        return target(value, threshold, op, gpu, why, smoke)

    out = {}
    step, trl = results.get("step", {}), results.get("trl", {})
    for dtype in ("float32", "bfloat16"):
        ours, theirs = step.get(dtype, {}), trl.get(dtype, {})
        ratio, why = None, theirs.get("skipped") or theirs.get("error") or ours.get("error")
        if "median_step_s" in ours and "median_step_s" in theirs:
            ratio = theirs["median_step_s"] / ours["median_step_s"]
        out[f"step {dtype}: TRL s/step ÷ grpo_jax s/step"] = check(ratio, 20, ">=", why)
    exh = results.get("exhaustive", {})
    for v in (65, 256, 1000):
        r = exh.get(str(v), {})
        why = r.get("error", "not run")
        out[f"exhaustive V={v}: guide time ÷ measured"] = check(
            r.get("speedup_vs_guide"), 20, ">=", why
        )
        out[f"exhaustive V={v}: guide memory ÷ peak bytes"] = check(
            r.get("memory_vs_guide"), 5, ">=", why
        )
    r = exh.get("50000", {})
    why = r.get("error", "not run")
    out["exhaustive V=50,000 (KL reference): s / iteration"] = check(
        r.get("median_step_s"), 60, "<=", why
    )
    out["exhaustive V=50,000 (KL reference): peak GB"] = check(
        r["peak_memory_bytes"] / 1e9 if "peak_memory_bytes" in r else None,
        GPU_MEMORY_TARGET / 1e9,
        "<=",
        why,
    )
    for batch, large in results.get("large", {}).items():
        name = f"large model, {batch} prompts: rollout MFU (nominal peak)"
        mfu = (large.get("rollout") or {}).get("mfu_nominal")
        out[name] = check(mfu, 0.20, ">=", large.get("error", "no nominal peak for this device"))
        out[name]["threshold"] = ">= 20 %"
    out["suite wall time (s)"] = check(wall_s, SUITE_BUDGET_S, "<=", wall_why)
    return out
