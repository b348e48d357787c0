"""Damaging a checkpoint on purpose, shared by the tests of what a damaged step does
(tests/test_reliability.py, tests/test_checkpoint.py)."""

import warnings
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp


def _arrays(step_dir: Path) -> list | None:
    """The step's saved arrays as orbax reads them without a template, or None if it cannot."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Sharding info not provided when restoring"
        try:
            tree = ocp.PyTreeCheckpointer().restore(step_dir / "state")
        except Exception:
            return None
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


def flip_bit(step_dir: Path, stride: int = 101) -> Path:
    """Flips one bit in the step's largest data file so that orbax still reads every array
    and one of them holds other values: the silent damage only the saved digests catch.
    orbax stores the arrays as zstd frames without a checksum: most flips change a value, but
    one in a frame's header or entropy tables makes the step unreadable instead (which bytes
    those are depends on the values and on the order the frames were written in). So the
    middle byte first, then every ``stride``-th byte after it, until such a flip is found;
    returns the file."""
    path = max(
        (p for p in (step_dir / "state").rglob("d/*") if p.is_file()),
        key=lambda p: p.stat().st_size,
    )
    original, before = path.read_bytes(), _arrays(step_dir)
    assert before is not None, f"{step_dir} is unreadable before any damage"
    for offset in range(len(original) // 2, len(original), stride):
        data = bytearray(original)
        data[offset] ^= 0x04
        path.write_bytes(bytes(data))
        after = _arrays(step_dir)
        changed = after is not None and any(
            not np.array_equal(a, b) for a, b in zip(before, after, strict=True)
        )
        if changed:
            return path
    path.write_bytes(original)
    raise AssertionError(f"no bit flip in the second half of {path} left the step readable")
