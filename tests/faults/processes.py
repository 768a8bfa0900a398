"""What /proc says of the test's processes: their children, their threads' states.

Read as the test sees them (its pid namespace), also for processes inside another one.
"""
import os
from typing import Dict, List


def parent_of(pid: int) -> int:
    """The parent of ``pid``, 0 when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return int(handle.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return 0


def descendants(pid: int) -> List[int]:
    """Every process started by ``pid``, by its children and so on, nearest first."""
    children: Dict[int, List[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            children.setdefault(parent_of(int(entry)), []).append(int(entry))
    found, frontier = [], [pid]
    while frontier:
        frontier = [child for parent in frontier for child in sorted(children.get(parent, []))]
        found.extend(frontier)
    return found


def started_by(pid: int, ancestor: int) -> bool:
    """Whether ``pid`` is ``ancestor`` or was started by it (or by its children, ...)."""
    while pid > 1:
        if pid == ancestor:
            return True
        pid = parent_of(pid)
    return pid == ancestor


def thread_states(pid: int) -> Dict[int, str]:
    """Each thread of ``pid`` and its state letter (R, S, D, T stopped, Z); empty when it is gone."""
    states = {}
    try:
        threads = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return states
    for tid in threads:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as handle:
                states[int(tid)] = handle.read().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            pass  # ended meanwhile
    return states
