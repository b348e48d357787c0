"""Damaging a checkpoint on purpose, shared by the tests of what a damaged step does
(tests/test_reliability.py, tests/test_checkpoint.py)."""

from pathlib import Path


def flip_bit(step_dir: Path) -> Path:
    """Flips one bit in the middle of the step's largest data file (the arrays' bytes, which
    orbax stores without a checksum: the restore succeeds with other values); returns it."""
    path = max(
        (p for p in (step_dir / "state").rglob("d/*") if p.is_file()),
        key=lambda p: p.stat().st_size,
    )
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x04
    path.write_bytes(bytes(data))
    return path
