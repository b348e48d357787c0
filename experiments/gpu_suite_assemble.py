"""One device record from a lease's calls: the first ran the default suite in one call, each
later one resumed the previous call's record (``--resume``) to add parts.

  python experiments/gpu_suite_assemble.py experiments/results/gpu_h100_<date>/call1.json \\
      experiments/results/gpu_h100_<date>/call2.json [--drop_parts=decode]

The last call's record holds every measurement, but its wall-time target is n/a: a resumed
call's time is not the suite's. The first call's is, so the assembled record takes that
target, and the device lock's summary beside it, from the first call; the note in the JSON
gives each later call's time. ``--drop_parts``: parts measured then whose setting was deleted
since (their figures stay in the call's own record). Writes
``<out_dir>/gpu_suite_<device>.json`` and ``.md`` (``--name`` overrides the basename).
"""

import json
import shlex
import sys
from pathlib import Path

import gpu_suite_report as report
from absl import app, flags

ROOT = Path(__file__).resolve().parents[1]
FLAGS = flags.FLAGS
flags.DEFINE_list("drop_parts", [], "parts of the calls' records to leave out")
flags.DEFINE_string("out_dir", str(ROOT / "experiments/results"), "where the record goes")
flags.DEFINE_string("name", "", "the record's basename ('': gpu_suite_<device>)")


def main(argv):
    paths = argv[1:]
    if len(paths) < 2:
        raise app.UsageError("give the calls' records, the default suite's first")
    calls = [json.loads(Path(p).read_text()) for p in paths]
    raw = report.fold(calls, paths, FLAGS.drop_parts)
    raw["command"] = shlex.join(["python", "experiments/gpu_suite_assemble.py", *sys.argv[1:]])
    path = report.write(raw, Path(FLAGS.out_dir), FLAGS.name)
    print(report.markdown(raw))
    print(f"wrote {path}.json and .md")


if __name__ == "__main__":
    app.run(main)
