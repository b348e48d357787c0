"""The committed result records render to the committed markdown: a report's code cannot change
(or break) without its published tables being regenerated from their JSON."""

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "experiments/results"
sys.path.insert(0, str(ROOT / "experiments"))

import gpu_suite_markdown  # noqa: E402
import roofline  # noqa: E402
import scaling_report  # noqa: E402
import versus_trl_report  # noqa: E402
import xla_profile  # noqa: E402


def test_versus_trl_record_renders_to_its_markdown(tmp_path):
    record = RESULTS / "versus_trl_cpu.json"
    versus_trl_report.write_md(json.loads(record.read_text()), tmp_path / "out.md")
    assert (tmp_path / "out.md").read_text() == record.with_suffix(".md").read_text()


def test_cpu_roofline_record_renders_to_its_markdown():
    record = RESULTS / "roofline_cpu.json"
    assert (
        roofline.markdown(json.loads(record.read_text())) == record.with_suffix(".md").read_text()
    )


def test_scaling_record_renders_to_its_markdown():
    record = RESULTS / "scaling.json"
    md = scaling_report.markdown(json.loads(record.read_text()))
    assert md == record.with_suffix(".md").read_text()
    assert "(jax 0.10.2)" in md.splitlines()[2]  # the measuring process's, from the record
    other = {**json.loads(record.read_text()), "jax": "9.9.9"}  # not this process's version
    assert "(jax 9.9.9)" in scaling_report.markdown(other).splitlines()[2]


@pytest.mark.parametrize("name", ["gpu_suite_nvidia-h100-80gb-hbm3", "gpu_suite_nvidia-h200"])
def test_gpu_suite_records_render_to_their_markdown(name):
    record = RESULTS / f"{name}.json"
    md = gpu_suite_markdown.markdown(json.loads(record.read_text()))
    assert md == record.with_suffix(".md").read_text()


@pytest.mark.parametrize("name", ["profile_cpu", "profile_cpu_exhaustive"])
def test_cpu_profiles_render_to_their_markdown(name):
    """These records predate the measurement of unattributed time: no line claims any."""
    record = RESULTS / f"{name}.json"
    md = xla_profile.markdown(json.loads(record.read_text()))
    assert md == record.with_suffix(".md").read_text()
    assert "attributed to an instruction" not in md
    measured = {**json.loads(record.read_text())}
    measured["unattributed"] = {"ms_per_step": 0.0, "events_per_step": 0.0, "names": []}
    assert "- every traced event of the step was attributed" in xla_profile.markdown(measured)
