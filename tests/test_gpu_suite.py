"""experiments/gpu_suite.py --smoke end to end (issue 15): every part of the GPU suite at tiny
sizes on the CPU, in real subprocesses, so the suite cannot rot while no GPU runs it."""

import json
import math
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def positive(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def test_gpu_suite_smoke(tmp_path, shakespeare_path):
    env = {**os.environ, "GRPO_JAX_DATA": str(shakespeare_path), "JAX_PLATFORMS": "cpu"}
    cmd = [sys.executable, "experiments/gpu_suite.py", "--smoke", f"--out_dir={tmp_path}"]
    cmd.append("--parts=step,trl,exhaustive,large,attention,profile")  # last 2: on request
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    (js,) = tmp_path.glob("gpu_suite_*.json")
    (md,) = tmp_path.glob("gpu_suite_*.md")
    raw = json.loads(js.read_text())

    device = raw["device"]
    assert device["platform"] == "cpu" and device["device_kind"] and device["device_count"] >= 1
    assert device["jax"] and device["jaxlib"] and "default_matmul_precision" in device
    assert raw["dtypes"] == ["float32", "bfloat16"] and raw["smoke"] is True
    res = raw["results"]
    for dtype in raw["dtypes"]:  # each dtype's peak measured in a process of its own
        assert positive(device["measured_peak"][dtype]["flops_per_s"])
        assert device["measured_peak"][dtype] == res["probe"]["measured_peak"][dtype]
        assert "--child=peak" in res["peak"][dtype]["command"]
    assert set(res) == {"probe", "peak", "step", "trl", "exhaustive", "large", "attention",
                        "profile"}  # fmt: skip
    assert set(raw["part_wall_s"]) == set(res) and positive(raw["wall_s"])
    # two children at a time: every measuring child took the device lock, and no timed
    # section shared the device (peak x2, step, V x2, large, profile; TRL where installed)
    lock = raw["workers"] == 2 and raw["device_lock"]
    assert lock["processes"] >= 7 and lock["timed_overlap_s"] == 0, lock
    assert lock["timed"]["sections"] >= 9 and lock["shared"]["sections"] >= 9, lock
    assert "- Side by side: " in md.read_text().split("## Targets")[0]
    for c in raw["child_records"]:  # each child's own record says how long it waited
        if c["part"] not in ("probe", "trl"):
            assert set(c["result"]["device_lock_wait_s"]) == {"shared", "timed"}, c

    def check_bench(r, dtype):
        assert r["dtype"] == dtype, r
        for key in ("median_step_s", "steps_per_s", "tokens_per_s", "rollout_s", "update_s",
                    "wall_s", "peak_memory_bytes", "matmul_flops", "rollout_matmul_flops",
                    "update_matmul_flops"):  # fmt: skip
            assert positive(r[key]), (key, r.get(key))
        # the halves' counts are the step's, split (one program: rollout, then update)
        halves = r["rollout_matmul_flops"] + r["update_matmul_flops"]
        assert abs(halves - r["matmul_flops"]) <= 1e-6 * r["matmul_flops"], (halves, r)
        for half in ("step", "rollout", "update"):
            assert positive(r[half]["mfu_measured"]) and r[half]["mfu_nominal"] is None
        assert r["command"].startswith("python experiments/benchmark.py")

    assert list(res["step"]) == ["float32"]
    check_bench(res["step"]["float32"], "float32")
    check_flops_only(res["step"]["float32"], env)
    assert list(res["large"]) == ["2"]  # keyed by prompts per step
    check_bench(res["large"]["2"], "bfloat16")
    assert "--config.model.num_layers=2" in res["large"]["2"]["command"]
    check_bench(res["attention"]["2"], "bfloat16")  # the same model, cuDNN's path through XLA
    assert "--config.model.attention=xla" in res["attention"]["2"]["command"]

    assert set(res["trl"]) == {"float32", "bfloat16"}
    for r in res["trl"].values():  # skipped where torch/trl are absent (this env), else run
        assert r.get("skipped") or positive(r["median_step_s"]), r

    assert set(res["exhaustive"]) == {"65", "256"}
    for v, r in res["exhaustive"].items():
        assert r["vocab_size"] == int(v) and r["reference"] == "policy"
        assert r["kl_estimator"] == "k3"
        for key in ("median_step_s", "peak_memory_bytes", "matmul_flops", "wall_s"):
            assert positive(r[key]), (v, key, r.get(key))
        assert positive(r["utilisation"]["mfu_measured"]) and positive(r["speedup_vs_guide"])
    assert res["exhaustive"]["256"]["vocab_chunk"] == 32  # the chunked path
    assert res["exhaustive"]["65"]["model"].endswith("float32")  # the plan's compute dtypes
    assert res["exhaustive"]["256"]["model"].endswith("bfloat16")
    assert res["exhaustive"]["256"]["command"].endswith("--config.model.dtype=bfloat16")

    assert raw["targets"] and all(t["met"] == "n/a (smoke)" for t in raw["targets"].values())
    ((name, prof),) = res["profile"].items()
    assert name == "step" and prof["dtype"] == "float32"
    assert prof["command"].startswith("python experiments/profile_step.py")
    assert "--xla_gpu_enable_command_buffer=" in prof["xla_flags"].split()  # kernels named
    assert positive(prof["thunk_ms_per_step"]) and positive(prof["wall_ms_per_step"])
    assert positive(prof["by_kind"]["matmul"]) and positive(prof["matmul_gflop_per_step"]["matmul"])
    assert {"rollout: decode loop", "update: backward"} <= set(prof["by_stage"])
    decode_ops = [r for r in prof["by_op"] if r["stage"] == "rollout: decode loop"]
    assert decode_ops and all("blocks_*" in r["op"] or "blocks_" not in r["op"] for r in decode_ops)
    # probe, peak x2, step, trl x2, V x2, large, attention, profile
    assert len(raw["commands"]) == 1 + 2 + 1 + 2 + 2 + 1 + 1 + 1
    text = md.read_text()
    for heading in ("## Targets", "## GRPO step", "## TRL GRPOTrainer", "## Exhaustive GRPO",
                    "## Larger model", "## Larger model, `model.attention` as its command",
                    "## Where the GRPO step's time goes (step, float32",
                    "## Commands"):  # fmt: skip
        assert heading in text, heading
    assert "- costliest source ops (layers and loop segments summed):" in text
    assert device["jax"] in text and device["device_kind"] in text
    check_resume(js, env)


def check_flops_only(r: dict, env: dict):
    """benchmark.py --flops_only (tracing alone, no compile) counts what the measured run
    counted: how a CPU gives a GPU run's FLOPs."""
    cmd = [sys.executable, *shlex.split(r["command"])[1:], "--flops_only"]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    counts = json.loads(done.stdout.strip().splitlines()[-1])
    for key in ("matmul_flops", "rollout_matmul_flops", "update_matmul_flops", "params"):
        assert counts[key] == r[key], (key, counts, r)


def check_resume(js: Path, env: dict):
    """--resume keeps every measurement of a record from the same device kind (only the probe
    runs again) except --rerun's parts, whatever --parts runs, and refuses one from another
    kind with one error line."""
    cmd = [sys.executable, "experiments/gpu_suite.py", "--smoke", f"--out_dir={js.parent}"]
    done = subprocess.run([*cmd, f"--resume={js}", "--name=resumed"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    first, again = (json.loads(f.read_text()) for f in (js, js.parent / "resumed.json"))
    records = [r["result"] for r in again["child_records"] if r["part"] != "probe"]
    assert len(records) == len(first["child_records"]) - 1
    for r in records:  # a skip (TRL not installed here) is asked again, never kept
        assert r.get("resumed_from") == (None if "skipped" in r else str(js)), r
        assert "skipped" in r or r["measured_at"] == first["git"]
    assert sum("resumed_from" in r for r in records) >= 8  # peak x2, step, V x2, large, ...
    assert (
        again["results"]["step"]["float32"]["median_step_s"]
        == (first["results"]["step"]["float32"]["median_step_s"])
    )
    assert again["wall_s"] < first["wall_s"]
    # --rerun: the named part runs again (the loss it measured changed), the rest is kept,
    # --parts outside it included (their measurements stay in the record, nothing of theirs runs)
    rerun_cmd = [*cmd, f"--resume={js}", "--rerun=exhaustive", "--parts=exhaustive", "--name=rerun"]
    done = subprocess.run(rerun_cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    rerun = json.loads((js.parent / "rerun.json").read_text())["child_records"]
    kept = {r["part"] for r in rerun if "resumed_from" in r["result"]}
    assert {"peak", "step", "large", "attention", "profile"} <= kept
    assert "exhaustive" not in kept
    assert sum(r["part"] == "exhaustive" and "median_step_s" in r["result"] for r in rerun) == 2
    for bad, line in (
        (["--rerun=exhaustive"], "error: --rerun needs --resume=FILE"),
        ([f"--resume={js}", "--rerun=nope"], "error: --rerun: unknown ['nope']"),
    ):
        done = subprocess.run([*cmd, *bad], cwd=ROOT, env=env, capture_output=True, text=True)
        assert done.returncode == 1 and done.stderr.strip().startswith(line), done.stderr
    other = js.parent / "other.json"
    other.write_text(json.dumps({**first, "device": {**first["device"], "device_kind": "Other"}}))
    done = subprocess.run([*cmd, f"--resume={other}"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert done.returncode == 1
    assert done.stderr.strip().splitlines()[-1].startswith(f"error: --resume={other} was measured")


def test_a_spent_budget_records_every_part_as_not_run(tmp_path):
    """--budget_s: what does not fit is recorded, not started, and the outputs still written."""
    cmd = [sys.executable, "experiments/gpu_suite.py", "--smoke", f"--out_dir={tmp_path}",
           "--budget_s=1", "--name=spent"]  # fmt: skip
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "failed parts: probe" in done.stderr, done.stderr[-2000:]
    raw = json.loads((tmp_path / "spent.json").read_text())
    assert raw["complete"] is True and (tmp_path / "spent.md").exists()
    errors = [raw["results"]["probe"]["error"]] + [
        r["error"] for part in ("peak", "step", "trl", "exhaustive", "large")
        for r in raw["results"][part].values()
    ]  # fmt: skip
    assert "profile" not in raw["results"]  # the profiles run when --parts names them
    assert len(errors) == 1 + 2 + 1 + 2 + 2 + 1
    assert set(errors) == {"not run: --budget_s=1 spent"}, errors
    assert all(r["wall_s"] < 1 for r in raw["results"]["exhaustive"].values())


def test_a_failed_peak_leaves_the_device_and_the_other_dtype():
    """A peak child that times out costs its dtype's measured MFU, nothing else: the device,
    the other dtype's peak and the nominal MFU all stay in the record."""
    sys.path.insert(0, str(ROOT / "experiments"))
    from gpu_suite_report import assemble

    device = {"device_kind": "NVIDIA H200", "platform": "gpu", "default_matmul_precision": None}
    jobs = [
        {"part": "probe", "key": "device", "result": dict(device)},
        {"part": "peak", "key": "float32", "result": {"flops_per_s": 4e14}},
        {"part": "peak", "key": "bfloat16", "result": {"error": "timed out after 120 s"}},
        {"part": "exhaustive", "key": "65", "result": {
            "model": "4x4x128 bfloat16", "median_step_s": 0.5, "matmul_flops": 1e14,
            "peak_memory_bytes": 1e9}},
    ]  # fmt: skip
    results, _ = assemble(jobs)
    info = results["probe"]
    assert info["device_kind"] == "NVIDIA H200"
    assert info["measured_peak"] == {"float32": {"flops_per_s": 4e14}}
    assert results["peak"]["bfloat16"] == {"error": "timed out after 120 s"}
    u = results["exhaustive"]["65"]["utilisation"]  # 2e14 FLOP/s against H200's bf16 989e12
    assert u["mfu_measured"] is None and abs(u["mfu_nominal"] - 2e14 / 989e12) < 1e-12


def test_the_gpu_plan_profiles_the_step_and_the_large_model():
    """The GPU plan's profile part traces two workloads in bfloat16, keyed by name: the
    TRL-comparable step and the large model (its rollout's low MFU is what a profile explains)."""
    sys.path.insert(0, str(ROOT / "experiments"))
    from gpu_suite_parts import jobs_of
    from gpu_suite_plan import plan

    jobs = jobs_of(plan(smoke=False), ("profile",), sys.executable)
    profiles = {j["key"]: j["cmd"] for j in jobs if j["part"] == "profile"}
    assert set(profiles) == {"step", "large"}
    for cmd in profiles.values():
        assert cmd[1].endswith("profile_step.py") and "--config.model.dtype=bfloat16" in cmd
        assert "--out_dir=" in cmd  # the JSON on stdout only
    assert "--config.model.d_model=768" in profiles["large"]
    assert "--config.model.d_model=768" not in profiles["step"]


def test_a_profile_that_attributes_nothing_shows_no_rate():
    """One H100's profile (CUDA graphs on) attributed no kernel: the markdown said
    "4.15e+10 TFLOP/s busy" for 0 ms; now it says nothing was attributed. Where kernels are
    attributed it gives one rate, all matmul FLOPs over all matmul kernels (GFLOP per ms is
    TFLOP/s): the FLOPs split dense / batched by the jaxpr and the kernels by the compiled
    HLO, which need not agree (the H100 large profile's "dense 761 TFLOP/s busy")."""
    sys.path.insert(0, str(ROOT / "experiments"))
    from gpu_suite_markdown import profile_section

    prof = {"thunk_ms_per_step": 0.0, "wall_ms_per_step": 19.89, "by_stage": {}, "by_kind": {},
            "unattributed": {"ms_per_step": 15.55, "names": ["command_buffer_1"]},
            "matmul_gflop_per_step": {"matmul": 41.5, "batched matmul": 8.27}}  # fmt: skip
    text = "\n".join(profile_section(prof, "step"))
    assert "TFLOP/s" not in text and text.count("– (no matmul kernel attributed)") == 1
    assert "- by kind: – (nothing attributed)" in text and "15.55 ms not (command_buffer_1)" in text
    prof.update(thunk_ms_per_step=10.0, by_kind={"matmul": 2.0, "elementwise": 8.0})
    text = "\n".join(profile_section(prof, "step"))
    assert (
        "- matmuls: 49.8 GFLOP / step (matmul 41.5, batched matmul 8.27) in 2.0 ms at 24.9" in text
    )
    assert "- by kind: matmul 20 %, elementwise 80 %" in text
    by_kind = {"matmul": 1.0, "batched matmul": 3.0, "elementwise": 6.0}
    prof.update(by_kind=by_kind)
    text = "\n".join(profile_section(prof, "step"))
    assert "in 4.0 ms at 12.4 TFLOP/s busy" in text and "41.5 TFLOP/s" not in text


def test_work_the_counter_cannot_size_is_named_beside_the_mfu():
    """A Pallas decode kernel's products are not in the rollout's GFLOP (flop_count.py reports
    them as uncounted): the record keeps the entries and the markdown names them."""
    sys.path.insert(0, str(ROOT / "experiments"))
    from gpu_suite_markdown import large_section
    from gpu_suite_report import bench_figures

    entry = {"primitive": "pallas_call", "op": "rollout/blocks_0", "runs": 127, "why": "no dot"}
    roof = {"matmul_flops": 3e12, "rollout_matmul_flops": 1e12, "update_matmul_flops": 2e12,
            "rollout_matmul_uncounted": [entry]}  # fmt: skip
    halves = {"rollout_s": 0.3, "update_s": 0.2}
    record = {"median_step_s": 0.5, "roofline": roof, "breakdown": halves, "params": 1000,
              "tokens_per_step": 10, "tokens_per_s": 20.0, "compile_s": 1.0,
              "step_times_s": [0.5], "peak_memory_bytes": 1, "peak_memory_source": "x",
              "device": "cpu", "wall_s": 1.0, "command": "c"}  # fmt: skip
    info = {"device_kind": "cpu", "measured_peak": {}}
    figures = bench_figures(record, "bfloat16", info)
    assert (
        figures["rollout_matmul_uncounted"] == [entry] and "update_matmul_uncounted" not in figures
    )
    text = "\n".join(large_section(figures, "16"))
    assert (
        "Not in the rollout's GFLOP and MFU" in text
        and "`pallas_call` at `rollout/blocks_0`, 127 runs" in text
    )


def test_mfu_on_a_mesh_divides_by_every_devices_peak():
    """benchmark.py counts a partitioned step's global FLOPs, so its MFU on a mesh of n devices
    is against n peaks (one H100's gave 8 devices' run 8x its MFU), and the rollout floor,
    which models one device's reads, is left out there."""
    sys.path.insert(0, str(ROOT / "experiments"))
    from gpu_suite_report import bench_figures

    peak = 989e12  # one H100's bf16 FLOPs in a second
    roof = {"matmul_flops": peak * 0.1, "rollout_matmul_flops": peak * 0.04,
            "rollout_loop_matmul_flops": peak * 0.01,
            "update_matmul_flops": peak * 0.06}  # fmt: skip
    record = {"median_step_s": 0.5, "roofline": roof, "params": 1000,
              "breakdown": {"rollout_s": 0.2, "update_s": 0.3}, "tokens_per_step": 10,
              "tokens_per_s": 20.0, "compile_s": 1.0, "step_times_s": [0.5],
              "peak_memory_bytes": 1, "peak_memory_source": "x", "device": "gpu", "wall_s": 1.0,
              "command": "c", "overrides": {"model.num_layers": 1, "model.d_model": 8,
              "train.batch_size": 2, "group.size": 2, "data.context_len": 4,
              "data.horizon": 3, "model.dtype": "bfloat16"}}  # fmt: skip
    h100 = {"device_kind": "NVIDIA H100 80GB HBM3", "measured_peak": {}}
    one = bench_figures(record, "bfloat16", h100)
    assert one["step"]["mfu_nominal"] == pytest.approx(0.2)
    assert one["rollout"]["mfu_nominal"] == pytest.approx(0.2) and one["rollout_floor"]
    eight = bench_figures({**record, "per_device": {"num_devices": 8}}, "bfloat16", h100)
    assert eight["step"]["mfu_nominal"] == pytest.approx(0.025)
    assert eight["update"]["mfu_nominal"] == pytest.approx(0.025)
    assert eight["rollout_floor"] is None


def test_the_large_model_runs_at_each_batch_of_the_plan():
    """The GPU plan measures the 12 x 768 model at 16 prompts, and at each of --large_batches
    where given, each its own child keyed by prompts (the attention and pallas parts at the
    first); the report gives each its figures and its own rollout-MFU target."""
    sys.path.insert(0, str(ROOT / "experiments"))
    from gpu_suite_parts import jobs_of
    from gpu_suite_plan import plan
    from gpu_suite_report import assemble, targets

    def keys(p, part):
        return [j["key"] for j in jobs_of(p, (part,), sys.executable) if j["part"] == part]

    assert keys(plan(smoke=False), "large") == ["16"]
    assert keys(plan(smoke=False, large_batches=[32, 16]), "attention") == ["32"]
    # the pallas part at the first batch, with the kernel --decode_kernel names
    for kernel in ("pallas", "flash"):
        jobs = jobs_of(plan(False, [32, 16], kernel), ("pallas",), sys.executable)
        (job,) = [j for j in jobs if j["part"] == "pallas"]
        assert job["key"] == "32" and f"--config.model.decode_kernel={kernel}" in job["cmd"]
    jobs = [j for j in jobs_of(plan(smoke=False, large_batches=[16, 32]), ("large",),
                               sys.executable) if j["part"] == "large"]  # fmt: skip
    assert [j["key"] for j in jobs] == ["16", "32"]
    for j in jobs:
        assert f"--config.train.batch_size={j['key']}" in j["cmd"]
        assert "--config.model.d_model=768" in j["cmd"]
    device = {"device_kind": "NVIDIA H100 80GB HBM3", "platform": "gpu"}
    record = {"overrides": {"model.dtype": "bfloat16"}, "params": 1, "median_step_s": 1.0,
              "tokens_per_step": 1, "tokens_per_s": 1.0, "compile_s": 1.0, "step_times_s": [],
              "peak_memory_bytes": 1, "peak_memory_source": "s", "device": "d", "wall_s": 1.0,
              "command": "c", "breakdown": {"rollout_s": 0.5, "update_s": 0.5},
              "roofline": {"matmul_flops": 3e14, "rollout_matmul_flops": 99e12,
                           "update_matmul_flops": 2e14}}  # fmt: skip
    jobs[0]["result"] = record
    jobs[1]["result"] = {"error": "exit 1: RESOURCE_EXHAUSTED", "out_of_memory": True}
    results, _ = assemble([{"part": "probe", "key": "device", "result": device}, *jobs])
    assert results["large"]["16"]["rollout"]["mfu_nominal"] == pytest.approx(198 / 989)
    checks = targets(results, gpu=True, wall_s=100.0, smoke=False)
    assert checks["large model, 16 prompts: rollout MFU (nominal peak)"]["met"] is True
    assert checks["large model, 32 prompts: rollout MFU (nominal peak)"]["met"].startswith("n/a")


def test_a_resumed_record_claims_no_suite_wall_time_only_its_own_call():
    """A call with --resume holds earlier calls' measurements: its own (short) wall time is
    not the suite's, so the target is n/a and the markdown says whose time it gives."""
    sys.path.insert(0, str(ROOT / "experiments"))
    import gpu_suite_report as report
    from gpu_suite_markdown import wall_words

    probe = {"part": "probe", "key": "device", "result": {"device_kind": "H", "platform": "gpu"}}
    kept = {"part": "peak", "key": "float32", "result": {"error": "x", "resumed_from": "a.json"}}
    run = dict(command="c", git={}, child_env={}, workers=1, device_lock=None)
    p = {"dtypes": ["float32"]}
    fresh = report.record([probe], p, smoke=False, final=True, t0=time.perf_counter(), **run)
    assert fresh["targets"]["suite wall time (s)"]["met"] is True
    assert fresh["targets"]["suite wall time (s)"]["value"] == fresh["wall_s"]
    raw = report.record([probe, kept], p, smoke=False, final=True, t0=time.perf_counter(), **run)
    wall = raw["targets"]["suite wall time (s)"]
    assert wall["value"] is None and raw["wall_s"] is not None
    assert wall["met"] == "n/a (not one run: measurements kept from a.json)"
    assert wall_words(raw).startswith(f"This call's wall time {raw['wall_s']:.0f} s, not the")
    assert wall_words(fresh).startswith(f"Total wall time {fresh['wall_s']:.0f} s (budget")


# a child that runs out of memory the first time it runs and measures the second
FLAKY = """
import json, sys
from pathlib import Path
tries = Path(sys.argv[1])
tries.write_text(tries.read_text() + "x" if tries.exists() else "x")
if len(tries.read_text()) == 1:
    sys.exit("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 1 bytes")
print(json.dumps({"ok": len(tries.read_text())}))
"""
RUNNER = """
import json, os, sys, time
sys.path.insert(0, "experiments")
from gpu_suite_jobs import Limits, run_jobs
jobs = json.loads(sys.stdin.read())
limits = Limits(1.0, 0.0, sys.executable, time.perf_counter())
print(json.dumps(run_jobs(jobs, dict(os.environ), 2, limits)))
"""


def test_a_child_out_of_memory_beside_others_runs_again_alone(tmp_path):
    py = sys.executable
    jobs = [
        {"part": "exhaustive", "key": "65", "timeout": 60,
         "cmd": [py, "-c", FLAKY, str(tmp_path / "tries")]},
        {"part": "exhaustive", "key": "256", "timeout": 60,
         "cmd": [py, "-c", "import json; print(json.dumps({'other': 1}))"]},
    ]  # fmt: skip
    done = subprocess.run([py, "-c", RUNNER], cwd=ROOT, input=json.dumps(jobs), text=True,
                          capture_output=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    flaky, other = json.loads(done.stdout.strip().splitlines()[-1])
    assert flaky["result"]["ok"] == 2 and other["result"]["other"] == 1
    first = flaky["result"]["retried_alone_after"]
    assert first["error"].startswith("exit 1: RESOURCE_EXHAUSTED"), first
    assert "exhaustive 65: out of memory beside others, again alone" in done.stdout


def test_compile_only_gives_the_buffer_plan_and_loss_chunks_shrink_it(shakespeare_path):
    """benchmark.py --compile_only prints XLA's plan without running the step; a sampled
    group's training forward in chunks of 2 of its 8 members needs fewer temporaries (the
    chunk's activations, not the group's)."""
    env = {**os.environ, "GRPO_JAX_DATA": str(shakespeare_path), "JAX_PLATFORMS": "cpu"}
    temps = []
    for chunk in (0, 2):
        cmd = [sys.executable, "experiments/benchmark.py", "--config=configs/shakespeare.py:tiny,"
               "sampled", "--config.group.size=8", "--config.train.batch_size=2",
               f"--config.group.loss_chunk={chunk}", "--compile_only"]  # fmt: skip
        done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        plan = json.loads(done.stdout.strip().splitlines()[-1])
        assert plan["params"] > 0 and positive(plan["compile_s"]) and "median_step_s" not in plan
        memory = plan["executable_memory"]
        assert plan["executable_bytes"] == (
            memory["argument"] + memory["output"] + memory["temp"] - memory["alias"]
        )
        temps.append(memory["temp"])
    assert temps[1] < 0.8 * temps[0], temps  # 937 kB -> 611 kB on jax 0.10.2


def test_the_schedule_starts_the_longest_first_and_never_overfills_memory():
    """gpu_suite_plan.schedule: the peaks, then the longest expected first; a child whose bytes
    would not fit beside the running ones' waits (one H100 ran large 16 beside large 32 out of
    memory); alone, one too big for the capacity still runs."""
    import threading
    import time

    sys.path.insert(0, str(ROOT / "experiments"))
    from gpu_suite_plan import H100_EXPECT, MEMORY_SHARE, schedule

    jobs = [{"part": k.split()[0], "key": k.split()[1], "expect_s": s, "expect_bytes": b}
            for k, (s, b) in H100_EXPECT.items()]  # fmt: skip
    jobs.append({"part": "giant", "key": "1", "expect_s": 1, "expect_bytes": 1e12})
    capacity, lock = MEMORY_SHARE * 0.92 * 80e9, threading.Lock()
    started, running, at_start = [], [], []

    def run(job):
        with lock:
            started.append(f"{job['part']} {job['key']}")
            running.append(job)
            at_start.append({f"{j['part']} {j['key']}": j["expect_bytes"] for j in running})
        time.sleep(0.002 * job["expect_s"] ** 0.5)
        with lock:
            running.remove(job)

    schedule(jobs, 3, run, capacity)
    assert sorted(started) == sorted(f"{j['part']} {j['key']}" for j in jobs)
    assert started[:3] == ["peak float32", "peak bfloat16", "large 32"]  # then the longest
    assert max(map(len, at_start)) == 3
    over = [r for r in at_start if sum(r.values()) > capacity]
    assert over == [{"giant 1": 1e12}]  # alone when it started, and nothing started beside it
    assert not any({"large 16", "large 32"} <= set(r) for r in at_start)
    assert not any({"profile large", "large 32"} <= set(r) for r in at_start)
    assert not any({"attention 16", "large 32"} <= set(r) for r in at_start)


def test_expected_wall_replays_the_schedule_on_a_clock_by_hand():
    """gpu_suite_plan.expected_wall: the schedule's order and memory rule on a simulated
    clock. By hand, two workers, A 10 s, B 6, C 5, D 4: A [0, 10], B [0, 6], C [6, 11],
    D [10, 14]: 14 s. With room for 10 bytes (A 8, B 5, C 1, D 1), B does not fit beside A:
    A [0, 10], C [0, 5], D [5, 9], B [10, 16]: 16 s, and the threaded schedule starts them in
    that order. One worker: the sum, 25 s."""
    import threading
    import time

    sys.path.insert(0, str(ROOT / "experiments"))
    from gpu_suite_plan import expected_wall, schedule

    jobs = [{"part": "x", "key": k, "expect_s": t, "expect_bytes": b}
            for k, t, b in (("A", 10, 8), ("B", 6, 5), ("C", 5, 1), ("D", 4, 1))]  # fmt: skip
    assert expected_wall(jobs, 2) == 14
    assert expected_wall(jobs, 2, capacity=10) == 16
    assert expected_wall(jobs, 1, capacity=10) == 25
    started, lock = [], threading.Lock()

    def run(job):
        with lock:
            started.append(job["key"])
        time.sleep(0.02 * job["expect_s"])

    schedule(jobs, 2, run, capacity=10)
    assert started == ["A", "C", "D", "B"]


def test_plan_only_prints_the_order_and_the_estimate_without_a_device():
    """--plan_only runs nothing: each child with one H100's time, then expected_wall's
    estimate for them within one H100's memory; --large_batches adds children; a bad count is
    one error line."""
    sys.path.insert(0, str(ROOT / "experiments"))
    from gpu_suite_parts import jobs_of
    from gpu_suite_plan import H100_MEMORY_LIMIT, MEMORY_SHARE, expected_wall, plan

    cmd = [sys.executable, "experiments/gpu_suite.py", "--plan_only"]
    for extra, batches, n in (([], [], 11), (["--large_batches=16,32"], [16, 32], 12)):
        done = subprocess.run([*cmd, *extra], cwd=ROOT, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        jobs = jobs_of(plan(False, batches), ("step", "trl", "exhaustive", "large"), "python")
        wall = expected_wall(jobs[1:], 3, H100_MEMORY_LIMIT * MEMORY_SHARE)
        last = done.stdout.strip().splitlines()[-1]
        assert last.startswith(f"one H100's times for these {n} schedule to about {wall:.0f} s")
        assert done.stdout.count("\n  $ ") == n and ("large 32" in done.stdout) == (n == 12)
    done = subprocess.run([*cmd, "--large_batches=16,0"], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 1
    assert done.stderr.strip() == (
        "error: --large_batches: ['0'] are not positive counts of prompts; e.g. 16,32"
    )


def test_the_rollout_floor_counts_the_decode_loops_reads_by_hand():
    """gpu_suite_parts.decode_bytes: per decode step, every weight, the prompts' keys and
    values and the member cache at the step's segment length, in the compute dtype. The
    floor sums the rollout's phases, which run one after another: the matmuls outside the
    decode loop at the peak, plus the loop's larger of its traffic at the HBM bandwidth and its
    FLOPs at the peak (it took the larger of all FLOPs and the traffic: 0.25 below, not 0.2)."""
    sys.path.insert(0, str(ROOT / "experiments"))
    from gpu_suite_parts import decode_bytes, rollout_floor

    o = {"model.num_layers": 2, "model.d_model": 4, "train.batch_size": 3, "group.size": 5,
         "data.context_len": 7, "data.horizon": 4, "model.dtype": "bfloat16"}  # fmt: skip
    # 3 decode steps, one segment of 3 slots: (100 + 2*2*3*7*4 + 2*2*3*5*3*4) * 2 bytes each
    assert decode_bytes(o, 100) == 3 * (100 + 336 + 720) * 2
    assert decode_bytes({**o, "model.dtype": "float32"}, 100) == 3 * (100 + 336 + 720) * 4
    # 40 decode steps grow the cache in segments of 10, 20 and 40 slots (10, 10, 20 steps)
    per = lambda s: 100 + 336 + 2 * 2 * 3 * 5 * s * 4
    assert decode_bytes({**o, "data.horizon": 41}, 100) == 2 * (
        10 * per(10) + 10 * per(20) + 20 * per(40)
    )
    # the Pallas kernel reads the chunks (32 slots) holding the written slots: 32 for steps
    # 0..31, 64 for 32..39; the 7-slot prompt padded to one chunk
    pallas = {**o, "data.horizon": 41, "model.decode_kernel": "pallas"}
    per = lambda s: 100 + 2 * 2 * 3 * 32 * 4 + 2 * 2 * 3 * 5 * s * 4
    assert decode_bytes(pallas, 100) == 2 * (32 * per(32) + 8 * per(64))
    # jax's flash-decoding kernel: the same cache chunks, the prompt padded to 4 x 32 slots
    flash = {**pallas, "model.decode_kernel": "flash"}
    per = lambda s: 100 + 2 * 2 * 3 * 128 * 4 + 2 * 2 * 3 * 5 * s * 4
    assert decode_bytes(flash, 100) == 2 * (32 * per(32) + 8 * per(64))
    assert decode_bytes({"model.dtype": "bfloat16"}, 100) is None  # the step part: no sizes
    h100 = {"device_kind": "NVIDIA H100 80GB HBM3", "platform": "gpu"}
    # 10 ms of matmuls at the peak, 4 of them in the loop; the loop's traffic takes 40 ms
    fl = rollout_floor(989e12 * 0.010, 989e12 * 0.004, 0.2, 3.35e12 * 0.040, "bfloat16", h100)
    assert fl["compute_s"] == pytest.approx(0.010) and fl["memory_s"] == pytest.approx(0.040)
    assert fl["outside_loop_compute_s"] == pytest.approx(0.006)
    assert fl["floor_s"] == pytest.approx(0.046) and fl["times_floor"] == pytest.approx(0.2 / 0.046)
    assert fl["mfu_ceiling"] == pytest.approx(0.010 / 0.046)
    fast = rollout_floor(989e12 * 0.010, 989e12 * 0.004, 0.2, 3.35e12 * 0.001, "bfloat16", h100)
    assert fast["floor_s"] == pytest.approx(0.010) and fast["mfu_ceiling"] == pytest.approx(1.0)
    assert rollout_floor(1e12, 1e11, 0.2, 1e9, "bfloat16", {"device_kind": "cpu"}) is None
