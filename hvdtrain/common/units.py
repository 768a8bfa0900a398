"""Byte sizes for people, both ways: one table of units for the core's logs and messages and for the
tools that must not import torch (``hvdtrain plan`` runs on login nodes)."""
from __future__ import annotations

import re
from typing import Optional

KiB, MiB, GiB, TiB = 2 ** 10, 2 ** 20, 2 ** 30, 2 ** 40
# Every unit a size may be written in: binary (KiB...) and decimal (kB, MB...), case aside.
UNITS = {"": 1, "b": 1, "kb": 10 ** 3, "mb": 10 ** 6, "gb": 10 ** 9, "tb": 10 ** 12,
         "kib": KiB, "mib": MiB, "gib": GiB, "tib": TiB}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-z]*)\s*$", re.I)


def format_bytes(count: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(count) < 1024 or unit == "GiB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    return f"{count:.1f} TiB"


def parse_bytes(text: str) -> Optional[float]:
    """'2GiB', '40GB', '512MiB', '1e9' -> bytes; None when ``text`` is not a size."""
    match = _SIZE.match(text)
    if not match or match.group(2).lower() not in UNITS:
        return None
    return float(match.group(1)) * UNITS[match.group(2).lower()]


def mib(count: float) -> float:
    return count / MiB


_BINARY = re.compile(r"^(\d+)([KMG]?)(?:I?B)?$", re.I)
_BINARY_SCALES = (("G", GiB), ("M", MiB), ("K", KiB))


def parse_binary_size(token: str) -> Optional[int]:
    """nccl-tests' notation, powers of 1024: '4K', '1M', '64MiB', '512' -> bytes; None otherwise."""
    match = _BINARY.match(token.strip())
    if not match:
        return None
    scale = dict(_BINARY_SCALES).get(match.group(2).upper(), 1)
    return int(match.group(1)) * scale


def binary_label(size: int) -> str:
    """The shortest exact label of ``size`` in that notation: 4096 -> '4K'."""
    for unit, scale in _BINARY_SCALES:
        if size % scale == 0:
            return f"{size // scale}{unit}"
    return str(size)
