"""Nested settings as flat keys."""
from __future__ import annotations

from typing import Any, Dict, Mapping


def flatten(settings: Mapping[str, Any], prefix: str = "") -> Dict[str, Any]:
    """{"train": {"lr": 0.1}} -> {"train.lr": 0.1}: every leaf under its dotted path."""
    flat: Dict[str, Any] = {}
    for key, value in settings.items():
        if isinstance(value, Mapping):
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat
