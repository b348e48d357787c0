"""What a workdir records about its run's config, and what a rerun on it may change.

A workdir's ``config.json`` (and ``config.txt``) is written once, when its first run goes
ahead, so that it always describes the checkpoints beside it. A later run on the same workdir
(a resume, or a rerun of a finished run) is compared with that record *before anything is
written*:

- fields that change the model, the data or the objective (everything not in ``MUTABLE``)
  must be equal, else the run is refused in one line naming them: a resume under another
  seed, model or loss would continue a different experiment from these checkpoints;
- fields that only say how long, how often or where a run executes and reports (``MUTABLE``:
  cadences, num_steps, logging, evaluation, diagnostics, mesh) may change; the change is
  appended to ``config_history.jsonl`` (step, field: [old, new]) when the run proceeds, and
  later comparisons start from the record with those changes applied. A num_steps also
  spans the learning-rate schedule (train_state.make_optimizer), so a run extended from N
  to M steps follows the M-step warm-up and decay from step N on: its first N steps were
  not an M-step run's (a run interrupted and resumed with the same num_steps retraces it).

Both sides go through the same JSON serialisation, so tuples, None and floats compare as
they are stored. ``init_from`` is recorded relative to the workdir when inside it (the
warm-up's ``pretrain``), else resolved, and compared as the directory it names: a resume
from another current directory, or of a moved or copied workdir, is the same run.
``keep_files`` writes what a task keeps beside its checkpoints (a trained tokenizer.json) once
a run goes ahead, like config.json.
"""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path
from typing import Any

import jax
from ml_collections import ConfigDict

from grpo_jax import checkpoint as ckpt_lib

HISTORY = "config_history.jsonl"
# Fields (exact names, or prefixes ending in ".") a resumed run may change.
MUTABLE = (
    "train.num_steps",
    "train.log_every",
    "train.eval_every",
    "train.checkpoint_every",
    "train.keep_checkpoints",
    "train.eval_at_start",
    "pretrain.num_steps",
    "judge.num_steps",
    "eval.",
    "logging.",
    "diagnostics.",
    "mesh.",
    "distributed",
    "cpu_buffers",
    "data.path",  # the file may move; its content is the checkpoint's data digest's business
    "model.attention",  # how attention runs (same softmax); absent from older records
    "model.decode_kernel",  # how the decode steps' attention runs (same softmax)
    "model.decode_attention",  # removed (2026-11-27); records that hold it still resume
)


def check_workdir(workdir: str | os.PathLike) -> Path:
    """The workdir as a Path, checked before anything is written: not empty, not a file, not
    under a file, and writable (it, or the nearest existing parent that would hold it).
    Creates nothing."""
    if not str(workdir).strip():
        raise ValueError("--workdir='' is empty; pass a directory, e.g. --workdir=runs/NAME")
    path = Path(workdir).expanduser()
    if path.exists() and not path.is_dir():
        raise ValueError(f"--workdir {path} is a file; pass a directory")
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():  # else mkdir fails after the compile, or "read-only" misleads
        raise ValueError(
            f"--workdir {path} is under {existing}, which is a file, not a directory; pass "
            "another --workdir (or move the file)"
        )
    # os.access sees a read-only filesystem (EROFS) even for root, and a directory's mode
    # for everyone else; a probe file would itself touch the workdir.
    if not os.access(existing, os.W_OK | os.X_OK):
        what = "" if existing == path else f" (its parent {existing} is not writable)"
        raise ValueError(f"--workdir {path} is read-only{what}; pass a writable directory")
    return path


def _tree(config: Any) -> dict[str, Any]:
    """A ConfigDict (or dict) as nested dicts after a JSON round trip: what config.json holds."""
    if hasattr(config, "to_json_best_effort"):
        return json.loads(config.to_json_best_effort())
    return json.loads(json.dumps(config, default=repr))


def flat(config: Any) -> dict[str, Any]:
    """``{"a.b": value}`` of a ConfigDict (or dict) after a JSON round trip."""
    tree = _tree(config)
    out: dict[str, Any] = {}

    def walk(node, prefix):
        for key, value in node.items():
            if isinstance(value, dict) and value:
                walk(value, f"{prefix}{key}.")
            else:
                out[f"{prefix}{key}"] = value

    walk(tree, "")
    return out


def recorded(workdir: Path) -> dict[str, Any] | None:
    """The config that binds the workdir's checkpoints: the last one its runs used. None for
    a workdir without a record or without a checkpoint: a run that failed before its first
    save describes nothing, and its rerun may change anything."""
    return read_record(workdir) if has_checkpoint(workdir) else None


def read_record(workdir: Path) -> dict[str, Any] | None:
    """config.json with the history applied, flat (None when the workdir has no record)."""
    path = workdir / "config.json"
    if not path.is_file():
        return None
    try:
        record = flat(json.loads(path.read_text()))
        history = workdir / HISTORY
        lines = history.read_text().splitlines() if history.is_file() else []
        for line in filter(None, lines):
            record.update({k: new for k, (_, new) in json.loads(line)["changed"].items()})
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ValueError(
            f"{path} (or {HISTORY}) is unreadable ({type(err).__name__}); it records the "
            "run these checkpoints belong to: restore it or use a fresh --workdir"
        ) from err
    return record


def _matches(field: str, names) -> bool:
    """``field`` is one of ``names``, or under one of them that ends in a dot."""
    return any(field == m or (m.endswith(".") and field.startswith(m)) for m in names)


def is_mutable(field: str) -> bool:
    return _matches(field, MUTABLE)


def _show(changes: dict[str, tuple], limit: int = 3) -> str:
    shown = [f"{k}={old!r} (now {new!r})" for k, (old, new) in list(changes.items())[:limit]]
    more = f", +{len(changes) - limit} more" if len(changes) > limit else ""
    return ", ".join(shown) + more


MODE = "run_mode"  # the record's own field: which --mode trained these checkpoints


def has_checkpoint(workdir: Path) -> bool:
    return ckpt_lib.latest_step_of(workdir / "checkpoints") is not None


def _changes(old: dict[str, Any], new: dict[str, Any]) -> dict[str, tuple]:
    missing = object()
    return {
        k: (old.get(k), new.get(k))
        for k in sorted(set(old) | set(new))
        if old.get(k, missing) != new.get(k, missing)
    }


def _refuse_fixed(workdir: Path, changes: dict[str, tuple], what: str, fix: str) -> None:
    fixed = {k: v for k, v in changes.items() if not is_mutable(k)}
    if fixed:
        first = next(iter(fixed))
        raise ValueError(
            f"--workdir {workdir} holds a run with other {what} settings: {_show(fixed)}; "
            f"{fix} with the recorded values (e.g. --config.{first}={fixed[first][0]!r}, see "
            f"{workdir / 'config.json'})"
        )


INIT_FROM = "init_from"


def _resolved(path: str | os.PathLike) -> Path:
    return Path(path).expanduser().resolve()


def _spelled(workdir: Path, init_from: str) -> str:
    """``init_from`` as the record spells it: relative to the workdir when inside it (the
    warm-up's ``pretrain``), so that the record stays true when the workdir is resumed from
    another directory, moved or copied; any other resolved and absolute."""
    path = _resolved(init_from)
    try:
        return path.relative_to(_resolved(workdir)).as_posix()
    except ValueError:  # not inside the workdir
        return str(path)


def _located(workdir: Path, old: dict[str, Any], new: dict[str, Any]) -> tuple[dict, dict]:
    """(record, this run) with ``init_from`` as the directory it names, resolved: the
    record's relative to the workdir (``_spelled``), this run's to the current
    directory. A record written before spelled it as typed, relative to the directory its run
    started in: it still matches where it names this run's directory from here."""
    old, new = dict(old), dict(new)
    here = _resolved(new[INIT_FROM]) if new.get(INIT_FROM) else None
    if here is not None:
        new[INIT_FROM] = str(here)
    spelled = old.get(INIT_FROM)
    if spelled:
        legacy = _resolved(spelled) == here
        old[INIT_FROM] = str(here if legacy else _resolved(Path(workdir) / spelled))
    return old, new


def check_resume(workdir: Path, config: Any, mode: str = "train") -> dict[str, tuple]:
    """The mutable fields this run changes against the workdir's binding record ({} for
    the same config, or where nothing binds: see ``recorded``); raises ValueError naming the
    fixed fields it would change, or the other --mode that trained it."""
    old = recorded(workdir)
    if old is None:
        return {}
    if old.setdefault(MODE, mode) != mode:  # records before run_mode: not known, not refused
        raise ValueError(
            f"--workdir {workdir} holds a --mode={old[MODE]} run; continue it with "
            f"--mode={old[MODE]}, or start --mode={mode} in a fresh --workdir (from its "
            f"params: --config.init_from={workdir})"
        )
    changes = _changes(*_located(workdir, old, {**flat(config), MODE: mode}))
    _refuse_fixed(workdir, changes, "model/data/objective", "use a fresh --workdir or resume")
    return changes


EVALUATED = ("task", "model.", "data.")  # what an evaluation of the checkpoints reads


def check_evaluation(workdir: Path, config: Any) -> None:
    """--mode=eval / sample: the task, model and data settings must be the ones the
    checkpoints were trained with: another split's held-out text would overlap the training
    text, another tokenizer would read other ids (the objective's settings may differ)."""
    old = recorded(workdir)
    if old is None:
        return
    changes = {k: v for k, v in _changes(old, flat(config)).items() if _matches(k, EVALUATED)}
    _refuse_fixed(workdir, changes, "task/model/data", "evaluate")


def record(workdir: Path, config: Any, changes: dict[str, tuple], step: int, mode="train"):
    """Called once the run goes ahead: writes config.json/config.txt (with ``run_mode``) where
    no record binds (``recorded``: a new history starts), else appends this run's changes
    (if any) to config_history.jsonl (process 0)."""
    if jax.process_index() != 0:
        return  # one writer on a shared filesystem
    if recorded(workdir) is None:
        tree = _tree(config)
        if tree.get(INIT_FROM):
            tree[INIT_FROM] = _spelled(workdir, tree[INIT_FROM])
        save_config(workdir, ConfigDict({**tree, MODE: mode}))
        (workdir / HISTORY).unlink(missing_ok=True)
        return
    if changes:
        entry = {"step": int(step), "changed": {k: list(v) for k, v in changes.items()}}
        with open(workdir / HISTORY, "a") as f:
            f.write(json.dumps(entry, sort_keys=True) + "\n")


def ensure_workdir(workdir: str | os.PathLike) -> Path:
    """Creates ``workdir`` if missing; a plain file there is a usage error."""
    path = Path(workdir).expanduser()
    if path.exists() and not path.is_dir():
        raise ValueError(f"--workdir {path} is a file; pass a directory")
    path.mkdir(parents=True, exist_ok=True)
    return path


def _write_atomic(path: Path, text: str) -> None:
    """Write-then-rename, so a crash never leaves half a file behind. Bytes, not text mode: no
    newline translation, so a kept file's sha256 is its text's (a tokenizer's digest)."""
    tmp = path.parent / f".{path.name}.{uuid.uuid4().hex}.tmp"
    # created with 0o666 less the umask, as open() creates the workdir's other files
    # (tempfile.mkstemp's 0o600 left config.json unreadable to the group)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(text.encode("utf-8"))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def save_config(workdir: str | os.PathLike, config: Any) -> None:
    """Writes the resolved config to ``workdir/config.json`` and ``config.txt`` (process 0)."""
    if jax.process_index() != 0:
        return  # One writer on a shared filesystem.
    path = ensure_workdir(workdir)
    if hasattr(config, "to_json_best_effort"):
        text = config.to_json_best_effort(indent=2, sort_keys=True)
    else:
        text = json.dumps(config, indent=2, sort_keys=True, default=repr)
    _write_atomic(path / "config.json", text + "\n")
    _write_atomic(path / "config.txt", str(config))


def keep_files(workdir: Path, files) -> None:
    """Writes a task's files (``Task.files``: (name, text) pairs, e.g. a trained tokenizer)
    that the workdir lacks; once it has checkpoints an existing one is what they were trained
    with and stays, before that (a failed first run's files bind nothing) it is replaced.
    Atomic (a temp file renamed), so a crash never leaves half a tokenizer (process 0)."""
    if jax.process_index() != 0:
        return
    workdir.mkdir(parents=True, exist_ok=True)
    replace = not has_checkpoint(workdir)
    for name, text in files:
        path = workdir / name
        if not path.exists() or replace:
            _write_atomic(path, text)
