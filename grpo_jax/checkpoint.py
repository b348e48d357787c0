"""Checkpointing of the training state, built on orbax's ``CheckpointManager``.

Each step folder holds two orbax items: ``state`` (the TrainState pytree, saved
with ``StandardCheckpointHandler``) and an optional ``extra`` (a small JSON dict
of host-side metadata). Restores are checked against the checkpoint's tree
metadata *before* any array is read, so a config/checkpoint mismatch fails with
one readable line instead of an orbax/tensorstore traceback, and nothing on
disk is ever deleted or rewritten because of an error.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from absl import logging

_STATE = "state"
_EXTRA = "extra"


class CheckpointError(ValueError):
    """A checkpoint is missing, unreadable or incompatible with the config."""


def _one_line(err: BaseException, limit: int = 200) -> str:
    # Orbax/tensorstore errors can span many lines; the CLI contract is one line.
    text = " ".join(f"{type(err).__name__}: {err}".split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _key_name(key: Any) -> str:
    # Template NamedTuples use GetAttrKey while orbax metadata turns them into
    # dicts (DictKey) and tuples into lists, so compare paths by name only.
    for attr in ("name", "key", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def _flat(tree: Any, prefix: str = "") -> dict[str, Any]:
    """Flattens a pytree to ``{"a/b/c": leaf}``; empty nodes vanish."""
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {prefix + "/".join(_key_name(k) for k in path): leaf for path, leaf in leaves}


def _describe(paths: set[str]) -> str:
    more = f", +{len(paths) - 2} more" if len(paths) > 2 else ""
    return ", ".join(sorted(paths)[:2]) + more


def _check_compatible(saved: dict[str, Any], template: dict[str, Any], where: str) -> None:
    """Raises CheckpointError naming the first structure/shape/dtype mismatch."""
    missing, extra = set(template) - set(saved), set(saved) - set(template)
    if missing or extra:
        parts = [f"missing in checkpoint: {_describe(missing)}"] if missing else []
        parts += [f"only in checkpoint: {_describe(extra)}"] if extra else []
        raise CheckpointError(
            f"{where} has a different state structure ({'; '.join(parts)}); "
            "use a fresh --workdir or a matching --config"
        )
    # Parameters first: a model-shape mismatch is the most likely cause and
    # also shows up (less legibly) in the optimizer state.
    for path in sorted(template, key=lambda p: (not p.startswith("params"), p)):
        want, got = template[path], saved[path]
        if isinstance(want, (int, float, bool)):
            continue  # Python scalars are restored as given; no shape to check.
        want_shape, got_shape = tuple(want.shape), tuple(getattr(got, "shape", ()))
        want_dtype, got_dtype = np.dtype(want.dtype), getattr(got, "dtype", None)
        got_dtype = want_dtype if got_dtype is None else np.dtype(got_dtype)
        if want_shape != got_shape:
            kind, ours, theirs = "shape", want_shape, got_shape
        elif want_dtype != got_dtype:
            kind, ours, theirs = "dtype", want_dtype, got_dtype
        else:
            continue
        model = path.startswith("params")
        raise CheckpointError(
            f"{where} has a different {'model' if model else 'state'} {kind} ({path}: "
            f"checkpoint {theirs} vs config {ours}); use a fresh --workdir or matching "
            f"{'--config.model.*' if model else '--config'}"
        )


def _abstract(tree: Any) -> Any:
    # Keeps each jax.Array's sharding, so restored arrays land where the
    # template's do (e.g. sharded over the training mesh).
    return jax.tree.map(ocp.utils.to_shape_dtype_struct, tree)


def _unreadable(where: str, err: BaseException) -> CheckpointError:
    return CheckpointError(
        f"{where} is unreadable ({_one_line(err)}); "
        "delete that step's folder or restore an earlier one"
    )


def _saved_tree(manager: ocp.CheckpointManager, step: int, where: str) -> Any:
    """The checkpoint's ``state`` tree metadata (shapes/dtypes, no array data)."""
    try:
        tree = manager.item_metadata(step)[_STATE].tree
    except Exception as err:  # Any read failure means unreadable.
        raise _unreadable(where, err) from err
    if tree is None:
        raise _unreadable(where, FileNotFoundError("no state metadata"))
    return tree


class Checkpointer:
    """Saves/restores the training state under ``directory`` (``workdir/checkpoints``).

    Saves are asynchronous (training continues while arrays are written);
    ``wait()`` or ``close()`` make them durable.
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        keep: int | None = 3,
        save_interval_steps: int = 1,
    ):
        self.directory = Path(directory).expanduser().absolute()
        if self.directory.exists() and not self.directory.is_dir():
            raise ValueError(f"checkpoint directory {self.directory} is a file; pass a directory")
        if keep is not None and keep < 1:
            raise ValueError(f"keep must be >= 1 or None (keep all), got {keep}")
        self.directory.mkdir(parents=True, exist_ok=True)
        options = ocp.CheckpointManagerOptions(
            save_interval_steps=save_interval_steps,
            preservation_policy=ocp.checkpoint_managers.LatestN(n=keep),
            enable_async_checkpointing=True,
        )
        # Registering both handlers up front lets metadata/restores work on a
        # directory written by an earlier process, before any save here.
        self._manager = ocp.CheckpointManager(
            self.directory,
            item_handlers={
                _STATE: ocp.StandardCheckpointHandler(),
                _EXTRA: ocp.JsonCheckpointHandler(),
            },
            options=options,
        )

    def _where(self, step: int) -> str:
        return f"checkpoint at {self.directory} step {step}"

    def latest_step(self) -> int | None:
        """The newest saved step, or None when there is none."""
        return self._manager.latest_step()

    def save(self, step: int, state: Any, force: bool = False, extra: dict | None = None) -> bool:
        """Saves ``state`` (and the JSON-able ``extra``) at ``step``; returns whether it saved.

        Skips steps not on ``save_interval_steps`` unless ``force``. An existing
        step is never overwritten (e.g. saving again right after a resume).
        """
        step = int(step)
        if step in self._manager.all_steps():
            if jax.process_index() == 0:  # every process skips; one says so
                logging.warning("%s already exists; not overwriting it", self._where(step))
            return False
        items = {_STATE: ocp.args.StandardSave(state)}
        if extra is not None:
            items[_EXTRA] = ocp.args.JsonSave(extra)
        return self._manager.save(step, args=ocp.args.Composite(**items), force=force)

    def restore(self, state_template: Any, step: int | None = None) -> Any:
        """Restores the state at ``step`` (default: latest) shaped/sharded like the template.

        Raises CheckpointError (one line) when there is no checkpoint, when it
        does not match the template, or when it cannot be read.
        """
        self.wait()  # A restore must not race an in-flight save of that step.
        step = self.latest_step() if step is None else int(step)
        if step is None:
            raise CheckpointError(f"no checkpoint found in {self.directory}")
        where = self._where(step)
        if step not in (steps := list(self._manager.all_steps())):
            raise CheckpointError(f"{where} does not exist; saved steps: {steps}")
        _check_compatible(
            _flat(_saved_tree(self._manager, step, where)), _flat(state_template), where
        )
        args = ocp.args.Composite(**{_STATE: ocp.args.StandardRestore(_abstract(state_template))})
        try:
            return self._manager.restore(step, args=args)[_STATE]
        except Exception as err:  # Metadata was fine, so the data is bad.
            raise _unreadable(where, err) from err

    def restore_extra(self, step: int | None = None) -> dict | None:
        """The ``extra`` dict saved with ``step`` (default: latest), or None if absent."""
        self.wait()
        step = self.latest_step() if step is None else int(step)
        if step is None or not (self.directory / str(step) / _EXTRA).exists():
            return None
        try:
            return self._manager.restore(
                step, args=ocp.args.Composite(**{_EXTRA: ocp.args.JsonRestore()})
            )[_EXTRA]
        except Exception as err:
            raise _unreadable(self._where(step), err) from err

    def wait(self) -> None:
        """Blocks until in-flight async saves are fully written."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        """Finishes pending saves and releases orbax's background resources."""
        self._manager.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def load_params(checkpoint_dir_or_workdir: str | os.PathLike, params_template: Any) -> Any:
    """Returns the ``params`` subtree of the latest TrainState checkpoint (``init_from``).

    Only ``params`` is read (orbax partial restore), so no optimizer-state
    template is needed and the optimizer may differ from the saved run's.
    """
    path = Path(checkpoint_dir_or_workdir).expanduser().absolute()
    if (path / "checkpoints").is_dir():
        path = path / "checkpoints"
    if not path.is_dir():
        raise CheckpointError(f"no checkpoint directory at {path}")
    # read_only: another run's checkpoints must never be cleaned up from here.
    options = ocp.CheckpointManagerOptions(read_only=True, create=False, save_interval_steps=0)
    # PyTreeCheckpointHandler reads StandardCheckpointHandler's format and, unlike
    # it, supports partial_restore.
    handlers = {
        _STATE: ocp.PyTreeCheckpointHandler(),
        _EXTRA: ocp.JsonCheckpointHandler(),
    }
    with ocp.CheckpointManager(path, item_handlers=handlers, options=options) as mngr:
        step = mngr.latest_step()
        if step is None:
            raise CheckpointError(f"no checkpoint found in {path}")
        where = f"checkpoint at {path} step {step}"
        saved = _saved_tree(mngr, step, where)
        if not isinstance(saved, dict) or "params" not in saved:
            raise CheckpointError(
                f"{where} has no 'params' entry; is it a grpo_jax TrainState checkpoint?"
            )
        _check_compatible(
            _flat(saved["params"], "params/"), _flat(params_template, "params/"), where
        )
        item = {"params": _abstract(params_template)}
        args = ocp.args.PyTreeRestore(
            item=item,
            restore_args=ocp.checkpoint_utils.construct_restore_args(item),
            partial_restore=True,
        )
        try:
            restored = mngr.restore(step, args=ocp.args.Composite(**{_STATE: args}))
            return restored[_STATE]["params"]
        except Exception as err:
            raise _unreadable(where, err) from err


def ensure_workdir(workdir: str | os.PathLike) -> Path:
    """Creates ``workdir`` if missing; a plain file there is a usage error."""
    path = Path(workdir).expanduser()
    if path.exists() and not path.is_dir():
        raise ValueError(f"--workdir {path} is a file; pass a directory")
    path.mkdir(parents=True, exist_ok=True)
    return path


def _write_atomic(path: Path, text: str) -> None:
    # Write-then-rename so a crash never leaves a half-written config behind.
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
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


def latest_step_of(directory: str | os.PathLike) -> int | None:
    """The newest finalized step under ``directory`` (None when it has none), without opening
    a manager: orbax names a step's folder by its number only once the save is committed."""
    path = Path(directory).expanduser()
    steps = [int(p.name) for p in path.glob("*") if p.is_dir() and p.name.isdigit()]
    return max(steps) if steps else None
