"""What a checkpoint needs to prove about itself: digests of its inputs and of its own bytes.

A step folder's ``integrity`` item (JSON) records

* ``identity``: what the run was trained on, ``{"vocab_sha256": ..., "data_sha256": ...}``.
  A corpus of the same size with other characters gives the same shapes, so only these
  digests tell that its ids now mean other characters. A vocabulary kept as a file in the
  workdir (a BPE tokenizer.json) is digested byte for byte and named (``vocab_file``), so a
  resume on an edited or replaced file is refused naming it. A run from ``init_from`` adds
  the digest of the params it started from (``init_sha256``): every resume reads its initial
  params and its frozen KL reference from ``init_from`` again, so a resume whose
  ``init_from`` now holds other params (pretraining continued into it) is refused;
* ``state_sha256``: one sha256 per top-level entry of the saved state (``params``,
  ``opt_state``, ...), over its leaves' paths, dtypes, shapes and bytes in sorted path order.
  A flipped bit in a data file loads silently through orbax (uncompressed float bytes),
  so only this digest notices it.

Everything here is pure (no orbax): the Checkpointer (checkpoint.py) decides what a
mismatch means.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import jax
import numpy as np

# orbax writes this file into a step folder as part of committing it; a folder without it
# was never committed (a crash mid-save, a partial copy).
STEP_METADATA = "_CHECKPOINT_METADATA"
# Newer orbax also writes this marker on commit (and requires it on object stores).
COMMIT_MARKER = "commit_success.txt"
TMP_INFIX = ".orbax-checkpoint-tmp"


def short(digest: str | None) -> str:
    """The first 12 hex digits and an ellipsis: enough to tell two digests apart in a line."""
    return f"{digest[:12]}…" if digest else "none"


def text_sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def vocab_sha256(vocab: Any) -> str | None:
    """Digest of a task's tokenizer: its characters (data.Vocab, tokenizer.CharTokenizer), or a
    HuggingFace tokenizer's JSON (``to_str``); None for a task without one (toy bandit)."""
    if vocab is None:
        return None
    if hasattr(vocab, "chars"):
        # The class name too: CharTokenizer shifts ids by its PAD and EOS, data.Vocab does not.
        return text_sha256(f"{type(vocab).__name__}:{vocab.chars}")
    if hasattr(vocab, "to_str"):
        return text_sha256(vocab.to_str())
    return None


def run_identity(vocab: Any, data_sha256: str | None = None) -> dict[str, str]:
    """The identity a checkpoint records and a resume checks (absent entries are not checked;
    ``vocab_file``, the name of a vocabulary kept in the workdir, only words the refusal)."""
    identity = {
        "vocab_sha256": vocab_sha256(vocab),
        "data_sha256": data_sha256 or None,
        "vocab_file": getattr(vocab, "file_name", None),
    }
    return {k: v for k, v in identity.items() if v}


def init_identity(init_from: str, params: Any) -> dict[str, str]:
    """What a run from ``init_from`` started from: the digest of the params read there (as
    ``state_sha256`` names a state's params). ``init_from`` only words the refusal. {} without
    ``init_from``: a random init is the seed's, which the workdir's record already fixes."""
    digest = (state_sha256({"params": params}) or {}).get("params") if init_from else None
    return {"init_sha256": digest, "init_from": init_from} if digest else {}


def key_name(key: Any) -> str:
    """A pytree path entry's name: template NamedTuples use GetAttrKey while orbax metadata
    turns them into dicts (DictKey) and tuples into lists, so paths compare by name only."""
    for attr in ("name", "key", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def _host_leaves(tree: Any) -> list[tuple[str, np.ndarray]] | None:
    """``[(path, host array)]`` sorted by path; None when a leaf lives partly on other hosts
    (FSDP over several processes): each process sees only its shards, so no common digest."""
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    out = []
    for path, leaf in leaves:
        if isinstance(leaf, jax.Array) and not (
            leaf.is_fully_addressable or leaf.is_fully_replicated
        ):
            return None
        out.append(("/".join(key_name(k) for k in path), leaf))
    # One transfer for the whole tree (device_get batches the copies); the caller runs at save
    # and restore time only, never inside the step loop.
    host = jax.device_get([leaf for _, leaf in out])
    return sorted(((p, np.asarray(a)) for (p, _), a in zip(out, host, strict=True)))


def state_sha256(state: Any) -> dict[str, str] | None:
    """``{top-level entry: sha256}`` over the state's leaves, or None (see ``_host_leaves``)."""
    leaves = _host_leaves(state)
    if leaves is None:
        return None
    digests: dict[str, Any] = {}
    for path, array in leaves:
        top = path.split("/", 1)[0]
        h = digests.setdefault(top, hashlib.sha256())
        array = np.ascontiguousarray(array)
        h.update(f"{path}|{array.dtype.str}|{array.shape}|".encode())
        h.update(array.tobytes())
    return {top: h.hexdigest() for top, h in digests.items()}


def identity_mismatch(step: int, saved: dict, current: dict) -> str | None:
    """One line naming the first input that differs from what the checkpoint was trained on."""
    what = {
        "vocab_sha256": (
            "a vocabulary",
            "the corpus now gives",
            "same-size corpus with other "
            "characters? use the data it was trained on, or a fresh --workdir",
        ),
        "data_sha256": (
            "a data file",
            "the data file now has",
            "use the file it was trained on, or a fresh --workdir",
        ),
    }
    if "init_from" in current:  # a resume reads its initial params and KL reference there
        what["init_sha256"] = (
            "initial params",
            f"init_from {current['init_from']}'s latest checkpoint now has",
            "a resume reads its initial params and KL reference there: make the checkpoint "
            "the run started from its latest again (move later steps aside), or use a fresh "
            "--workdir",
        )
    name = current.get("vocab_file")
    if name:  # the vocabulary is the workdir's file, not the corpus's characters
        fix = f"restore the {name} it was trained with, or use a fresh --workdir"
        what["vocab_sha256"] = ("a tokenizer", f"the workdir's {name} now has", fix)
    for key, (noun, now, fix) in what.items():
        if key in saved and key in current and saved[key] != current[key]:
            return (
                f"checkpoint step {step} was trained on {noun} with digest "
                f"{short(saved[key])} but {now} {short(current[key])}; {fix}"
            )
    return None


def state_mismatch(saved: dict | None, restored: dict | None) -> str | None:
    """The state entries whose bytes differ from their digest at save time, e.g. 'params'."""
    if not saved or not restored:
        return None  # an old checkpoint (no digests) or a multi-host sharded state
    bad = sorted(k for k in saved if restored.get(k) != saved[k])
    if not bad:
        return None
    first = bad[0]
    return (
        f"{', '.join(bad)} bytes do not match the digest saved with them ({first}: saved "
        f"{short(saved[first])}, read {short(restored.get(first))})"
    )


def step_dirs(directory: Path) -> tuple[list[int], list[str]]:
    """(committed step numbers, names of uncommitted step folders) under ``directory``."""
    if not directory.is_dir():
        return [], []
    named = [p for p in directory.iterdir() if p.is_dir()]
    digit = [p for p in named if p.name.isdigit()]
    # The commit marker is required only where this orbax writes one (older versions do not).
    marker = any((p / COMMIT_MARKER).exists() for p in digit)
    committed, uncommitted = [], [p.name for p in named if TMP_INFIX in p.name]
    for p in digit:
        ok = (p / STEP_METADATA).exists() and (not marker or (p / COMMIT_MARKER).exists())
        (committed.append(int(p.name)) if ok else uncommitted.append(p.name))
    return sorted(committed), sorted(uncommitted)
