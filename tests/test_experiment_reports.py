"""The committed result records render to the committed markdown: a report's code cannot change
(or break) without its published tables being regenerated from their JSON."""

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from ml_collections import config_dict

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "experiments/results"
sys.path.insert(0, str(ROOT / "experiments"))

import comparison_report  # noqa: E402
import equal_compute_report  # noqa: E402
import fill_in as fill_in_runner  # noqa: E402  (experiments/fill_in.py)
import fill_in_report  # noqa: E402
import gpu_suite_markdown  # noqa: E402
import roofline  # noqa: E402
import scaling_report  # noqa: E402
import toy_grpo  # noqa: E402
import versus_trl_report  # noqa: E402
import xla_profile  # noqa: E402


def test_versus_trl_record_renders_to_its_markdown(tmp_path):
    record = RESULTS / "versus_trl_cpu.json"
    versus_trl_report.write_md(json.loads(record.read_text()), tmp_path / "out.md")
    assert (tmp_path / "out.md").read_text() == record.with_suffix(".md").read_text()


@pytest.mark.parametrize(
    "name",
    [
        "roofline_cpu",
        "roofline_cpu_avx512",
        "roofline_cpu_avx512_jax012",
        "roofline_cpu_avx512_rows",
    ],
)
def test_cpu_roofline_record_renders_to_its_markdown(name):
    record = RESULTS / f"{name}.json"
    assert (
        roofline.markdown(json.loads(record.read_text())) == record.with_suffix(".md").read_text()
    )


def test_roofline_names_another_interpreter_and_each_sides_jax_only_where_they_differ():
    assert roofline.described(("/a", "--x=1", sys.executable)) == "/a --x=1"
    assert roofline.described(("/a", "", "/venv/bin/python")) == "/a with /venv/bin/python"
    same = {"jax": "0.10.2", "side_jax": {"before": ["0.10.2"], "after": ["0.10.2"]}}
    assert roofline.jax_versions(same) == "jax 0.10.2"
    assert roofline.jax_versions({"jax": "0.9.0"}) == "jax 0.9.0"  # records before side_jax
    other = {"jax": "0.12.0.1", "side_jax": {"before": ["0.10.2"], "after": ["0.12.0.1"]}}
    assert roofline.jax_versions(other) == "jax by side: before 0.10.2, after 0.12.0.1"


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


def test_the_pallas_part_names_the_decode_kernel_its_command_set():
    """The pallas part's section names the kernel: the framework's own, as in the H100
    record, or jax's flash-decoding kernel where the command says
    ``--config.model.decode_kernel=flash`` (gpu_suite.py --decode_kernel=flash)."""
    raw = json.loads((RESULTS / "gpu_suite_nvidia-h100-80gb-hbm3.json").read_text())
    own = "## Larger model, the decode steps' attention as one Pallas kernel per layer"
    assert own in gpu_suite_markdown.markdown(raw)
    for rec in raw["results"]["pallas"].values():
        rec["command"] = rec["command"].replace("decode_kernel=pallas", "decode_kernel=flash")
    md = gpu_suite_markdown.markdown(raw)
    assert own not in md
    assert "## Larger model, the decode steps' attention as jax's flash-decoding kernel" in md


@pytest.mark.parametrize("name", ["profile_cpu", "profile_cpu_exhaustive"])
def test_cpu_profiles_render_to_their_markdown(name):
    """Each committed CPU profile renders to its committed markdown, which says that every
    traced event went to an instruction (none left unattributed on a CPU); a record from
    before unattributed time was measured claims nothing either way."""
    rec = json.loads((RESULTS / f"{name}.json").read_text())
    md = xla_profile.markdown(rec)
    assert md == (RESULTS / f"{name}.md").read_text()
    assert rec["unattributed"]["ms_per_step"] == 0.0
    assert "- every traced event of the step was attributed to an instruction" in md
    older = {k: v for k, v in rec.items() if k != "unattributed"}
    assert "attributed to an instruction" not in xla_profile.markdown(older)


@pytest.mark.parametrize(
    "name",
    ["exhaustive_vs_sampled", "exhaustive_vs_sampled_beta0", "exhaustive_vs_sampled_equal_time"],
)
def test_step_comparison_records_render_to_their_markdown(name, tmp_path):
    """As exhaustive_vs_sampled.py --report_only renders a step-count record."""
    record = RESULTS / f"{name}.json"
    raw = json.loads(record.read_text())
    configs = {m: config_dict.ConfigDict(c) for m, c in raw["configs"].items()}
    pngs = comparison_report.write_plots(raw["runs"], tmp_path, raw["device"], name)
    md = comparison_report.write_markdown(raw, configs, pngs, raw.get("note", ""))
    assert md == record.with_suffix(".md").read_text()
    other = comparison_report.write_markdown({**raw, "jax": "9.9.9"}, configs, pngs, "")
    assert "(jax 9.9.9)" in other  # the measuring process's version, from the record


@pytest.mark.parametrize(
    "name",
    [
        "equal_compute_arithmetic_wall",
        "equal_compute_beta0_wall",
        "equal_compute_bpe1024_wall",
        "equal_compute_tokens",
        "equal_compute_wall",
        "equal_compute_wall_more",
    ],
)
def test_equal_compute_records_render_to_their_markdown(name, tmp_path):
    record = RESULTS / f"{name}.json"
    raw = json.loads(record.read_text())
    assert (
        equal_compute_report.render_budget(raw, tmp_path, name)
        == record.with_suffix(".md").read_text()
    )
    configs = {m: config_dict.ConfigDict(c) for m, c in raw["configs"].items()}
    other = equal_compute_report.budget_header({**raw, "jax": "9.9.9"}, configs)
    assert "(jax 9.9.9)" in other[2]  # the measuring process's version, from the record
    # the record's stored summary is the one the report computes from its per-seed finals
    assert raw["summary"] == equal_compute_report.budget_summary(
        raw["runs"], raw["metrics"], raw["reference_mode"]
    )


def test_toy_record_renders_to_its_table():
    summary = json.loads((RESULTS / "toy_summary.json").read_text())
    assert toy_grpo.markdown(summary) == (RESULTS / "toy_table.md").read_text()


def test_toy_ablation_bands_are_the_sample_std_over_seeds(monkeypatch):
    """Three seeds' true reward at iterations 10 and 20 by hand: ± is the sample std (ddof=1),
    0.02 and 0.01, as in every other report (not numpy's default ddof=0: 0.0163, 0.0082); a
    single seed gives 0."""
    true = np.array([[0.70, 0.71], [0.72, 0.72], [0.74, 0.73]])
    rewards = np.array([[1.0, 2.0, 3.0], [2.0, 2.0, 2.0], [3.0, 2.0, 1.0]])
    monkeypatch.setattr(toy_grpo, "ablation_runs", lambda *a: (rewards, [10, 20], true))
    args = SimpleNamespace(groups=[2], seeds=[0, 1, 2], steps=20, smooth=1, early=10)
    curves, true_curves, rows = toy_grpo.ablation(args, 10, None)
    assert rows["G=2"]["early"] == pytest.approx([0.72, 0.02])
    assert rows["G=2"]["final"] == pytest.approx([0.72, 0.01])
    assert true_curves["G=2"][2] == pytest.approx([0.02, 0.01])
    assert curves["G=2"][2] == pytest.approx([1.0, 0.0, 1.0])
    monkeypatch.setattr(toy_grpo, "ablation_runs", lambda *a: (rewards[:1], [10, 20], true[:1]))
    _, _, one = toy_grpo.ablation(SimpleNamespace(**{**vars(args), "seeds": [0]}), 10, None)
    assert one["G=2"]["final"] == [0.71, 0.0]


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--early=15", "--steps=20"], "--early=15 is not an evaluated iteration"),
        (["--early=30", "--steps=20"], "multiple of 10 up to 20, or 20"),
        (["--early=20", "--seeds=0,x"], "--seeds takes integers"),
    ],
)
def test_toy_flags_are_checked_before_any_training(flags, message):
    with pytest.raises(SystemExit, match=message):
        toy_grpo.parse_args(flags)


def test_fill_in_record_renders_to_its_markdown():
    """The committed record (today's train names) renders to its markdown; a summary from
    before the engine refactor keeps its old train names, reward_mean and
    sample_fill_accuracy (the old fill accuracy pooled chars), and says so."""
    summary = json.loads((RESULTS / "fill_in.json").read_text())
    ab = json.loads((RESULTS / "fill_in_ablation.json").read_text())
    md = "\n".join(fill_in_report.markdown(summary, ab))
    assert md == (RESULTS / "fill_in.md").read_text()
    assert "## GRPO: train reward per 300-step window" in md
    assert "| steps | reward s0 | reward s1 | reward s2 | reward (mean) |" in md
    assert "averaged over members.)" in md and "predates" not in md
    renamed = {"reward": "reward_mean", "rewards/fill_accuracy/mean": "sample_fill_accuracy"}
    for run in summary["grpo"].values():
        run["train_windows"] = [
            {renamed.get(k, k): v for k, v in w.items()} for w in run["train_windows"]
        ]
    old = "\n".join(fill_in_report.markdown(summary, ab))
    assert "## GRPO: train reward_mean per 300-step window" in old
    assert "| steps | reward_mean s0 |" in old and "predates the engine refactor" in old


def test_the_arithmetic_record_renders_to_its_markdown():
    """arithmetic.json (its curves keep the old eval/pass@k names) renders to arithmetic.md:
    render read only eval/pass_at_k and failed on it; the spread is the sample std (ddof 1,
    as the other reports; it was ddof 0: the sampled lift's 2.2 is 2.7)."""
    import arithmetic

    record = json.loads((RESULTS / "arithmetic.json").read_text())
    md = arithmetic.render(record)
    assert md == (RESULTS / "arithmetic.md").read_text()
    assert "| sampled | 45.2 ± 3.6 | 67.3 ± 1.3 | 22.1 ± 2.7 |" in md


def test_the_reward_curves_moving_mean_is_not_pulled_to_zero_at_the_ends():
    """The figure's 5-log moving mean divides each end's window by the points it holds (it
    divided by 5 over np.convolve's zero padding: a constant 1 ended at 0.6)."""
    np.testing.assert_allclose(fill_in_runner.moving_mean(np.ones(8), 5), np.ones(8))
    x = np.arange(7.0)
    want = [1.0, 1.5, 2.0, 3.0, 4.0, 4.5, 5.0]  # the window's mean, clipped at the ends
    np.testing.assert_allclose(fill_in_runner.moving_mean(x, 5), want)
    np.testing.assert_allclose(fill_in_runner.moving_mean(np.array([2.0, 4.0]), 5), [2.0, 4.0])
    np.testing.assert_allclose(fill_in_runner.moving_mean(np.array([2.0, 4.0, 0.0]), 5), [3, 2, 2])


def test_a_fill_in_record_without_a_span_length_renders_without_it():
    """The eval logs eval/fill_accuracy/lenK only for the lengths its fixed spans have, so a
    record of an eval set without 3-char spans renders without that column (metric_keys
    asked for every length of the setting: a KeyError)."""
    summary = json.loads((RESULTS / "fill_in.json").read_text())
    for run in [*summary["grpo"].values(), summary["baseline"]["grpo"]]:
        for row in run["eval"]:
            row.pop("eval/fill_accuracy/len3")
    md = "\n".join(fill_in_report.markdown(summary, None))
    assert "fill_accuracy/len2 |" in md and "len3" not in md


def test_the_fill_in_reading_follows_the_record():
    """The verdict's reading takes its figures from the record: the optimum's single-char gain,
    the seeds' final policies against the reference (not the baseline's, last in the list), and
    the top-2 margin statistics of the ablation's GRPO runs at T = 1 only (its T != 1 runs read
    the KL reference untempered; with them the slopes went down to 0.14)."""
    summary = json.loads((RESULTS / "fill_in.json").read_text())
    ab = json.loads((RESULTS / "fill_in_ablation.json").read_text())
    opt = {"reference": 0.36, "optimum": 0.38, "policies": [0.358, 0.359, 0.355, 0.30]}
    text = fill_in_report.reading(opt, 3, ab)
    assert "by +0.0200" in text and "none of that gain" in text
    assert "-0.0050 to -0.0010 against" in text
    assert "correlates\n0.45-0.62 with the optimum's at 0.19-0.26 of" in text
    opt["policies"][1] = 0.365
    assert "only part of that gain" in fill_in_report.reading(opt, 3, ab)
    assert "+0.0050 against" in fill_in_report.reading(opt, 3, ab)
    assert len(summary["single_char_optimum"]["policies"]) == len(summary["seeds"]) + 1


def test_the_h100_record_is_its_lease_calls_assembled():
    """The committed H100 record is gpu_suite_assemble.fold of its lease's two calls: call 2's
    measurements (pallas and profile added to call 1's), call 1's suite wall time (call 2's
    own time is not the suite's); a part dropped leaves every field, its targets too; a first
    call that resumed a record or ran chosen parts, or a partial record, is refused."""
    from gpu_suite_report import fold

    lease = RESULTS / "gpu_h100_2026-11-28"
    paths = [lease / "call1.json", lease / "call2.json"]
    calls = [json.loads(p.read_text()) for p in paths]
    raw = fold(calls, [str(p.relative_to(ROOT)) for p in paths])
    wall = raw["targets"]["suite wall time (s)"]
    assert (wall["value"], wall["met"], raw["wall_s"]) == (calls[0]["wall_s"], True, None)
    assert calls[1]["targets"]["suite wall time (s)"]["value"] is None
    assert {"pallas", "profile"} <= raw["results"].keys()
    assert raw["device_lock"] == calls[0]["device_lock"]
    committed = RESULTS / "gpu_suite_nvidia-h100-80gb-hbm3.json"
    raw["command"] = json.loads(committed.read_text())["command"]
    assert gpu_suite_markdown.markdown(raw) == committed.with_suffix(".md").read_text()
    dropped = fold(calls, paths, ["pallas"])
    assert "pallas" not in dropped["results"] | dropped["part_wall_s"] | dropped["plan"]
    assert not any(k.startswith("pallas") for k in dropped["plan"]["expect"])
    assert not any(r["part"] == "pallas" for r in dropped["child_records"])
    assert not any("decode_kernel=pallas" in c for c in dropped["commands"])
    no_large = fold(calls, paths, ["large"])["targets"]
    mfu = "large model, 16 prompts: rollout MFU (nominal peak)"
    assert raw["targets"][mfu]["value"] > 0 and mfu not in no_large
    assert no_large["suite wall time (s)"]["value"] == calls[0]["wall_s"]
    assert "pallas" in raw["results"]  # the input is not changed
    with pytest.raises(SystemExit, match="not the default suite"):
        fold(calls[::-1], paths[::-1])
    with pytest.raises(SystemExit, match="not the default suite"):
        fold(
            [{**calls[0], "command": "python experiments/gpu_suite.py --parts=step"}, calls[1]],
            paths,
        )
    with pytest.raises(SystemExit, match="partial"):
        fold([calls[0], {**calls[1], "complete": False}], paths)
