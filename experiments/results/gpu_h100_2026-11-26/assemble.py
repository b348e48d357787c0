"""One-off (2026-11-26, the first H100 lease): the H100 record from the lease's two calls.

  python experiments/results/gpu_h100_2026-11-26/assemble.py

Call 1 ran the whole suite, three children at a time, at 634e215 (call1.*, 545 s): every part
but two measured; ``large 16`` and ``profile large`` ran out of GPU memory beside ``large 32``
and V = 50,000, and their retries alone found the budget spent. Call 2 resumed call 1's record
with ``--parts=large,profile --jobs=1`` (call2.*, 217 s) and measured both. That checkout's
--resume dropped the kept parts outside --parts from its record, so this script puts call 1's
children back beside call 2's (what --resume now does itself) and writes the record's .json
and .md through gpu_suite_report: the suite's own figures and targets.

Superseded by gpu_h100_2026-11-27/assemble.py: the top-level record is that lease's now, and
running this script would write the first lease's back over it.
"""

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
sys.path.insert(0, str(ROOT / "experiments"))

import gpu_suite_report as report  # noqa: E402
from gpu_suite_plan import SUITE_BUDGET_S  # noqa: E402

ORDER = ("probe", "peak", "step", "trl", "exhaustive", "large", "profile")
REL = "experiments/results/gpu_h100_2026-11-26"


def ok(r: dict) -> bool:
    return not ({"error", "skipped"} & set(r["result"]))


def main():
    call1, call2 = (json.loads((HERE / f"call{i}.json").read_text()) for i in (1, 2))
    second = {(r["part"], r["key"]) for r in call2["child_records"] if ok(r)}
    jobs = [
        {**r, "result": {**r["result"], "measured_at": {**call1["git"], "call": f"{REL}/call1"}}}
        for r in call1["child_records"]
        if (r["part"], r["key"]) not in second
    ]
    jobs += [r for r in call2["child_records"] if (r["part"], r["key"]) not in {
        (j["part"], j["key"]) for j in jobs}]  # fmt: skip
    jobs.sort(key=lambda j: (ORDER.index(j["part"]), j["part"] != "exhaustive" or int(j["key"])))
    run = {
        "command": f"python {REL}/assemble.py",
        "git": call1["git"],
        "child_env": call1["child_env"],
        "workers": call1["workers"],
        "device_lock": call1["device_lock"],
    }
    raw = report.record(jobs, call1["plan"], smoke=False, final=True, t0=0.0, **run)
    raw["wall_s"] = None
    raw["targets"] = report.targets(raw["results"], True, None, False)
    failed = [f"{r['part']} {r['key']}" for r in call1["child_records"] if not ok(r)]
    raw["targets"]["suite wall time (s)"].update(
        value=call1["wall_s"],
        met=call1["wall_s"] <= SUITE_BUDGET_S,
        note=f"call 1 alone, the whole suite {call1['workers']} at a time: "
        f"{call1['wall_s']:.0f} s, {', '.join(failed)} failed; call 2 measured them "
        f"{call2['workers']} at a time in {call2['wall_s']:.0f} s",
    )
    raw["assembled_from"] = [f"{REL}/call1.json", f"{REL}/call2.json"]
    path = report.write(raw, ROOT / "experiments/results", "gpu_suite_nvidia-h100-80gb-hbm3")
    print(report.markdown(raw))
    print(f"wrote {path}.json and .md")


if __name__ == "__main__":
    main()
