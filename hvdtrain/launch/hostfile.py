"""One parser for the hostfile formats people already have, and a writer for each launcher.

    node001 slots=4 max_slots=8     # Open MPI
    node002:4                       # Horovod (-H / --hostfile) and MPICH
    node003                         # bare: one slot

Comments (#) and blank lines are allowed anywhere (Horovod's own parser crashes on them). Every
error names the file and the line. Host names are checked, because they end up in ssh and
mpirun command lines: nothing but letters, digits, '.', '-' and '_' gets through.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, List, Optional, Sequence

from hvdtrain.common.errors import HvdtrainError

_HOSTNAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,252}$")
_OPENMPI_KEYS = {"slots", "max_slots", "max-slots"}


class HostfileError(HvdtrainError, ValueError):
    """A hostfile or host list that cannot be used; the message says where and why."""


@dataclass(frozen=True)
class Host:
    name: str
    slots: int
    max_slots: Optional[int] = None


def check_hostname(name: str, where: str) -> str:
    if not _HOSTNAME.match(name):
        raise HostfileError(
            f"{where}: bad host name {name!r}: use letters, digits, '.', '-' and '_' only "
            f"(starting with a letter or digit)"
        )
    return name


def _count(raw: str, what: str, where: str) -> int:
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1 or not raw.isdigit():
        raise HostfileError(f"{where}: bad {what} {raw!r}: expected a whole number >= 1")
    return value


def _parse_line(line: str, where: str) -> Host:
    fields = line.split()
    first = fields[0]
    if ":" in first:  # Horovod/MPICH: host:N
        if len(fields) > 1:
            raise HostfileError(f"{where}: unexpected {' '.join(fields[1:])!r} after {first!r}")
        name, _, slots = first.partition(":")
        return Host(check_hostname(name, where), _count(slots, "slot count", where))
    name = check_hostname(first, where)
    options = {}
    for field in fields[1:]:
        key, sep, value = field.partition("=")
        if not sep or key not in _OPENMPI_KEYS:
            raise HostfileError(
                f"{where}: unknown setting {field!r}: expected slots=N or max_slots=M"
            )
        options[key.replace("-", "_")] = _count(value, key, where)
    slots = options.get("slots", 1)
    max_slots = options.get("max_slots")
    if max_slots is not None and max_slots < slots:
        raise HostfileError(f"{where}: max_slots={max_slots} is below slots={slots}")
    return Host(name, slots, max_slots)


def parse_hosts(text: str, source: str, unit: str = "line") -> List[Host]:
    """Hosts of a hostfile's text, in order; errors say ``source:N`` (or ``source unit N``)."""
    hosts: List[Host] = []
    seen = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        where = f"{source}:{number}" if unit == "line" else f"{source} {unit} {number}"
        host = _parse_line(line, where)
        if host.name in seen:
            raise HostfileError(
                f"{where}: host {host.name!r} is listed again (first at {unit} {seen[host.name]}): "
                f"give it one line with the total slots"
            )
        seen[host.name] = number
        hosts.append(host)
    if not hosts:
        raise HostfileError(f"{source}: no hosts listed")
    return hosts


def parse_hostfile(path: Path) -> List[Host]:
    try:
        text = Path(path).read_text()
    except OSError as error:
        raise HostfileError(f"cannot read hostfile {path}: {error.strerror}") from None
    return parse_hosts(text, str(path))


def parse_host_list(value: str) -> List[Host]:
    """Horovod's -H form: ``a:2,b:2`` (a host without :N has one slot)."""
    return parse_hosts("\n".join(value.split(",")), f"-H {value!r}", unit="entry")


def hosts_from_options(hostfile: Optional[str], host_list: Optional[str]) -> Optional[List[Host]]:
    """The hosts of --hostfile or -H, whichever was given; None when neither was."""
    if hostfile:
        return parse_hostfile(Path(hostfile))
    if host_list:
        return parse_host_list(host_list)
    return None


def total_slots(hosts: Iterable[Host]) -> int:
    return sum(host.slots for host in hosts)


def to_openmpi(hosts: Sequence[Host]) -> str:
    return "".join(
        f"{h.name} slots={h.slots}" + (f" max_slots={h.max_slots}" if h.max_slots else "") + "\n"
        for h in hosts
    )


def to_colon_lines(hosts: Sequence[Host]) -> str:
    """Horovod's --hostfile and MPICH's -f format: host:N per line."""
    return "".join(f"{h.name}:{h.slots}\n" for h in hosts)


def to_host_list(hosts: Sequence[Host]) -> str:
    """One argument for -H (Horovod, Open MPI) or -hosts (MPICH): a:2,b:2."""
    return ",".join(f"{h.name}:{h.slots}" for h in hosts)
