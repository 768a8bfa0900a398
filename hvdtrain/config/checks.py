"""Checks every settings section uses: each raises ValueError naming the section's field and the value."""
from __future__ import annotations

from typing import Any


def check_whole_numbers(section: Any, names: tuple, minimum: int = 1) -> None:
    """Each named field of a settings dataclass is an int >= ``minimum``, or ValueError naming it."""
    for name in names:
        value = getattr(section, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
            raise ValueError(f"{type(section).__name__}.{name} must be a whole number >= {minimum}, got {value!r}")


def check_fraction(section: Any, name: str) -> None:
    """A share strictly between 0 and 1, or ValueError naming the field."""
    value = getattr(section, name)
    if not 0 < value < 1:
        raise ValueError(f"{type(section).__name__}.{name} must be between 0 and 1, got {value!r}")
