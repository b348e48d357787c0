"""Checkpointing of the training state, built on orbax's ``CheckpointManager``.

Each step folder holds two orbax items: ``state`` (the TrainState pytree, saved
with ``StandardCheckpointHandler``) and an optional ``extra`` (a small JSON dict
of host-side metadata). Restores are checked against the checkpoint's tree
metadata *before* any array is read, so a config/checkpoint mismatch fails with
one readable line instead of an orbax/tensorstore traceback, and nothing on
disk is ever deleted or rewritten because of an error.

Each step also holds an ``integrity`` item (integrity.py): digests of the vocabulary and data
file it was trained on and of its own state bytes. A resume on other inputs is refused in one
line; a damaged latest step (digest mismatch, unreadable files) is reported in one warning
line and the previous intact step is restored instead. Uncommitted step folders (a crash
mid-save) are skipped with a warning.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from absl import logging

from grpo_jax import integrity

_STATE = "state"
_EXTRA = "extra"
_INTEGRITY = "integrity"


class CheckpointError(ValueError):
    """A checkpoint is missing, unreadable or incompatible with the config."""


class DamagedCheckpointError(CheckpointError):
    """A step's files are unreadable or differ from their digests: an earlier step may do."""


def _one_line(err: BaseException, limit: int = 200) -> str:
    # Orbax/tensorstore errors can span many lines; the CLI contract is one line.
    text = " ".join(f"{type(err).__name__}: {err}".split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _flat(tree: Any, prefix: str = "") -> dict[str, Any]:
    """Flattens a pytree to ``{"a/b/c": leaf}``; empty nodes vanish."""
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {prefix + "/".join(integrity.key_name(k) for k in path): leaf for path, leaf in leaves}


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
    return DamagedCheckpointError(f"{where} is unreadable ({_one_line(err)})")


_FIX = "delete that step's folder or restore an earlier one"


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
    ``wait()`` or ``close()`` make them durable. ``identity`` (integrity.run_identity) is
    recorded with every save and checked by every restore.
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        keep: int | None = 3,
        save_interval_steps: int = 1,
        identity: dict | None = None,
    ):
        self.directory = Path(directory).expanduser().absolute()
        if self.directory.exists() and not self.directory.is_dir():
            raise ValueError(f"checkpoint directory {self.directory} is a file; pass a directory")
        if keep is not None and keep < 1:
            raise ValueError(f"keep must be >= 1 or None (keep all), got {keep}")
        self.identity = dict(identity or {})
        self._damaged: set[int] = set()  # steps found damaged here: a save may set them aside
        self._warned: set[str] = set()
        self.directory.mkdir(parents=True, exist_ok=True)
        options = ocp.CheckpointManagerOptions(
            save_interval_steps=save_interval_steps,
            preservation_policy=ocp.checkpoint_managers.LatestN(n=keep),
            enable_async_checkpointing=True,
        )
        # Registering every handler up front lets metadata/restores work on a
        # directory written by an earlier process, before any save here.
        self._manager = ocp.CheckpointManager(
            self.directory,
            item_handlers={
                _STATE: ocp.StandardCheckpointHandler(),
                _EXTRA: ocp.JsonCheckpointHandler(),
                _INTEGRITY: ocp.JsonCheckpointHandler(),
            },
            options=options,
        )

    def _where(self, step: int) -> str:
        return f"checkpoint at {self.directory} step {step}"

    def committed_steps(self) -> list[int]:
        """Saved steps whose save finished; warns once about each uncommitted folder."""
        steps, uncommitted = integrity.step_dirs(self.directory)
        for name in uncommitted:
            if name not in self._warned and jax.process_index() == 0:
                logging.warning(
                    "ignoring uncommitted checkpoint folder %s (a save that never finished)",
                    self.directory / name,
                )
            self._warned.add(name)
        return steps

    def latest_step(self) -> int | None:
        """The newest committed step, or None; in-flight saves finish first (so it counts)."""
        self.wait()
        steps = self.committed_steps()
        return steps[-1] if steps else None

    def has_intact(self, step: int) -> bool:
        """Whether ``step`` is committed and was not found damaged here: saving it is skipped."""
        return step in self.committed_steps() and step not in self._damaged

    def _set_aside(self, step: int) -> bool:
        """Renames a damaged or uncommitted step folder to ``<step>.damaged[-n]`` so that this
        step can be saved again; its bytes stay on disk for inspection, never deleted."""
        if jax.process_count() > 1:
            return False  # one renamer on a shared filesystem would race the others' saves
        src = self.directory / str(step)
        n, dst = 0, self.directory / f"{step}.damaged"
        while dst.exists():
            n += 1
            dst = self.directory / f"{step}.damaged-{n}"
        src.rename(dst)
        self._damaged.discard(step)  # the step's next folder is the save's own
        self._manager.reload()
        logging.warning("moved the damaged or uncommitted %s aside to %s", src, dst.name)
        return True

    def save(self, step: int, state: Any, force: bool = False, extra: dict | None = None) -> bool:
        """Saves ``state`` (and the JSON-able ``extra``) at ``step``; returns whether it saved.

        Skips steps not on ``save_interval_steps`` unless ``force``. An existing intact
        step is never overwritten (e.g. saving again right after a resume); a damaged or
        uncommitted one is set aside first.
        """
        step = int(step)
        if (self.directory / str(step)).exists():
            if self.has_intact(step) or not self._set_aside(step):
                if jax.process_index() == 0:  # every process skips; one says so
                    logging.warning("%s already exists; not overwriting it", self._where(step))
                return False
        # Digests from one host copy of the state: a save is a host sync anyway, and this
        # is the only extra transfer (cheap for the small models this framework trains).
        record = {"identity": self.identity, "state_sha256": integrity.state_sha256(state)}
        items = {_STATE: ocp.args.StandardSave(state), _INTEGRITY: ocp.args.JsonSave(record)}
        if extra is not None:
            items[_EXTRA] = ocp.args.JsonSave(extra)
        return self._manager.save(step, args=ocp.args.Composite(**items), force=force)

    def restore(self, state_template: Any, step: int | None = None) -> Any:
        """Restores the state at ``step`` (default: the latest intact one) shaped/sharded like
        the template.

        Raises CheckpointError (one line) when there is no checkpoint, when it does not
        match the template or the run's identity, or when no step is intact. Without
        ``step``, a damaged step is reported in one warning line and the previous one tried.
        """
        self.wait()  # A restore must not race an in-flight save of that step.
        steps = self.committed_steps()
        if step is not None:
            if int(step) not in steps:
                raise CheckpointError(f"{self._where(step)} does not exist; saved steps: {steps}")
            return self._restore_step(state_template, int(step))
        if not steps:
            raise CheckpointError(f"no checkpoint found in {self.directory}")
        problems = []
        for i, candidate in enumerate(reversed(steps)):
            try:
                return self._restore_step(state_template, candidate)
            except DamagedCheckpointError as err:
                self._damaged.add(candidate)
                problems.append(str(err))
                if i + 1 < len(steps) and jax.process_index() == 0:
                    logging.warning("%s; falling back to the previous checkpoint", err)
        if len(problems) == 1:
            raise CheckpointError(f"{problems[0]}; {_FIX}")
        raise CheckpointError(
            f"no intact checkpoint in {self.directory} ({'; '.join(problems)}); move the "
            "damaged step folders aside to start afresh"
        )

    def _restore_step(self, state_template: Any, step: int) -> Any:
        where = self._where(step)
        _check_compatible(
            _flat(_saved_tree(self._manager, step, where)), _flat(state_template), where
        )
        record = _integrity_record(self._manager, step, where)
        mismatch = integrity.identity_mismatch(step, record.get("identity", {}), self.identity)
        if mismatch:
            raise CheckpointError(mismatch)  # every step shares it: no fallback
        args = ocp.args.Composite(**{_STATE: ocp.args.StandardRestore(_abstract(state_template))})
        try:
            state = self._manager.restore(step, args=args)[_STATE]
        except Exception as err:  # Metadata was fine, so the data is bad.
            raise _unreadable(where, err) from err
        bad = integrity.state_mismatch(record.get("state_sha256"), integrity.state_sha256(state))
        if bad:
            raise DamagedCheckpointError(f"{where} is damaged: {bad}")
        return state

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


def load_params(
    checkpoint_dir_or_workdir: str | os.PathLike, params_template: Any, identity=None
) -> Any:
    """Returns the ``params`` subtree of the latest TrainState checkpoint (``init_from``).

    Only ``params`` is read (orbax partial restore), so no optimizer-state
    template is needed and the optimizer may differ from the saved run's. The params are
    checked against the digest saved with them (a flipped bit is refused, as on resume),
    and the checkpoint's vocabulary against ``identity``'s when given (the data may differ:
    GRPO may start from a model pretrained on another corpus of the same vocabulary).
    """
    try:
        return _load_params(checkpoint_dir_or_workdir, params_template, identity or {})
    except DamagedCheckpointError as err:
        raise CheckpointError(f"{err}; {_FIX}") from err


def _integrity_record(manager, step: int, where: str) -> dict:
    """The step's integrity item (integrity.py), {} for a step saved before they existed."""
    if not (Path(manager.directory) / str(step) / _INTEGRITY).exists():
        return {}  # nothing to check
    args = ocp.args.Composite(**{_INTEGRITY: ocp.args.JsonRestore()})
    try:
        return manager.restore(step, args=args)[_INTEGRITY] or {}
    except Exception as err:
        raise _unreadable(where, err) from err


def _checked_params(mngr, step: int, where: str, restored: Any, identity: dict) -> Any:
    """``restored`` params once the step's integrity record (if any) vouches for them."""
    record = _integrity_record(mngr, step, where)
    saved_vocab = record.get("identity", {}).get("vocab_sha256")
    vocab = identity.get("vocab_sha256")
    if saved_vocab and vocab and saved_vocab != vocab:
        raise CheckpointError(
            f"{where} was trained on another vocabulary (digest {integrity.short(saved_vocab)}, "
            f"this run's {integrity.short(vocab)}); initialise from a checkpoint of this run's "
            "vocabulary (the same corpus characters, or the same tokenizer)"
        )
    saved = (record.get("state_sha256") or {}).get("params")
    # None where this process cannot hash them (a multi-host sharded state): nothing to check
    read = integrity.state_sha256({"params": restored})
    bad = integrity.state_mismatch({"params": saved} if saved else None, read)
    if bad:
        raise DamagedCheckpointError(f"{where} is damaged: {bad}")
    return restored


def _load_params(
    checkpoint_dir_or_workdir: str | os.PathLike, params_template: Any, identity
) -> Any:
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
        _INTEGRITY: ocp.JsonCheckpointHandler(),
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
        except Exception as err:
            raise _unreadable(where, err) from err
        return _checked_params(mngr, step, where, restored[_STATE]["params"], identity)


def latest_step_of(directory: str | os.PathLike) -> int | None:
    """The newest committed step under ``directory`` (None when it has none), without opening
    a manager (uncommitted folders, e.g. of a crash mid-save, do not count)."""
    steps = integrity.step_dirs(Path(directory).expanduser())[0]
    return steps[-1] if steps else None
