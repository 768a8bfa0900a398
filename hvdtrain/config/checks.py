"""Checks every settings section uses: each raises ValueError naming the section's field and the value."""
from __future__ import annotations

import dataclasses
import difflib
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


def check_choices(section: Any) -> None:
    """Every field of a settings dataclass whose metadata names its ``choices`` holds one of them
    (a list field: each of them, at most once), or ValueError naming the field and the choices."""
    cls = type(section).__name__
    for spec in dataclasses.fields(section):
        choices = spec.metadata.get("choices")
        if not choices:
            continue
        value = getattr(section, spec.name)
        if isinstance(value, (list, tuple)):
            if any(item not in choices for item in value) or len(set(value)) != len(value):
                raise ValueError(f"{cls}.{spec.name} takes each of {', '.join(choices)} at most once, got {value!r}")
        elif value not in choices:
            raise ValueError(f"{cls}.{spec.name} must be one of {', '.join(choices)}, got {value!r}"
                             f"{_choice_hint(value, choices)}")


def _choice_hint(value: Any, choices: Any) -> str:
    """A case slip (FSDP) or a near spelling (zero-2) named, so the fix is one glance."""
    if not isinstance(value, str):
        return ""
    by_case = [choice for choice in choices if choice.lower() == value.lower()]
    if by_case:
        return f" (did you mean {by_case[0]}? the choices are lower case)"
    close = difflib.get_close_matches(value.lower(), list(choices), n=1)
    return f" (did you mean {close[0]}?)" if close else ""


def check_only_with(section: Any, name: str, default: Any, setting: str, needed: Any) -> None:
    """A field that means something under one value of another setting stays at its default otherwise, or
    ValueError with the two ways out.

    Args:
        section: the settings section holding both fields.
        name: the field checked.
        default: its default.
        setting: the field it depends on.
        needed: the value of ``setting`` under which ``name`` means something.
    """
    value, actual = getattr(section, name), getattr(section, setting)
    if actual != needed and value != default:
        cls = type(section).__name__
        raise ValueError(f"{cls}.{name}={value} applies to {setting}={needed} only, got {setting}={actual}: set "
                         f"{setting}={needed}, or leave {name} at {default}")
