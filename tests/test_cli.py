"""`python -m grpo_jax.main` as a user runs it: bad input ends in exactly one stderr line
"error: ..." naming the fix (no traceback, exit status 1, nothing on disk touched), and the
tiny config trains to completion.

The subprocesses share tests/test_trainer.py's persistent compilation cache and compile with
most XLA optimisations off, so the tiny run costs little more than its imports.
"""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import compilation_cache_dir

from grpo_jax.metric_writers import read_metrics

ROOT = Path(__file__).resolve().parents[1]
CONFIG = "--config=configs/shakespeare.py"
# Same config as test_trainer.py's resume run, so one of them compiles and the other loads.
TINY_RUN = [f"{CONFIG}:tiny", "--config.train.num_steps=4", "--config.train.eval_every=2"]


@pytest.fixture(scope="module")
def env(tmp_path_factory, shakespeare_path):
    env = dict(os.environ)
    env.update(
        GRPO_JAX_DATA=str(shakespeare_path),
        JAX_COMPILATION_CACHE_DIR=str(compilation_cache_dir(tmp_path_factory)),
        JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
        JAX_DISABLE_MOST_OPTIMIZATIONS="1",
    )
    return env


def start(args, env):
    return subprocess.Popen(
        [sys.executable, "-m", "grpo_jax.main", *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def finish(proc, timeout=300):
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err


# absl's log-line prefix, e.g. "I1122 03:20:59.229493 140217969466240 trainer.py:95] ...".
ABSL_LOG_LINE = re.compile(r"^[IW]\d{4} \d\d:\d\d:\d\d")


def assert_one_error_line(rc, err, *fix):
    assert rc == 1, err
    assert "Traceback" not in err
    # INFO/WARNING log lines written before the failure are tolerated; nothing else is.
    lines = [line for line in err.splitlines() if not ABSL_LOG_LINE.match(line)]
    assert len(lines) == 1, err
    assert lines[0].startswith("error: "), err
    for text in fix:
        assert text in lines[0], (text, lines[0])


def snapshot(directory: Path):
    """Every path under ``directory`` with its size and mtime."""
    return {
        str(p.relative_to(directory)): (p.stat().st_size, p.stat().st_mtime_ns)
        for p in sorted(directory.rglob("*"))
    }


# (args after --config, text the one line must contain: the offending value and the fix)
BAD_INPUT = {
    "unknown_mode": ([f"{CONFIG}:tiny", "--mode=bogus"], ["'bogus'", "choose from train"]),
    "unknown_variant": ([f"{CONFIG}:bogus"], ["'bogus'", "choose from exhaustive"]),
    "unknown_group_mode": (
        [f"{CONFIG}:tiny", "--config.group.mode=bogus"],
        ["group.mode='bogus'", "choose from sampled"],
    ),
    "group_size_1": (
        [f"{CONFIG}:sampled,tiny", "--config.group.size=1"],
        ["group.size=1", ">= 2"],
    ),
    "window_over_max_len": (
        [f"{CONFIG}:tiny", "--config.model.max_len=10"],
        ["model.max_len=10", "raise model.max_len"],
    ),
    "missing_data": (
        [f"{CONFIG}:tiny", "--config.data.path=/nonexistent"],
        ["/nonexistent", "--config.data.path"],
    ),
    "train_judge_without_judge": (
        [f"{CONFIG}:tiny", "--mode=train_judge"],
        ["--mode=train_judge", "task=fill_in"],
    ),
    "discount_out_of_range": (
        [f"{CONFIG}:tiny", "--config.reward.discount=1.5"],
        ["reward.discount=1.5", "0 <= γ <= 1"],
    ),
    "unknown_kl_estimator": (
        [f"{CONFIG}:tiny", "--config.grpo.kl_estimator=bogus"],
        ["grpo.kl_estimator='bogus'", "exact_forward"],
    ),
    "unknown_config_field": (
        [f"{CONFIG}:tiny", "--config.group.nothere=3"],
        ["'nothere'", "--config.*"],
    ),
}


@pytest.fixture(scope="module")
def bad_input_runs(tmp_path_factory, env):
    """All bad-input invocations at once (each is mostly interpreter start-up)."""
    root = tmp_path_factory.mktemp("cli_bad")
    a_file = root / "a_file"
    a_file.write_text("not a workdir\n")
    cases = {name: (args, fix) for name, (args, fix) in BAD_INPUT.items()}
    cases["workdir_is_a_file"] = (
        [f"{CONFIG}:tiny", f"--workdir={a_file}"],
        ["is a file", "pass a directory"],
    )
    # These processes run at the same time: sharing the persistent compilation cache would let
    # one read an entry another is still writing (a warning on stderr, not an error line).
    env = {k: v for k, v in env.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    procs = {}
    for name, (args, _) in cases.items():
        if not any(a.startswith("--workdir=") for a in args):
            args = [*args, f"--workdir={root / name}"]
        procs[name] = start(args, env)
    results = {name: finish(proc) for name, proc in procs.items()}
    return root, cases, results


@pytest.mark.parametrize("case", [*BAD_INPUT, "workdir_is_a_file"])
def test_bad_input_is_one_error_line(case, bad_input_runs):
    root, cases, results = bad_input_runs
    rc, _, err = results[case]
    assert_one_error_line(rc, err, *cases[case][1])
    if case == "workdir_is_a_file":
        assert (root / "a_file").read_text() == "not a workdir\n"
    else:
        assert not (root / case).exists()  # bad input creates no workdir


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory, env):
    workdir = tmp_path_factory.mktemp("cli_tiny") / "run"
    return workdir, finish(start([*TINY_RUN, f"--workdir={workdir}"], env))


def test_tiny_config_trains_to_completion(tiny_run):
    workdir, (rc, _, err) = tiny_run
    assert rc == 0, err
    assert "Traceback" not in err and "error:" not in err
    rows = read_metrics(workdir)
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3, 4]
    assert any("eval/val_loss" in r and r["step"] == 4 for r in rows)
    # the n-gram baseline on the same eval windows sits beside the policy's accuracy
    assert all(
        0.0 <= r["eval/ngram2_next_char_accuracy"] <= 1.0 for r in rows if "eval/val_loss" in r
    )
    assert sorted(int(p.name) for p in (workdir / "checkpoints").iterdir()) == [2, 4]


def test_checkpoint_of_another_model_shape_is_refused_untouched(tiny_run, env):
    workdir, (rc, _, _) = tiny_run
    assert rc == 0
    before = snapshot(workdir)
    metrics = (workdir / "metrics.jsonl").read_bytes()
    rc, _, err = finish(
        start([*TINY_RUN, "--config.model.d_model=64", f"--workdir={workdir}"], env)
    )
    # refused by the workdir's recorded config (run_config.py) before the checkpoint is read
    assert_one_error_line(rc, err, "model.d_model=", "(now 64)", "--workdir")
    assert snapshot(workdir) == before  # no file added, removed, resized or rewritten
    assert (workdir / "metrics.jsonl").read_bytes() == metrics


def test_a_resume_may_change_how_attention_runs_not_the_model(tmp_path):
    """model.attention says how the same softmax runs: a record without it (written before it
    existed) or with another value resumes, the change returned for config_history.jsonl; a
    changed width is still refused."""
    import json

    from grpo_jax.configs.shakespeare import get_config
    from grpo_jax.run_config import check_resume

    config = get_config("tiny")
    old = json.loads(config.to_json_best_effort())
    del old["model"]["attention"]
    (tmp_path / "config.json").write_text(json.dumps(old))
    assert check_resume(tmp_path, config) == {"model.attention": (None, "shared_prefix")}
    config.model.attention = "xla"
    assert check_resume(tmp_path, config) == {"model.attention": (None, "xla")}
    config.model.d_model = 64
    with pytest.raises(ValueError, match=r"model.d_model=\d+ \(now 64\)"):
        check_resume(tmp_path, config)


def test_unreadable_checkpoints_are_one_line_without_loop_tracebacks(tiny_run, env, tmp_path):
    """Every step's manifest emptied: --mode=eval ends in one line, and none of the
    "RuntimeError: Event loop is closed" tracebacks tensorstore's late callbacks used to print
    after it (main._quiet_closed_loop)."""
    workdir, (rc, _, _) = tiny_run
    assert rc == 0
    damaged = tmp_path / "run"
    shutil.copytree(workdir, damaged)
    for manifest in damaged.glob("checkpoints/*/state/manifest.ocdbt"):
        manifest.write_bytes(b"")
    rc, _, err = finish(start([*TINY_RUN, "--mode=eval", f"--workdir={damaged}"], env))
    assert_one_error_line(rc, err, "unreadable")
    assert "Event loop is closed" not in err
