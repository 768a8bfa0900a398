"""Sizes for people: one formatter shared by the core's logs and the tools that must not import
torch (``hvdtrain plan`` runs on login nodes)."""
from __future__ import annotations


def format_bytes(count: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(count) < 1024 or unit == "GiB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    return f"{count:.1f} TiB"
