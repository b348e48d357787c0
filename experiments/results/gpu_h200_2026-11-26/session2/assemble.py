"""One-off (2026-11-26, second H200 session): the H200 record rebuilt from session 1's
record and this session's second device call, whose children ran outside the suite because
the suite's probe had spent call 1 compiling its bfloat16 matmul-peak loop (call1_*.log).

  python experiments/results/gpu_h200_2026-11-26/session2/assemble.py

Reads experiments/results/gpu_suite_nvidia-h200.json and this folder's call2_*.out; writes the
record's .json and .md in place through gpu_suite_report (the suite's own figures and targets).
"""

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[3]
sys.path.insert(0, str(ROOT / "experiments"))

import gpu_suite_report as report  # noqa: E402
from gpu_suite_parts import exhaustive_jobs, large_job, shown  # noqa: E402
from gpu_suite_plan import plan  # noqa: E402

RECORD = ROOT / "experiments/results/gpu_suite_nvidia-h200.json"
CALL2_HEAD = "0781731"  # the checkout call 2 ran (clean), before this session's changes
S2 = "experiments/results/gpu_h200_2026-11-26/session2"
BESIDE = (
    "measured in one device call beside the V = 50,000 run on the same H200 (both with "
    "XLA_PYTHON_CLIENT_PREALLOCATE=false): the peak bytes are this process's own; the time is "
    "not a solo figure"
)
NOTES = {
    "65": f"{BESIDE} (session 1, the loss all at once and alone: 0.039 s, 2.42 GiB)",
    "256": f"{BESIDE} (session 1, the loss all at once and alone: 0.092 s, 9.25 GiB)",
    "50000": "bfloat16 matmuls (params float32), its first 100 s beside V = 65 and 256 (their "
    "compiles and about 1.5 s of GPU work); session 1, float32 (TF32) and alone: 104.1 s, "
    "13.86 GiB (gpu_h200_2026-11-26/call2_v50000.json)",
}
LARGE_FLOPS = {  # benchmark.py --flops_only on the CPU: the traced program, any device's
    "matmul_flops": 33552185032704,
    "rollout_matmul_flops": 13392426565632,
    "update_matmul_flops": 20159758467072,
}


# each child's wall time from the call's "rc ... at N s" lines (V = 65 and 50,000 from the
# call's start, its wheel install included: upper bounds)
WALL_S = {"v65": 46.0, "v256": 103.0 - 46.0, "v50k_bf16": 132.0, "large": 231.0 - 132.0}


def out(name: str) -> dict:
    res = json.loads((HERE / f"call2_{name}.out").read_text().splitlines()[-1])
    return {**res, "wall_s": WALL_S[name]}


def main():
    old = json.loads(RECORD.read_text())
    p = plan(False)
    new = {("exhaustive", k) for k in NOTES} | {("large", "bfloat16")}
    jobs = [dict(r) for r in old["child_records"] if (r["part"], r["key"]) not in new]
    probe = jobs[0]["result"]
    probe.pop("error", None)
    probe["jaxlib"] = "0.11.2"  # call2_env.txt
    probe["source"] = (
        "nvidia-smi and python3 -c 'import jax, jaxlib' in the same calls: the probe child "
        "timed out both sessions (180 s, 300 s) compiling its matmul-peak loop"
    )
    probe["float32_matmuls"] = probe["float32_matmuls"].replace(
        "no float32 peak was measured in this run", "no peak was measured on this device"
    )
    for d in p["dtypes"]:
        err = "not measured: the probe that measured both dtypes in one process timed out"
        jobs.append({"part": "peak", "key": d, "result": {"error": err}})
    at = {"head": CALL2_HEAD, "dirty": [], "note": f"session 2, call 2 ({S2})"}
    by_v = {j["key"]: j for j in exhaustive_jobs(p["exhaustive"])}
    for v, name in (("65", "v65"), ("256", "v256"), ("50000", "v50k_bf16")):
        res = {**out(name), "command": shown(by_v[v]["cmd"], ""), "note": NOTES[v]}
        jobs.append({"part": "exhaustive", "key": v, "result": {**res, "measured_at": at}})
    large = out("large")
    cmd = shown(large_job(p["large"])["cmd"], "") + " --noroofline"
    large["roofline"] = dict(LARGE_FLOPS)
    large["note"] = (
        "run with --noroofline (the roofline then also timed matmuls at the model's shapes, "
        "which compiles for minutes on this GPU; now it times them on a CPU only); the FLOPs "
        f"counted on the CPU by the same command with --flops_only instead ({S2}/assemble.py)"
    )
    jobs.append({"part": "large", "key": "bfloat16", "result": {**large, "command": cmd,
                                                                 "measured_at": at}})  # fmt: skip
    order = ("probe", "peak", "step", "trl", "exhaustive", "large", "profile")
    jobs.sort(key=lambda j: (order.index(j["part"]), j["part"] != "exhaustive" or int(j["key"])))
    run = {
        "command": f"python {S2}/assemble.py",
        "git": old["git"],
        "child_env": old["child_env"],
        "workers": 1,
    }
    raw = report.record(jobs, p, smoke=False, final=True, t0=0.0, **run)
    raw["wall_s"] = None
    raw["targets"] = report.targets(raw["results"], True, None, False)
    raw["targets"]["suite wall time (s)"]["met"] = (
        "n/a (not one run: session 1's two calls and session 2's call 2 assembled)"
    )
    raw["assembled_from"] = [*old.get("assembled_from", []), f"{S2}/call2_*.out"]
    report.write(raw, RECORD.parent, RECORD.stem)
    print(report.markdown(raw))


if __name__ == "__main__":
    main()
