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


def test_a_resume_may_change_how_attention_runs_not_the_model(tmp_path, monkeypatch):
    """model.attention says how the same softmax runs: a record without it (written before it
    existed) or with another value resumes, the change returned for config_history.jsonl; a
    changed width is still refused."""
    import json

    from grpo_jax import run_config
    from grpo_jax.configs.shakespeare import get_config
    from grpo_jax.run_config import check_resume

    monkeypatch.setattr(run_config, "has_checkpoint", lambda workdir: True)  # a record in use

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


def _committed(workdir, step=2):
    """A committed checkpoint folder, as checkpoint.latest_step_of reads one."""
    from grpo_jax import checkpoint as ckpt_lib

    (workdir / "checkpoints" / str(step)).mkdir(parents=True)
    (workdir / "checkpoints" / str(step) / "_CHECKPOINT_METADATA").write_text("{}")
    assert ckpt_lib.latest_step_of(workdir / "checkpoints") == step


def test_the_record_names_its_mode_and_binds_only_once_a_checkpoint_exists(tmp_path):
    """A workdir's record: its run_mode refuses another --mode (a GRPO run resumed the
    pretraining's optimizer state and pruned its checkpoints), and a record with no checkpoint
    beside it (a run that failed before its first save) binds nothing: the rerun may change
    any setting, and its record replaces the old one, history and all."""
    from grpo_jax.configs.shakespeare import get_config
    from grpo_jax.run_config import HISTORY, check_resume, read_record, record, recorded

    config = get_config("tiny")
    record(tmp_path, config, {}, 0, "pretrain")
    assert read_record(tmp_path)["run_mode"] == "pretrain" and recorded(tmp_path) is None
    (tmp_path / HISTORY).write_text('{"step": 1, "changed": {"seed": [0, 5]}}\n')
    lr = config.optim.learning_rate
    config.optim.learning_rate = 1e-2
    assert check_resume(tmp_path, config, "train") == {}  # no checkpoint yet: nothing binds
    record(tmp_path, config, {}, 0, "train")
    assert read_record(tmp_path)["optim.learning_rate"] == 1e-2
    assert not (tmp_path / HISTORY).exists()
    _committed(tmp_path)
    assert recorded(tmp_path)["run_mode"] == "train"
    with pytest.raises(
        ValueError, match=r"holds a --mode=train run; continue it with --mode=train"
    ):
        check_resume(tmp_path, config, "pretrain")
    config.optim.learning_rate = lr
    with pytest.raises(ValueError, match=r"optim.learning_rate=0.01 \(now"):
        check_resume(tmp_path, config, "train")


def test_an_evaluation_reads_the_checkpoints_under_their_task_model_and_data(tmp_path):
    """--mode=eval on a workdir refuses other model / data settings (another split would
    evaluate on the training text) in one line, and allows another objective or optimizer."""
    from grpo_jax.configs.shakespeare import get_config
    from grpo_jax.run_config import check_evaluation, record

    config = get_config("tiny")
    record(tmp_path, config, {}, 0, "train")
    _committed(tmp_path)
    config.grpo.beta, config.optim.grad_clip, config.eval.batch_size = 0.5, 0.0, 3
    check_evaluation(tmp_path, config)  # the objective and the evaluation may differ
    config.data.train_fraction = 0.5
    with pytest.raises(ValueError, match=r"data.train_fraction=0.9 \(now 0.5\); evaluate"):
        check_evaluation(tmp_path, config)


def test_an_evaluation_checks_the_workdir_before_it_builds_the_task(tmp_path, monkeypatch):
    """Building a task may read the corpus or train a BPE tokenizer: a workdir that --mode=eval
    refuses (no checkpoint, a file, another model) is refused before any of that runs."""
    from grpo_jax import trainer
    from grpo_jax.configs.shakespeare import get_config
    from grpo_jax.run_config import record

    def built(*_):
        raise AssertionError("the task was built before the workdir was checked")

    monkeypatch.setattr(trainer, "build_task", built)
    config = get_config("tiny")
    with pytest.raises(ValueError, match="has no checkpoint to evaluate"):
        trainer.evaluate_only(config, str(tmp_path))
    (tmp_path / "a_file").write_text("")
    with pytest.raises(ValueError, match="is a file"):
        trainer.evaluate_only(config, str(tmp_path / "a_file"))
    record(tmp_path, config, {}, 0, "train")
    _committed(tmp_path)
    config.model.num_layers += 1
    with pytest.raises(ValueError, match="model.num_layers"):
        trainer.evaluate_only(config, str(tmp_path))


def test_a_warm_up_is_found_however_the_workdir_is_spelled_or_moved(tmp_path, monkeypatch):
    """The warm-up's init_from is recorded relative to the workdir (was: as typed, so that a
    workdir started as 'arr' recorded init_from='arr/pretrain', and its resume from any other
    directory was refused as a changed init_from); a resume of the workdir from anywhere, or of
    a copy of it, compares the directories. Another init_from is recorded resolved, and a record as
    earlier versions wrote it (as typed) still resumes from the directory it was typed in."""
    import json

    from grpo_jax.configs.arithmetic import get_config
    from grpo_jax.run_config import check_resume, record
    from grpo_jax.trainer import _with_init_from

    config = get_config("tiny")
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path)
    record(Path("run"), _with_init_from(config, Path("run") / "pretrain"), {}, 4)
    _committed(tmp_path / "run")
    assert json.loads(Path("run/config.json").read_text())["init_from"] == "pretrain"
    monkeypatch.chdir(tmp_path / "elsewhere")
    for run in (tmp_path / "run", Path("../run")):
        assert check_resume(run, _with_init_from(config, run / "pretrain")) == {}
    shutil.copytree(tmp_path / "run", tmp_path / "copy")
    copy = tmp_path / "copy"
    assert check_resume(copy, _with_init_from(config, copy / "pretrain")) == {}
    with pytest.raises(ValueError, match=f"init_from='{copy / 'pretrain'}' \\(now '{tmp_path}"):
        check_resume(copy, _with_init_from(config, "pre"))  # ./pre, here: another directory
    record(Path("out"), _with_init_from(config, "pre"), {}, 4)  # outside the workdir: resolved
    _committed(Path("out"))
    assert json.loads(Path("out/config.json").read_text())["init_from"] == str(
        Path("pre").resolve()
    )
    legacy = json.loads(Path("out/config.json").read_text()) | {"init_from": "pre"}
    Path("out/config.json").write_text(json.dumps(legacy))
    assert check_resume(Path("out"), _with_init_from(config, Path.cwd() / "pre")) == {}


def test_a_started_grpo_run_does_not_train_its_warm_up_on(tmp_path, monkeypatch):
    """Raising pretrain.num_steps once GRPO has checkpoints would move its initial params and
    KL reference under them: the warm-up is only reloaded."""
    from grpo_jax import trainer
    from grpo_jax.configs.arithmetic import get_config

    config = get_config("tiny")
    _committed(tmp_path / "pretrain", step=int(config.pretrain.num_steps))
    _committed(tmp_path, step=4)
    config.pretrain.num_steps += 4
    called = []
    monkeypatch.setattr(trainer, "train_and_evaluate", lambda *a: called.append(a))
    assert trainer.warm_up(config, tmp_path).init_from == str(tmp_path / "pretrain")
    assert called == []


def test_a_signal_in_the_warm_ups_last_step_stops_before_grpo(tmp_path, monkeypatch):
    """The warm-up runs inside GRPO's deferred-signal block: a signal in its last step ends
    it as a finished run, and the train run stops there instead of compiling GRPO first."""
    import signal

    from grpo_jax import interrupts, trainer
    from grpo_jax.configs.arithmetic import get_config

    monkeypatch.setattr(trainer, "train_and_evaluate", lambda *a: None)
    monkeypatch.setattr(interrupts, "requested", lambda: signal.SIGTERM)
    with pytest.raises(interrupts.Interrupted, match="SIGTERM at step"):
        trainer.warm_up(get_config("tiny"), tmp_path)


def test_a_failed_first_runs_tokenizer_binds_nothing(tmp_path, monkeypatch):
    """A BPE run that failed before its first save kept tokenizer.json: the rerun builds its
    task afresh (it may change data.vocab_size) and its own tokenizer replaces the old one;
    once checkpoints exist the kept tokenizer is the one they were trained with."""
    from grpo_jax import trainer
    from grpo_jax.run_config import keep_files

    built = []
    monkeypatch.setattr(trainer, "build_task", lambda config, mode, workdir: built.append(workdir))
    (tmp_path / "tokenizer.json").write_text("old")
    trainer._build_in(None, str(tmp_path), "train")
    keep_files(tmp_path, (("tokenizer.json", "new"),))
    assert (tmp_path / "tokenizer.json").read_text() == "new"
    _committed(tmp_path)
    trainer._build_in(None, str(tmp_path), "train")
    keep_files(tmp_path, (("tokenizer.json", "newer"),))
    assert built == [None, str(tmp_path)] and (tmp_path / "tokenizer.json").read_text() == "new"


def test_unreadable_checkpoints_are_one_line_without_loop_tracebacks(tiny_run, env, tmp_path):
    """Every step's manifest emptied: --mode=eval ends in one line, and none of the
    "RuntimeError: Event loop is closed" tracebacks tensorstore's late callbacks used to print
    after it (main._quiet_closed_loop), nor asyncio's "never retrieved" ones (the next test)."""
    workdir, (rc, _, _) = tiny_run
    assert rc == 0
    damaged = tmp_path / "run"
    shutil.copytree(workdir, damaged)
    for manifest in damaged.glob("checkpoints/*/state/manifest.ocdbt"):
        manifest.write_bytes(b"")
    rc, _, err = finish(start([*TINY_RUN, "--mode=eval", f"--workdir={damaged}"], env))
    assert_one_error_line(rc, err, "unreadable")
    assert "Event loop is closed" not in err


ABANDONED_READS = """
import asyncio, gc, logging, sys
import tensorstore as ts
from grpo_jax import main
logging.basicConfig()
main._quiet_failed_restores()

async def restore():  # as orbax leaves them: the first failure raised, its siblings abandoned
    opens = [ts.open({"driver": "zarr", "kvstore": f"file:///absent/{i}/"}) for i in range(3)]
    for read in [asyncio.ensure_future(o) for o in opens]:
        await read

async def unrelated():
    async def fail():
        raise ValueError("an unrelated failure")
    asyncio.ensure_future(fail())
    await asyncio.sleep(0.01)

loop = asyncio.new_event_loop()
try:
    loop.run_until_complete(restore())
except ValueError:
    pass
loop.run_until_complete(asyncio.sleep(0.2))  # the sibling reads finish, unretrieved
loop.run_until_complete(unrelated())
gc.collect()
"""


def test_abandoned_tensorstore_reads_do_not_log_but_other_failures_do():
    """The CLI's filter drops asyncio's "Task exception was never retrieved" tracebacks for a
    failed restore's sibling reads, which printed beside the one error line under load (CI,
    2026-11-27), and still logs any other unretrieved exception."""
    proc = subprocess.run(
        [sys.executable, "-c", ABANDONED_READS], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.count("Task exception was never retrieved") == 1, proc.stderr
    assert "an unrelated failure" in proc.stderr and "NOT_FOUND" not in proc.stderr
