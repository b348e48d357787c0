r"""Entry point (``grpo-jax``, or ``python -m grpo_jax.main``): parse flags, call the library.

  grpo-jax --config=shakespeare --workdir=runs/exh
  grpo-jax --config=shakespeare:sampled --config.train.num_steps=200 \
      --config.init_from=runs/pretrain --workdir=runs/sampled
  grpo-jax --config=shakespeare --mode=pretrain --workdir=runs/pretrain
  python -m grpo_jax.main --config=configs/shakespeare.py   # from a checkout, by path

``--config`` is a packaged config's name (grpo_jax/configs/) or a .py file's path, either with
``:variant`` tokens.

Modes: train (GRPO), pretrain (supervised next-char), eval (held-out metrics of the latest
checkpoint), sample (print greedy continuations), train_judge (tasks that have a judge),
print_config (every field of the config, overrides applied, with its value and comment).
Bad input ends with one line on stderr and exit status 1; nothing on disk is touched.

Several processes (``--config.distributed=True``; see grpo_jax/distributed.py): every process
runs this same command with its own ``--process_id`` (or ``JAX_PROCESS_ID``):

  grpo-jax --config=shakespeare:tiny --config.distributed=True \
      --coordinator_address=10.0.0.1:1234 --num_processes=2 --process_id=0 --workdir=/shared/run
"""

import json
import logging as std_logging
import os
import re
import sys
import traceback

import ml_collections
from absl import app, flags, logging
from ml_collections import config_flags

from grpo_jax import config_blocks
from grpo_jax import distributed as dist

MODES = ("train", "pretrain", "eval", "sample", "train_judge", "print_config")

FLAGS = flags.FLAGS
config_flags.DEFINE_config_file(
    "config",
    None,
    "A packaged config's name or a config file's path, then :variant,... tokens; "
    "--mode=print_config lists every field (--config.FIELD=VALUE overrides one).",
)
flags.DEFINE_string("workdir", "runs/default", "Where checkpoints, metrics and logs go.")
flags.DEFINE_string("mode", "train", f"One of {', '.join(MODES)}.")
# Multi-process launch (with --config.distributed=True); each falls back to its JAX_* variable.
flags.DEFINE_string(
    "coordinator_address", None, "HOST:PORT of process 0 (else $JAX_COORDINATOR_ADDRESS)."
)
flags.DEFINE_integer("num_processes", None, "Number of processes (else $JAX_NUM_PROCESSES).")
flags.DEFINE_integer("process_id", None, "This process's number, 0..N-1 (else $JAX_PROCESS_ID).")
flags.DEFINE_list(
    "local_device_ids",
    None,
    "Devices this process uses, e.g. 0,1,2,3 (SLURM's auto-detection gives one per task).",
)


def _fail(message: str):
    """The CLI's error contract: one line on stderr, exit status 1 (on several processes, an
    error in the training loop that was not every process's: without jax's shutdown barrier,
    ``dist.leave_on_error``)."""
    print(f"error: {message}", file=sys.stderr)
    dist.leave_on_error(message)
    sys.exit(1)


def _first_line(e: BaseException) -> str:
    """What the CLI prints of an error: jax's and tensorstore's messages run to many lines."""
    return (str(e).splitlines() or [""])[0]


def _parse_flags(argv):
    """absl's parser, but a bad flag (e.g. get_config() raising on an unknown variant) ends
    in one line instead of absl's multi-line "FATAL Flags parsing error" with a traceback."""
    try:
        return FLAGS(argv)
    except flags.Error as e:
        lines = [line.strip() for line in str(e).splitlines() if line.strip()]
        if "Traceback (most recent call last):" in lines:
            # config_flags wraps get_config()'s exception in its formatted traceback; the
            # last line is "ValueError: <message>".
            message = lines[-1].split(": ", 1)[-1]
        else:
            message = lines[0] if lines else type(e).__name__
        _fail(message)
    except (AttributeError, KeyError) as e:  # --config.a.b=... names no config field
        name = str(e).strip("\"'")
        _fail(f"no config field {name!r}: check the --config.* flag names against the config file")


def _join(config, launch: dist.Launch | None) -> None:
    """Joins the multi-process run before jax starts its backend (``config.distributed``)."""
    launch = launch or dist.Launch()
    distributed = bool(config.get("distributed", False))
    dist.check_config(launch, distributed)  # the flags: the environment may be a cluster's
    if not distributed:
        return
    dist.initialize(dist.resolve(*launch))  # each unset flag from its JAX_* variable
    if not dist.is_main_process():
        # Every process runs the same program on the same values, so the other processes'
        # info and warning lines (eval, diagnostics, corpus, orbax) are copies of process 0's;
        # their errors still show.
        logging.set_verbosity(logging.ERROR)


def run(config, workdir: str, mode: str, launch: dist.Launch | None = None):
    from grpo_jax import host, trainer  # imported late so that --help stays fast

    if mode not in MODES:
        raise ValueError(f"--mode={mode!r} is unknown; choose from {', '.join(MODES)}")
    cpu_settings = host.configure(config)  # before jax starts its backend, as joining must be
    _join(config, launch)
    if cpu_settings:
        logging.info("cpu_buffers=retain: %s", "; ".join(cpu_settings))
    if mode in ("train", "pretrain", "train_judge"):
        trainer.train_and_evaluate(config, workdir, mode)
        return
    scalars, texts = trainer.evaluate_only(config, workdir)
    if dist.is_main_process():  # one copy of the output, not one per process
        print(json.dumps(scalars, indent=1) if mode == "eval" else texts["samples"])


def main(argv):
    if len(argv) > 1:  # absl's UsageError would print the usage banner too
        _fail(f"unexpected arguments {argv[1:]}: give settings as flags, e.g. --mode=eval")
    try:
        launch = dist.resolve(  # the flags alone, checked; the environment once distributed
            FLAGS.coordinator_address,
            FLAGS.num_processes,
            FLAGS.process_id,
            FLAGS.local_device_ids,
            environ={},
        )
        if FLAGS.mode == "print_config":  # nothing to join, train or touch
            from grpo_jax import config_doc

            path = config_flags.get_config_filename(FLAGS["config"]).partition(":")[0]
            print(config_doc.describe(FLAGS.config, path))
            return
        run(FLAGS.config, FLAGS.workdir, FLAGS.mode, launch)
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        # Bad input: one line, non-zero exit, nothing destroyed (see checkpoint.py).
        logging.flush()
        _fail(_first_line(e) or type(e).__name__)
    except KeyboardInterrupt as e:  # interrupts.Interrupted: the step is saved; 128 + signum
        logging.flush()
        print(str(e) or "interrupted by SIGINT", file=sys.stderr)
        sys.exit(getattr(e, "exit_code", 130))
    except (Exception, SystemExit) as e:  # a bug, or a user's function raising or exiting
        if not dist.fails_fast():
            raise  # absl prints the traceback; a SystemExit exits with its own code
        traceback.print_exc()
        logging.flush()
        text = _first_line(e)
        dist.leave_on_error(f"{type(e).__name__}: {text}" if text else type(e).__name__)
        raise  # not reached: leave_on_error ends a process that fails fast


def _resolve_config_args(argv):
    """``--config=NAME[:variant]`` → the packaged file's path, which config_flags needs; a
    missing name or file, or one that does not load, is one line here instead of
    config_flags' ~50-line traceback."""
    out = list(argv)
    for i, arg in enumerate(out):
        if arg.startswith("--config="):
            out[i] = "--config=" + _checked_config(arg[len("--config=") :])
        elif arg == "--config" and i + 1 < len(out):
            out[i + 1] = _checked_config(out[i + 1])
    return out


def _checked_config(value: str) -> str:
    """Loads the config file once before config_flags does: a file that does not import
    (syntax error, missing module), lacks get_config, or whose get_config raises or returns
    no ConfigDict ends in one line naming the file; returns config_flags' ``path[:variant]``."""
    resolved = config_blocks.resolve_config_flag(value)  # FileNotFoundError: one line
    path, _, variant = resolved.partition(":")
    try:
        config = config_blocks.load_config(path, variant)
    except (ValueError, FileNotFoundError):
        raise  # the config file's own one-line message (an unknown variant, ...)
    except Exception as e:
        first = _first_line(e)
        raise ValueError(f"config file {path} does not load: {type(e).__name__}: {first}") from e
    if not isinstance(config, ml_collections.ConfigDict):
        raise ValueError(
            f"config file {path}: get_config() returned {type(config).__name__}, "
            "not an ml_collections.ConfigDict"
        )
    return resolved


HELP_FLAGS = ("-h", "--help", "-?")


def _quiet_closed_loop(default_hook):
    """An unraisable-exception hook that drops one known teardown artefact: when a restore
    fails on unreadable checkpoint files, tensorstore's callbacks still post to orbax's asyncio
    loop after it closed, and each prints a ``RuntimeError: Event loop is closed`` traceback
    after our one error line. Every other unraisable exception goes to ``default_hook``."""

    def hook(unraisable):
        value = unraisable.exc_value
        if isinstance(value, RuntimeError) and str(value) == "Event loop is closed":
            return
        default_hook(unraisable)

    return hook


# absl::Status code names, which tensorstore's errors (as ValueError) begin with.
_TENSORSTORE_STATUS = re.compile(r"^[A-Z][A-Z_]+: ")


class _QuietSiblingReadErrors(std_logging.Filter):
    """Drops asyncio's "Task exception was never retrieved" for tensorstore read errors.

    Orbax reads every array of a checkpoint concurrently, each read an asyncio task; on
    unreadable files the first failure propagates and becomes our one error line, while the
    abandoned sibling reads' identical failures are left unretrieved, and asyncio logs each
    with a traceback whenever the garbage collector reaches its task (before or after that
    line, depending on load). Any other unretrieved exception is still logged."""

    def filter(self, record: std_logging.LogRecord) -> bool:
        if not str(record.msg).startswith("Task exception was never retrieved"):
            return True
        value = record.exc_info[1] if record.exc_info else None
        return not (isinstance(value, ValueError) and _TENSORSTORE_STATUS.match(str(value)))


def _quiet_failed_restores():
    """Keeps a failed restore to its one error line: neither teardown artefact above prints."""
    sys.unraisablehook = _quiet_closed_loop(sys.unraisablehook)
    std_logging.getLogger("asyncio").addFilter(_QuietSiblingReadErrors())


def _help(argv):
    """``--help``: this module's usage and flags (absl's own help would list only the flags of
    the console-script shim), then the chosen config's fields with their values and comments
    (``--mode=print_config``), or the packaged configs' names when no --config is given."""
    print(__doc__)
    print(FLAGS.module_help(sys.modules[__name__]))
    if not any(a == "--config" or a.startswith("--config=") for a in argv):
        print(f"\nPackaged configs (--config=NAME): {', '.join(config_blocks.config_names())}")
        print("--config=NAME --help lists that config's fields.")
        sys.exit(0)
    print("\nThe config's fields (--config.FIELD=VALUE overrides one):\n")
    sys.stdout.flush()
    return [a for a in argv if a not in HELP_FLAGS and not a.startswith("--mode")] + [
        "--mode=print_config"
    ]


def cli():
    """The console script ``grpo-jax``."""
    flags.mark_flags_as_required(["config"])
    # A console run saves figures to files; no GUI backend (plots.py leaves the choice to its
    # caller so that notebooks draw inline).
    os.environ.setdefault("MPLBACKEND", "Agg")
    # jax narrates its backend probe ("Unable to initialize backend 'tpu'") at INFO, which
    # absl prints to stderr; keep stderr to our own lines (and one line on an error).
    std_logging.getLogger("jax._src.xla_bridge").setLevel(std_logging.WARNING)
    _quiet_failed_restores()
    argv = _help(sys.argv) if any(a in HELP_FLAGS for a in sys.argv[1:]) else sys.argv
    try:
        argv = _resolve_config_args(argv)
    except (ValueError, FileNotFoundError) as e:
        _fail(_first_line(e))
    try:
        app.run(main, argv=argv, flags_parser=_parse_flags)
    except Exception as e:  # a config file's get_config() raising (unknown variant, ...)
        if isinstance(e, ValueError | FileNotFoundError):
            print(f"error: {_first_line(e)}", file=sys.stderr)
            sys.exit(1)
        raise


if __name__ == "__main__":
    cli()
