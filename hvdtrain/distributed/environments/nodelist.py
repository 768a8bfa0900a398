"""SLURM's compressed host lists, expanded: ``node[001-004,007]``, ``a[1-2],b[3-4]``, ``n[1-2]-ib``.

Peers that take the first bracket entry, or split on every comma, get the rank-0 address wrong
on real clusters; this follows SLURM's own grammar (``scontrol show hostnames``): commas at the
top level separate hosts, each bracket holds comma-separated numbers or ranges, zero padding is
kept (``01-10`` gives ``01``...``10``), and several brackets in one name form their product.
"""
from __future__ import annotations

import re
from typing import List

from hvdtrain.common.errors import HvdtrainError

_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")
_HOSTNAME_PART = re.compile(r"^[A-Za-z0-9._-]*$")


class NodelistError(HvdtrainError, ValueError):
    """A host list that does not follow SLURM's grammar."""


def _split_top_level(text: str) -> List[str]:
    """Split on commas that are not inside brackets."""
    parts, depth, current = [], 0, []
    for char in text:
        if char == "[":
            if depth:
                raise NodelistError(f"nested '[' in host list {text!r}")
            depth += 1
        elif char == "]":
            if not depth:
                raise NodelistError(f"']' without '[' in host list {text!r}")
            depth -= 1
        if char == "," and not depth:
            parts.append("".join(current))
            current = []
        else:
            current.append(char)
    if depth:
        raise NodelistError(f"'[' without ']' in host list {text!r}")
    parts.append("".join(current))
    return parts


def _expand_bracket(body: str, source: str) -> List[str]:
    values: List[str] = []
    for item in body.split(","):
        match = _RANGE.match(item.strip())
        if not match:
            raise NodelistError(f"bad range {item!r} in host list {source!r}: expected N or N-M")
        first, last = match.group(1), match.group(2) or match.group(1)
        if int(last) < int(first):
            raise NodelistError(f"range {item!r} in host list {source!r} runs backwards")
        width = len(first) if first.startswith("0") and len(first) > 1 else 0
        values.extend(str(n).zfill(width) for n in range(int(first), int(last) + 1))
    return values


def _expand_one(pattern: str, source: str) -> List[str]:
    match = re.search(r"\[([^\]]*)\]", pattern)
    if not match:
        if not pattern or not _HOSTNAME_PART.match(pattern):
            raise NodelistError(f"bad host name {pattern!r} in host list {source!r}")
        return [pattern]
    prefix, suffix = pattern[: match.start()], pattern[match.end():]
    if not _HOSTNAME_PART.match(prefix):
        raise NodelistError(f"bad host name part {prefix!r} in host list {source!r}")
    return [
        host
        for value in _expand_bracket(match.group(1), source)
        for host in _expand_one(prefix + value + suffix, source)
    ]


def expand_nodelist(nodelist: str) -> List[str]:
    """Every host name of a SLURM host list, in SLURM's order."""
    text = nodelist.strip()
    if not text:
        raise NodelistError("empty host list")
    hosts: List[str] = []
    for part in _split_top_level(text):
        hosts.extend(_expand_one(part.strip(), nodelist))
    return hosts
