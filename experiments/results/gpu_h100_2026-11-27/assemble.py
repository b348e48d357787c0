"""One-off (2026-11-27, the second H100 lease): the H100 record from the lease's three calls.

  python experiments/results/gpu_h100_2026-11-27/assemble.py

The device's copy of the checkout reports its git state as 9b76044 with six files modified:
the tree of a13d08e (the copy's .git predates this session's two commits).
- Call 1 ran the default suite in one call, three children at a time (call1.*, 497 s): every
  default part measured, none failed.
- Call 2 resumed it with ``--parts=decode,attention`` (call2.*, 155 s): the large model at 16
  prompts with ``model.decode_attention=reduce`` and with ``model.attention=cudnn``. The
  ``reduce`` rollout took 0.2819 s against the default's 0.2806 s, so the setting and the
  suite's decode part were deleted; this record leaves them out (call2.md keeps them).
- Call 3 resumed call 2 with ``--parts=profile`` (call3.*, 130 s): profiles of the step and
  of the large model, XLA:GPU's command buffers off.
Call 3's record holds every measurement. Its wall-time target is n/a (a resumed record); this
script gives that target call 1's time, the one call that ran the default suite, and writes
the record's .json and .md through gpu_suite_report (the device lock's line: call 1's too).
"""

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
sys.path.insert(0, str(ROOT / "experiments"))

import gpu_suite_report as report  # noqa: E402
from gpu_suite_plan import SUITE_BUDGET_S  # noqa: E402

REL = "experiments/results/gpu_h100_2026-11-27"


def main():
    call1, call2, raw = (json.loads((HERE / f"call{i}.json").read_text()) for i in (1, 2, 3))
    call3_s, raw["wall_s"] = raw["wall_s"], None
    # the decode part measured model.decode_attention=reduce, deleted after this lease (no
    # faster than the default); its figures stay in call2.md
    raw["child_records"] = [r for r in raw["child_records"] if r["part"] != "decode"]
    raw["commands"] = [c for c in raw["commands"] if "decode_attention" not in c]
    for key in ("results", "part_wall_s"):
        raw[key].pop("decode")
    raw["plan"].pop("decode")
    raw["command"] = f"python {REL}/assemble.py"
    raw["device_lock"] = call1["device_lock"]  # beside the wall time: call 1's
    raw["targets"]["suite wall time (s)"].update(
        value=call1["wall_s"],
        met=call1["wall_s"] <= SUITE_BUDGET_S,
        note=f"call 1 alone, the default suite {call1['workers']} at a time: "
        f"{call1['wall_s']:.0f} s; calls 2 and 3 added attention and decode "
        f"({call2['wall_s']:.0f} s) and profile ({call3_s:.0f} s)",
    )
    raw["assembled_from"] = [f"{REL}/call{i}.json" for i in (1, 2, 3)]
    path = report.write(raw, ROOT / "experiments/results", "gpu_suite_nvidia-h100-80gb-hbm3")
    print(report.markdown(raw))
    print(f"wrote {path}.json and .md")


if __name__ == "__main__":
    main()
