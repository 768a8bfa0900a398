"""Ending a launch started in a session of its own: every process of it, not only the launcher's group."""
from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import List, Sequence


def session_members(session: int) -> List[int]:
    """The live processes whose session id is ``session`` (Linux: read from /proc)."""
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
            if state != "Z" and os.getsid(int(entry.name)) == session:
                members.append(int(entry.name))
        except (OSError, IndexError):  # gone meanwhile
            continue
    return members


def kill_session(session: int, timeout: float = 30.0) -> None:
    """SIGKILL every process of a launch started with ``start_new_session`` (its session id is the
    launcher's pid) and wait until none is left. Killing the launcher's process group is not enough:
    mpirun puts each rank in a process group of its own, and a rank whose mpirun died goes on
    training (and writing checkpoints) until it notices. RuntimeError if some outlive SIGKILL."""
    deadline = time.monotonic() + timeout
    while True:
        members = session_members(session)
        if not members:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"processes {members} of session {session} outlived SIGKILL")
        for pid in members:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.05)


def descendants_running(root: int, command: Sequence[str]) -> List[int]:
    """The live descendants of process ``root`` whose command line is ``command``: a launcher's
    ranks on this host (psutil, which Horovod installs; imported here only)."""
    import psutil
    try:
        children = psutil.Process(root).children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    found = []
    for child in children:
        try:
            if child.cmdline() == list(command) and child.status() != psutil.STATUS_ZOMBIE:
                found.append(child.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found
