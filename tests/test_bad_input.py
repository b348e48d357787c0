"""Bad input through the entry point (``grpo_jax.main.cli``, in-process): for each case a
non-zero exit, exactly one ``error:`` line, no traceback, and every file of an existing good
workdir byte-identical (sha256), nothing added or removed. Most cases fail before any data,
workdir or compilation is touched, which keeps the 64 cases to seconds.

The good workdir is one finished ``toy_bandit:tiny`` run (TensorBoard on, so that a run that
went ahead would add an event file). Also here: a no-op rerun adds no file, a resume that
changes num_steps is recorded in config_history.jsonl, eval/sample without a checkpoint
create nothing, and eval prints no orbax INFO lines.
"""

import contextlib
import hashlib
import io
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import pytest
from absl import logging as absl_logging

from grpo_jax import main as entry

pytestmark = pytest.mark.usefixtures("fast_compiles")

BASE = ["--config=toy_bandit:tiny", "--config.logging.tensorboard=True"]
SHAKESPEARE = ["--config=shakespeare:tiny"]
ABSL_LOG_LINE = re.compile(r"^[IWEF]\d{4} \d\d:\d\d:\d\d")


def run_cli(args):
    """``grpo-jax ARGS`` in this process: (exit status, stderr lines, absl log text).

    jax's backends are started first, so that the CLI's process-wide host settings
    (config.cpu_buffers, grpo_jax/host.py) are reported as not applied instead of changing
    this test worker's malloc and dispatch for the tests that follow."""
    jax.devices()
    for name in [n for n in entry.FLAGS if n.startswith("config.")]:
        delattr(entry.FLAGS, name)  # config_flags defines them anew on every parse
    entry.FLAGS.unparse_flags()
    err, logs = io.StringIO(), io.StringIO()
    handler = absl_logging.get_absl_handler().python_handler
    saved_argv, saved_stream, saved_env = sys.argv, handler.stream, dict(os.environ)
    saved_hook = sys.unraisablehook
    sys.argv, handler.stream = ["grpo-jax", *args], logs
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            try:
                entry.cli()
                code = 0
            except SystemExit as e:
                code = e.code or 0
    finally:
        sys.argv, handler.stream = saved_argv, saved_stream
        # cli() sets process-wide defaults (MPLBACKEND=Agg) fit for a process of its own; this
        # one goes on to run other tests (the notebooks' kernels inherit its environment).
        os.environ.clear()
        os.environ.update(saved_env)
        sys.unraisablehook = saved_hook
    return code, err.getvalue().splitlines(), logs.getvalue()


def digest(directory: Path) -> dict:
    """Every path under ``directory``: a file's sha256, a directory's marker."""
    return {
        str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
        if p.is_file()
        else "dir"
        for p in sorted(directory.rglob("*"))
    }


@pytest.fixture(scope="module")
def files(tmp_path_factory, shakespeare_path):
    os.environ["GRPO_JAX_DATA"] = str(shakespeare_path)
    root = tmp_path_factory.mktemp("bad_input")
    sources = {
        "raises.py": 'def get_config(arg=None):\n    raise RuntimeError("boom")\n',
        "syntax.py": "def get_config(arg=None):\n    return {1:\n",
        "no_get_config.py": "X = 1\n",
        "import_error.py": "import grpo_jax_no_such_module\n",
        "not_a_config.py": "def get_config(arg=None):\n    return 3\n",
    }
    for name, text in sources.items():
        (root / name).write_text(text)
    (root / "a_file").write_text("not a workdir\n")
    good = root / "good"
    code, lines, _ = run_cli([*BASE, f"--workdir={good}"])
    assert code == 0, lines
    assert (good / "tb").is_dir() and (good / "config.json").is_file()
    return root, good, digest(good)


# case -> (args, texts the one error line must contain); --workdir=<good> unless given
CASES = {
    # the config file and the flags
    "missing_config_file": (["--config=configs/nope.py"], ["configs/nope.py"]),
    "unknown_config_name": (["--config=nope"], ["'nope'", "toy_bandit"]),
    "config_raises": (["--config={root}/raises.py"], ["raises.py", "RuntimeError: boom"]),
    "config_syntax_error": (["--config={root}/syntax.py"], ["syntax.py", "SyntaxError"]),
    "config_without_get_config": (["--config={root}/no_get_config.py"], ["get_config"]),
    "config_import_error": (["--config={root}/import_error.py"], ["ModuleNotFoundError"]),
    "config_not_a_configdict": (["--config={root}/not_a_config.py"], ["not_a_config.py"]),
    "unknown_variant": (["--config=toy_bandit:bogus"], ["'bogus'", "choose from"]),
    "two_rewards": (["--config=toy_bandit:rm,rlvr,tiny"], ["pick one"]),
    "two_sizes": (["--config=shakespeare:full,tiny"], ["two sizes", "pick one"]),
    "unknown_field": ([*BASE, "--config.group.nothere=3"], ["'nothere'"]),
    "field_of_wrong_type": ([*BASE, "--config.train.num_steps=abc"], ["num_steps", "abc"]),
    "unknown_mode": ([*BASE, "--mode=bogus"], ["'bogus'", "choose from train"]),
    "positional_argument": ([*BASE, "extra"], ["unexpected arguments", "extra"]),
    "unknown_flag": ([*BASE, "--nosuchflag=1"], ["nosuchflag"]),
    # engine settings (specs.py)
    "beta_negative": ([*BASE, "--config.grpo.beta=-1"], ["grpo.beta=-1.0", "[0.0"]),
    "epsilon_negative": ([*BASE, "--config.grpo.epsilon=-0.2"], ["grpo.epsilon=-0.2"]),
    "lr_negative": ([*BASE, "--config.optim.learning_rate=-0.01"], ["optim.learning_rate"]),
    "top_k_negative": ([*BASE, "--config.group.top_k=-1"], ["group.top_k=-1", ">= 0"]),
    "top_k_over_vocab": ([*BASE, "--config.group.top_k=11"], ["group.top_k=11", "size 10"]),
    "checkpoint_every_0": ([*BASE, "--config.train.checkpoint_every=0"], ["checkpoint_every=0"]),
    "log_every_0": ([*BASE, "--config.train.log_every=0"], ["train.log_every=0", ">= 1"]),
    "eval_every_0": ([*BASE, "--config.train.eval_every=0"], ["train.eval_every=0", ">= 1"]),
    "group_size_1": ([*BASE, "--config.group.size=1"], ["group.size=1", ">= 2"]),
    "temperature_0": ([*BASE, "--config.group.temperature=0"], ["group.temperature=0"]),
    "top_p_over_1": ([*BASE, "--config.group.top_p=1.5"], ["group.top_p=1.5"]),
    "num_iterations_0": ([*BASE, "--config.grpo.num_iterations=0"], ["grpo.num_iterations=0"]),
    "batch_size_0": ([*BASE, "--config.train.batch_size=0"], ["train.batch_size=0"]),
    "num_steps_negative": ([*BASE, "--config.train.num_steps=-1"], ["train.num_steps=-1"]),
    "keep_checkpoints_0": ([*BASE, "--config.train.keep_checkpoints=0"], ["keep_checkpoints"]),
    "adam_b2_over_1": ([*BASE, "--config.optim.b2=1.5"], ["optim.b2=1.5"]),
    "adam_b1_1": ([*BASE, "--config.optim.b1=1.0"], ["optim.b1=1.0", "[0.0, 1.0)"]),
    "kl_estimator_unknown": ([*BASE, "--config.grpo.kl_estimator=bogus"], ["kl_estimator"]),
    "seed_negative": ([*BASE, "--config.seed=-1"], ["seed=-1", ">= 0"]),
    "pass_k_0": ([*BASE, "--config.eval.pass_k=(0, 4)"], ["eval.pass_k", ">= 1"]),
    "patience_0": ([*BASE, "--config.diagnostics.patience=0"], ["diagnostics.patience=0"]),
    "mesh_member_0": ([*BASE, "--config.mesh.member=0"], ["mesh.member=0"]),
    "cpu_buffers_unknown": ([*BASE, "--config.cpu_buffers=keep"], ["cpu_buffers='keep'", "retain"]),
    # the toy task's own settings
    "toy_vocab_0": ([*BASE, "--config.toy.vocab_size=0"], ["toy.vocab_size=0"]),
    "toy_sft_steps_0": ([*BASE, "--config.toy.sft.num_steps=0"], ["toy.sft.num_steps=0"]),
    "toy_rm_lr_0": ([*BASE, "--config.toy.rm.learning_rate=0"], ["toy.rm.learning_rate=0"]),
    # Shakespeare: the model, the window, the vocabulary from the corpus, the evaluation
    "d_model_0": ([*SHAKESPEARE, "--config.model.d_model=0"], ["model.d_model=0"]),
    "d_model_indivisible": ([*SHAKESPEARE, "--config.model.d_model=33"], ["num_heads"]),
    "num_layers_0": ([*SHAKESPEARE, "--config.model.num_layers=0"], ["model.num_layers=0"]),
    "attention_unknown": ([*SHAKESPEARE, "--config.model.attention=flash"], ["shared_prefix"]),
    "attention_cudnn_on_cpu": (
        [*SHAKESPEARE, "--config.model.attention=cudnn", "--config.model.dtype=bfloat16"],
        ["model.attention='cudnn' needs a CUDA GPU, not cpu", "'shared_prefix'"],
    ),
    "decode_kernel_unknown": ([*SHAKESPEARE, "--config.model.decode_kernel=cuda"], ["pallas"]),
    "decode_kernel_pallas_on_cpu": (
        [*SHAKESPEARE, "--config.model.decode_kernel=pallas"],
        ["model.decode_kernel='pallas' needs a CUDA GPU, not cpu", "'xla'"],
    ),
    "eval_batch_size_0": ([*SHAKESPEARE, "--config.eval.batch_size=0"], ["eval.batch_size=0"]),
    "shakespeare_top_k_over_vocab": (
        [*SHAKESPEARE, "--config.group.top_k=1000"],
        ["group.top_k=1000", "vocabulary size 65"],
    ),
    "window_over_max_len": ([*SHAKESPEARE, "--config.model.max_len=10"], ["model.max_len=10"]),
    "context_len_0": ([*SHAKESPEARE, "--config.data.context_len=0"], ["data.context_len=0"]),
    "missing_data": ([*SHAKESPEARE, "--config.data.path=/nonexistent"], ["/nonexistent"]),
    "discount_over_1": ([*SHAKESPEARE, "--config.reward.discount=1.5"], ["reward.discount"]),
    "ngram_order_0": ([*SHAKESPEARE, "--config.reference.ngram_order=0"], ["ngram_order=0"]),
    # the workdir
    "workdir_empty": ([*BASE, "--workdir="], ["--workdir=''"]),
    "workdir_is_a_file": ([*BASE, "--workdir={root}/a_file"], ["is a file"]),
    "resume_other_model": ([*BASE, "--config.toy.hidden=16"], ["toy.hidden=32 (now 16)"]),
    "resume_other_seed": ([*BASE, "--config.seed=1"], ["seed=0 (now 1)", "fresh --workdir"]),
    "resume_other_objective": ([*BASE, "--config.grpo.beta=0.5"], ["grpo.beta=0.05"]),
    "eval_without_checkpoint": ([*BASE, "--mode=eval", "--workdir={root}/none"], ["none"]),
    "sample_without_checkpoint": ([*BASE, "--mode=sample", "--workdir={root}/none"], ["none"]),
    "eval_in_empty_dir": ([*BASE, "--mode=eval", "--workdir={root}"], ["no checkpoint"]),
    "eval_on_a_file": ([*BASE, "--mode=eval", "--workdir={root}/a_file"], ["is a file"]),
}


def assert_refused(code, lines, *texts):
    assert code not in (0, None), lines
    assert not any("Traceback" in line for line in lines), lines
    errors = [line for line in lines if not ABSL_LOG_LINE.match(line)]
    assert len(errors) == 1 and errors[0].startswith("error: "), lines
    for text in texts:
        assert text in errors[0], (text, errors[0])


def test_there_are_at_least_forty_cases():
    assert len(CASES) >= 40


@pytest.mark.parametrize("case", CASES)
def test_bad_input_is_one_line_and_leaves_the_workdir_alone(case, files):
    root, good, before = files
    args, texts = CASES[case]
    args = [a.replace("{root}", str(root)) for a in args]
    if not any(a.startswith("--workdir") for a in args):
        args.append(f"--workdir={good}")
    code, lines, _ = run_cli(args)
    assert_refused(code, lines, *texts)
    assert digest(good) == before
    assert not (root / "none").exists()  # eval/sample create no directory
    assert (root / "a_file").read_text() == "not a workdir\n"


@pytest.fixture
def read_only_view(files, tmp_path):
    """The good workdir seen read-only: a read-only bind mount as root (root ignores modes),
    the directory's mode otherwise."""
    _, good, _ = files
    if os.geteuid() != 0:
        mode = good.stat().st_mode
        good.chmod(0o555)
        yield good
        good.chmod(mode)
        return
    view = tmp_path / "ro"
    view.mkdir()
    mount = ["mount", "--bind", "-o", "ro", str(good), str(view)]
    if shutil.which("mount") is None or subprocess.run(mount, capture_output=True).returncode:
        pytest.skip("cannot mount a read-only view here")
    try:
        yield view
    finally:
        subprocess.run(["umount", str(view)], check=True)


def test_read_only_workdir_is_one_line(files, read_only_view):
    _, good, before = files
    code, lines, _ = run_cli([*BASE, "--config.train.num_steps=8", f"--workdir={read_only_view}"])
    assert_refused(code, lines, "read-only", "writable")
    assert digest(good) == before


def test_damaged_checkpoint_is_one_line(files, tmp_path):
    """An emptied manifest.ocdbt: one line, no 'Event loop is closed' on the way out."""
    _, good, _ = files
    work = tmp_path / "damaged"
    shutil.copytree(good, work)
    (work / "checkpoints" / "6" / "state" / "manifest.ocdbt").write_bytes(b"")
    before = digest(work)
    code, lines, logs = run_cli([*BASE, "--config.train.num_steps=8", f"--workdir={work}"])
    assert_refused(code, lines, "checkpoint")
    assert "Event loop is closed" not in logs
    assert digest(work) == before


def test_finished_rerun_adds_nothing_and_eval_is_quiet(files):
    _, good, before = files
    code, lines, _ = run_cli([*BASE, f"--workdir={good}"])
    assert code == 0, lines
    assert digest(good) == before  # no TensorBoard event file, no row, no config rewrite
    code, lines, logs = run_cli([*BASE, "--mode=eval", f"--workdir={good}"])
    assert code == 0, lines
    assert "orbax" not in logs and "checkpoint_manager" not in logs, logs
    assert digest(good) == before


def test_changed_num_steps_is_recorded_not_overwritten(files, tmp_path):
    _, good, _ = files
    work = tmp_path / "longer"
    shutil.copytree(good, work)
    config_json = (work / "config.json").read_bytes()
    for _ in range(2):  # the second is a finished rerun: no second entry
        code, lines, _ = run_cli([*BASE, "--config.train.num_steps=8", f"--workdir={work}"])
        assert code == 0, lines
    assert (work / "config.json").read_bytes() == config_json
    history = (work / "config_history.jsonl").read_text().splitlines()
    assert history == ['{"changed": {"train.num_steps": [6, 8]}, "step": 6}']
    assert sorted(p.name for p in (work / "checkpoints").iterdir()) == ["8"]
