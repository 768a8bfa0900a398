"""The fault-injection harness (tests/faults) does what the tests of a bad day rely on: a stopped
call really waits, in the kernel, for Python, C++ and page faults alike, and goes on when released;
a rule spares what it does not name; a killed client dies at once and nothing stays mounted; a
paused owner stops right after its call; another machine has its own name, boot id and pids.

Every file call on a hung mount is made by a client process, never by the test process: a test
that waited on its own mount could not release it. Each part skips, saying why, where this machine
cannot do it (not root, no /dev/fuse, unshare refused).
"""
import errno
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from tests.faults import HungMount, machine_command, pause_when_blocked
from tests.faults.gate import Gate, caller_is_dying
from tests.faults.hung_mount import is_mounted
from tests.faults.processes import descendants, thread_states
from tests.faults.rules import FaultRule

pytestmark = pytest.mark.timeout(60)
CLIENT_TIMEOUT = 30.0  # for a client's next line or its end
STILL_WAITING = 1.0  # how long a stopped call is watched not to finish
DIES_WITHIN = 5.0  # a killed client waiting on the mount must be gone within this


class Client:
    """A Python process running ``code`` (arguments in sys.argv[1:]); its output read line by line."""

    def __init__(self, code: str, *args: str):
        self.process = subprocess.Popen([sys.executable, "-c", code, *map(str, args)], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self._lines: "queue.Queue[str]" = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.process.stdout:
            self._lines.put(line.rstrip("\n"))

    def line(self, timeout: float = CLIENT_TIMEOUT) -> str:
        try:
            return self._lines.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"no line from the client in {timeout} s (exit {self.process.poll()})") from None

    def said_nothing_for(self, seconds: float) -> bool:
        try:
            self._lines.get(timeout=seconds)
            return False
        except queue.Empty:
            return self.process.poll() is None

    def send(self, text: str = "go") -> None:
        self.process.stdin.write(text + "\n")
        self.process.stdin.flush()

    def finish(self, timeout: float = CLIENT_TIMEOUT) -> None:
        """Waits for the client's end; fails unless it exited 0."""
        returncode = self.process.wait(timeout)
        assert returncode == 0, f"client exited {returncode}:\n{self.process.stderr.read()[-3000:]}"


@pytest.fixture
def client():
    """Starts clients; those still running when the test ends are killed, whatever happened."""
    started = []

    def start(code: str, *args) -> Client:
        started.append(Client(code, *args))
        return started[-1]

    yield start
    for each in started:
        if each.process.poll() is None:
            each.process.kill()
        each.process.wait(10)


def test_a_rule_names_operations_and_paths():
    rule = FaultRule.make(ops={"utime", "open"}, names="owner.json")
    assert rule.ops == ("open", "utimens")
    assert rule.matches("utimens", ("/ckpt/owner.json",))
    assert not rule.matches("utimens", ("/ckpt/other.json",))
    assert not rule.matches("write", ("/ckpt/owner.json",))
    assert FaultRule.make(names="*.pt").matches("rename", ("/a/x.tmp", "/a/step-3.pt")), "either path of a rename"
    assert FaultRule.make(names="/ckpt/*/*.pt").matches("read", ("/ckpt/step-3/model.pt",)), "a whole path"
    assert not FaultRule.make(names="/ckpt/*.pt").matches("read", ("/other/ckpt/x.pt",))
    assert set(FaultRule.make(ops="setattr").ops) == {"chmod", "chown", "truncate", "utimens"}
    assert FaultRule.from_message(json.loads(json.dumps(rule.to_message()))) == rule
    with pytest.raises(ValueError, match="unknown file operation 'utimes'"):
        FaultRule.make(ops="utimes")


def test_the_gate_passes_stops_fails_and_gives_up_on_a_dying_caller():
    gate, me = Gate(), threading.get_native_id()
    gate.set_rule(FaultRule.make(ops="write", names="*.pt", after=1))
    gate.enter("write", ("/a.pt",), me)  # the first goes through
    gate.enter("read", ("/a.pt",), me)  # not under the rule
    stopped = threading.Thread(target=gate.enter, args=("write", ("/b.pt",), me))
    stopped.start()
    _wait_for(gate.waiting)
    assert [call["path"] for call in gate.waiting()] == ["/b.pt"]
    gate.release()
    stopped.join(DIES_WITHIN)
    assert not stopped.is_alive() and gate.waiting() == []

    gate.set_rule(FaultRule.make(error=errno.EIO))
    with pytest.raises(OSError) as failed:
        gate.enter("getattr", ("/c",), me)
    assert failed.value.errno == errno.EIO
    assert [call["op"] for call in gate.seen()] == ["write", "read", "write", "getattr"]

    # A caller killed while its call waits: the call gives up (EINTR), so that the caller can die.
    gate.set_rule(FaultRule.make())
    caller, errors = subprocess.Popen(["sleep", "60"]), []
    try:
        given_up = threading.Thread(target=lambda: errors.append(_raised(gate.enter, "open", ("/d",), caller.pid)))
        given_up.start()
        _wait_for(gate.waiting)
        assert not caller_is_dying(caller.pid)
        caller.kill()  # left unreaped meanwhile: a zombie
        given_up.join(DIES_WITHIN)
    finally:
        caller.kill()
        caller.wait()
    assert errors == [errno.EINTR]


def _raised(function, *args):
    """The errno that ``function(*args)`` raised, None when it returned."""
    try:
        function(*args)
    except OSError as error:
        return error.errno
    return None


def _wait_for(condition, timeout: float = CLIENT_TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"not so within {timeout} s"
        time.sleep(0.01)


def test_a_stopped_write_waits_until_released(tmp_path, client):
    data = os.urandom(200_000)
    (tmp_path / "payload").write_bytes(data)
    with HungMount(tmp_path / "backing") as mount:
        mount.hang(ops={"write"})
        writer = client("import shutil, sys; shutil.copyfile(sys.argv[1], sys.argv[2]); print('written')",
                        tmp_path / "payload", mount.path / "data.bin")
        (stopped,) = mount.wait_blocked()
        assert (stopped.op, stopped.path, stopped.pid) == ("write", "/data.bin", writer.process.pid)
        assert writer.said_nothing_for(STILL_WAITING)
        with open(f"/proc/{stopped.tid}/wchan") as wchan:
            assert wchan.read() == "request_wait_answer", "the write waits in the kernel, for FUSE's answer"
        assert (tmp_path / "backing" / "data.bin").read_bytes() == b"", "nothing written while stopped"

        mount.release()
        assert writer.line() == "written"
        writer.finish()
        assert (tmp_path / "backing" / "data.bin").read_bytes() == data
        seen = {(call.op, call.path) for call in mount.calls()}
        assert {("create", "/data.bin"), ("write", "/data.bin"), ("flush", "/data.bin")} <= seen
    assert not is_mounted(mount.path)


TORCH_CLIENT = """
import sys, torch
path = sys.argv[1]
torch.save({"w": torch.arange(1 << 20, dtype=torch.float32)}, path)  # 4 MiB, written by torch's C++
print("saved", flush=True)
sys.stdin.readline()
state = torch.load(path, mmap=True, weights_only=True)
print("loaded", flush=True)
sys.stdin.readline()
print(float(state["w"][1 << 19]), flush=True)  # a page fault in the middle of the mapped file
"""


@pytest.mark.timeout(120)  # importing torch takes 3 s here, 30 s on a machine busy with other tests
def test_torch_file_io_and_page_faults_of_a_mapped_checkpoint_wait(tmp_path, client):
    with HungMount(tmp_path / "backing") as mount:
        mount.hang(ops="write", names="*.pt")
        torch_client = client(TORCH_CLIENT, mount.path / "model.pt")
        assert [(call.op, call.path) for call in mount.wait_blocked(timeout=90)] == [("write", "/model.pt")]
        assert torch_client.said_nothing_for(STILL_WAITING)
        mount.release()
        assert torch_client.line() == "saved"
        assert (tmp_path / "backing" / "model.pt").stat().st_size > 4 << 20

        torch_client.send()
        assert torch_client.line() == "loaded"
        mount.hang(ops="read", names="*.pt")  # the file is mapped; its pages are read on first touch
        torch_client.send()
        assert [(call.op, call.path) for call in mount.wait_blocked()] == [("read", "/model.pt")]
        assert torch_client.said_nothing_for(STILL_WAITING)
        mount.release()
        assert torch_client.line() == str(float(1 << 19))
        torch_client.finish()


def test_metadata_calls_wait(tmp_path, client):
    # Three directories: a stopped mkdir or rename holds its directory's lock in the kernel, and
    # another change in that directory would wait on the lock, never reaching the mount.
    backing = tmp_path / "backing"
    for directory in ("lease", "new", "moved"):
        (backing / directory).mkdir(parents=True)
    (backing / "lease" / "owner.json").write_text("{}")
    os.utime(backing / "lease" / "owner.json", (1_000_000, 1_000_000))
    (backing / "moved" / "step-1.tmp").write_text("weights")
    with HungMount(backing) as mount:
        mount.hang(ops={"utime", "mkdir", "rename"})
        clients = [client("import os, sys; os.utime(sys.argv[1])", mount.path / "lease" / "owner.json"),
                   client("import os, sys; os.mkdir(sys.argv[1])", mount.path / "new" / "step-2"),
                   client("import os, sys; os.rename(sys.argv[1], sys.argv[2])",
                          mount.path / "moved" / "step-1.tmp", mount.path / "moved" / "step-1")]
        stopped = mount.wait_blocked(count=3)
        assert sorted((call.op, call.path, call.target) for call in stopped) == [
            ("mkdir", "/new/step-2", None), ("rename", "/moved/step-1.tmp", "/moved/step-1"),
            ("utimens", "/lease/owner.json", None)]
        assert all(each.said_nothing_for(STILL_WAITING / 3) for each in clients)
        assert (backing / "lease" / "owner.json").stat().st_mtime == 1_000_000
        assert os.listdir(backing / "new") == [] and os.listdir(backing / "moved") == ["step-1.tmp"]

        mount.release()
        for each in clients:
            each.finish()
        assert (backing / "lease" / "owner.json").stat().st_mtime > time.time() - 60
        assert os.listdir(backing / "new") == ["step-2"] and os.listdir(backing / "moved") == ["step-1"]


def test_a_name_glob_spares_other_files(tmp_path, client):
    (tmp_path / "backing").mkdir()
    (tmp_path / "backing" / "owner.json").write_text("old")
    with HungMount(tmp_path / "backing") as mount:
        # The calls on the file itself: a stopped lookup or create of the name would hold the
        # directory's lock, and the other file's create would wait on it in the kernel.
        mount.hang(ops={"open", "write", "utime"}, names="owner.json")
        owner = client("import sys; open(sys.argv[1], 'w').write('{}')", mount.path / "owner.json")
        (stopped,) = mount.wait_blocked()
        assert (stopped.op, stopped.path) == ("open", "/owner.json")
        other = client("import os, sys; open(sys.argv[1], 'w').write('kept'); print(sorted(os.listdir(sys.argv[2])))",
                       mount.path / "other.json", mount.path)
        assert other.line() == "['other.json', 'owner.json']"
        other.finish()
        assert (tmp_path / "backing" / "other.json").read_text() == "kept"
        assert owner.process.poll() is None
        mount.release()
        owner.finish()
        assert (tmp_path / "backing" / "owner.json").read_text() == "{}"


def test_fail_and_after_let_the_first_calls_through(tmp_path, client):
    with HungMount(tmp_path / "backing") as mount:
        mount.fail(errno.ENOSPC, ops="write", names="owner.json", after=1)
        writes = client("""
import os, sys
fd = os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT)
os.write(fd, b"first")
try:
    os.write(fd, b"second")
except OSError as error:
    print(error.errno)
""", mount.path / "owner.json")
        assert writes.line() == str(errno.ENOSPC)
        writes.finish()
        assert (tmp_path / "backing" / "owner.json").read_bytes() == b"first"


def test_a_killed_client_dies_at_once_and_nothing_stays_mounted(tmp_path, client):
    with HungMount(tmp_path / "backing") as mount:
        mount.hang(ops={"write", "flush"})
        killed = client("import sys; open(sys.argv[1], 'wb').write(b'x' * 1000)", mount.path / "a.bin")
        mount.wait_blocked()
        started = time.monotonic()
        killed.process.send_signal(signal.SIGKILL)
        assert killed.process.wait(DIES_WITHIN) == -signal.SIGKILL
        assert time.monotonic() - started < DIES_WITHIN

        # A process ending (os._exit) while another of its threads waits on the mount: the exit
        # kills that thread, which must not keep the process from ending.
        exiting = client("""
import os, sys, threading
threading.Thread(target=lambda: open(sys.argv[1], 'wb').write(b'y' * 10), daemon=True).start()
sys.stdin.readline()
os._exit(3)
""", mount.path / "b.bin")
        (stopped,) = [call for call in mount.wait_blocked() if call.path == "/b.bin"]
        assert stopped.tid != stopped.pid, "stopped in the second thread"
        exiting.send()
        assert exiting.process.wait(DIES_WITHIN) == 3
        assert mount.blocked() == []
    assert not is_mounted(mount.path)


def test_leaving_releases_and_unmounts_when_the_test_fails(tmp_path, client):
    with pytest.raises(RuntimeError, match="the test failed here"):
        with HungMount(tmp_path / "backing") as mount:
            mount.hang()  # every call, the mount's root too
            lister = client("import os, sys; print(os.listdir(sys.argv[1]))", mount.path)
            mount.wait_blocked()
            raise RuntimeError("the test failed here")
    assert not is_mounted(mount.path)
    lister.process.wait(CLIENT_TIMEOUT)  # released (or cut off with ENOTCONN): it ends either way


def test_a_paused_owner_stops_right_after_its_lease_check(tmp_path, client):
    backing, published = tmp_path / "backing", tmp_path / "published"
    backing.mkdir()
    (backing / "owner.json").write_text("{}")
    os.utime(backing / "owner.json", (1_000_000, 1_000_000))
    with HungMount(backing) as mount:
        mount.hang(ops="utime", names="owner.json")
        owner = client("import os, sys; os.utime(sys.argv[1]); open(sys.argv[2], 'w').write('step 3')",
                       mount.path / "owner.json", published)
        with pause_when_blocked(mount, owner.process) as paused:
            assert (paused.pid, paused.call.op) == (owner.process.pid, "utimens")
            assert set(thread_states(paused.pid).values()) <= {"T"}
            assert (backing / "owner.json").stat().st_mtime > time.time() - 60, "its lease check went through"
            assert mount.blocked() == []
            time.sleep(STILL_WAITING)
            assert not published.exists(), "nothing after the check ran while paused"
        owner.finish()
        assert published.read_text() == "step 3"


MACHINE_CLIENT = """
import json, os, socket, sys
from pathlib import Path
shared = Path(sys.argv[1])
(shared / ("from-" + sys.argv[2])).write_text(socket.gethostname())
print(json.dumps({"host": socket.gethostname(), "boot": open("/proc/sys/kernel/random/boot_id").read().strip(),
                  "pid_namespace": os.readlink("/proc/self/ns/pid"), "pid": os.getpid(),
                  "read": (shared / "from-test").read_text()}))
"""


def test_two_machines_with_one_host_name_differ_in_boot_and_pids(tmp_path):
    (tmp_path / "from-test").write_text("the test's file")
    given_boot = "0123abcd-0000-4000-8000-000000000001"
    seen = {}
    for label, boot in (("first", None), ("second", given_boot)):
        run = subprocess.run(machine_command("node1", boot_id=boot) + [sys.executable, "-c", MACHINE_CLIENT,
                                                                       str(tmp_path), label],
                             capture_output=True, text=True, timeout=CLIENT_TIMEOUT)
        assert run.returncode == 0, run.stderr
        seen[label] = json.loads(run.stdout)
    with open("/proc/sys/kernel/random/boot_id") as handle:
        here = {"host": socket.gethostname(), "boot": handle.read().strip(),
                "pid_namespace": os.readlink("/proc/self/ns/pid")}

    first, second = seen["first"], seen["second"]
    assert first["host"] == second["host"] == "node1" != here["host"]
    assert second["boot"] == given_boot
    assert len({first["boot"], second["boot"], here["boot"]}) == 3
    assert len({first["pid_namespace"], second["pid_namespace"], here["pid_namespace"]}) == 3
    assert first["pid"] < 100 and second["pid"] < 100, "pids of a namespace of its own"
    assert first["read"] == second["read"] == "the test's file"
    assert (tmp_path / "from-first").read_text() == (tmp_path / "from-second").read_text() == "node1"


def test_a_machine_ends_whole_when_killed(tmp_path):
    machine = subprocess.Popen(machine_command("node2") + [sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        deadline = time.monotonic() + CLIENT_TIMEOUT
        while not any(_command_line(pid).startswith(sys.executable) for pid in descendants(machine.pid)):
            assert time.monotonic() < deadline, "the command never started"
            time.sleep(0.02)
        inside = descendants(machine.pid)
    finally:
        machine.kill()
        machine.wait(CLIENT_TIMEOUT)
    deadline = time.monotonic() + DIES_WITHIN
    while any(os.path.exists(f"/proc/{pid}") and _command_line(pid) for pid in inside):
        assert time.monotonic() < deadline, "processes of the machine outlived it"
        time.sleep(0.02)


def _command_line(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as handle:
            return handle.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""
