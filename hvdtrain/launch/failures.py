"""Which rank failed first, and on which host, from what the launcher printed.

Open MPI names a dead rank as ``Process name: [[job,1],R]``, horovodrun --gloo as ``Process
name: R`` and elastic horovodrun as ``Process R exit with status code``; none names the host.
With the rank and the host list, hvdtrain can.
"""
from __future__ import annotations

import re
from typing import Optional, Sequence, Tuple

from hvdtrain.launch.hostfile import Host

_PATTERNS = (
    re.compile(r"Process name:\s*\[\[\d+,\d+\],(?P<rank>\d+)\]"),           # Open MPI mpirun
    re.compile(r"Process name: (?P<rank>\d+)\s*$", re.MULTILINE),             # horovodrun --gloo
    re.compile(r"Process (?P<rank>\d+) exit with status code"),              # horovodrun elastic
    re.compile(r"srun: error: (?P<host>[\w.-]+): task (?P<rank>\d+): "),     # srun
)


def rank_host(rank: int, hosts: Sequence[Host], default: str) -> str:
    """The host a rank runs on when ranks fill hosts slot by slot (mpirun -map-by slot, horovodrun)."""
    for host in hosts:
        if rank < host.slots:
            return host.name
        rank -= host.slots
    return default


def first_failed_rank(output: str) -> Optional[Tuple[int, Optional[str]]]:
    """(rank, host if the launcher said it) of the first failure the launcher reported."""
    found = []
    for pattern in _PATTERNS:
        match = pattern.search(output)
        if match:
            found.append((match.start(), int(match.group("rank")), match.groupdict().get("host")))
    if not found:
        return None
    _, rank, host = min(found)
    return rank, host
