"""Faults on demand, for tests of what hvdtrain does on a bad day, all on one machine:

  hung_mount.py   HungMount: a mount under a path whose file calls wait (or fail) on the test's
                  order, as on a network file system gone quiet; fuse_server.py is its server
                  process, gate.py what the server does with each call, rules.py what a rule
                  stops, channel.py how the test talks to the server
  machines.py     machine_command: a command run as on another machine (host name, boot id,
                  pid namespace of its own), so two machines can share one name
  pausing.py      pause_when_blocked / pause: a process stopped (SIGSTOP) at a chosen call, for
                  an owner that resumes after another host took over
  processes.py    what /proc says of the test's processes (children, thread states)

Each skips the test that uses it, saying why, where the machine cannot do it (not root, no
/dev/fuse, unshare refused); tests/unit/test_fault_harness.py shows each at work. Test support
only: nothing in hvdtrain imports it, and it imports nothing of hvdtrain; the standard library
alone at import time (the server process, which starts from this package, needs no pytest).
"""
from tests.faults.hung_mount import Call, HungMount, fuse_missing, require_fuse
from tests.faults.machines import machine_command, machines_missing, require_machines
from tests.faults.pausing import Paused, pause, pause_when_blocked

__all__ = ["Call", "HungMount", "Paused", "fuse_missing", "machine_command", "machines_missing", "pause",
           "pause_when_blocked", "require_fuse", "require_machines"]
