"""Each rank counts the USR2 it gets, until 2 s after the first; then writes the count to
DIRECTORY/usr2.<rank> and exits.

    hvdtrain launch -np 2 -- python tests/launch/signal_count_job.py DIRECTORY

It writes DIRECTORY/ready.<rank> once its handlers are set. No Horovod: only the launcher's
delivery is under test.
"""
import os
import signal
import sys
import time
from pathlib import Path

directory = Path(sys.argv[1])
rank = os.environ.get("OMPI_COMM_WORLD_RANK") or os.environ.get("HOROVOD_RANK") or "0"
counted = []
signal.signal(signal.SIGUSR2, lambda signum, frame: counted.append(time.monotonic()))
(directory / f"ready.{rank}").touch()
deadline = time.monotonic() + 120
while time.monotonic() < (counted[0] + 2 if counted else deadline):
    time.sleep(0.05)
(directory / f"usr2.{rank}").write_text(str(len(counted)))
sys.exit(0 if counted else 1)
