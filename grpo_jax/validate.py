"""The config's one-line checks: each names the field, its value and what would be valid.

specs.py, run_spec.py and every task's ``specs(config)`` validate their settings with these, so
that every bad setting ends in the same shape of message (main.py prints it as one ``error:``
line).
"""

import math
from typing import Any


def require(ok: bool, field: str, value: Any, valid: str) -> None:
    """The one shape of a config error: ``field=value`` and what would be valid (a phrase
    starting "must ..."), e.g. "group.size=1 must be an integer >= 2"."""
    if not ok:
        raise ValueError(f"{field}={value!r} {valid}")


def choice(field: str, value: Any, choices) -> Any:
    if value not in choices:
        raise ValueError(f"{field}={value!r} is unknown; choose from {', '.join(choices)}")
    return value


def integer(field: str, value: Any, low: int = 0) -> int:
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= low
    require(ok, field, value, f"must be an integer >= {low}")
    return int(value)


def boolean(field: str, value: Any) -> bool:
    require(isinstance(value, bool), field, value, "must be True or False")
    return value


def integers(field: str, value: Any, low: int = 1) -> tuple[int, ...]:
    ok = isinstance(value, tuple | list) and all(
        isinstance(v, int) and not isinstance(v, bool) and v >= low for v in value
    )
    require(ok, field, value, f"must be a tuple of integers >= {low}, e.g. ({low}, {low + 3})")
    return tuple(int(v) for v in value)


def number(
    field: str, value: Any, low: float = -math.inf, high: float = math.inf, open_low=False,
    open_high=False,
):  # fmt: skip
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    ok = ok and (value > low if open_low else value >= low)
    ok = ok and (value < high if open_high else value <= high)
    bounds = f"{'(' if open_low else '['}{low}, {high}{')' if open_high else ']'}"
    require(ok, field, value, f"must be a finite number in {bounds}")
    return float(value)
