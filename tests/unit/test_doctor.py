"""The doctor's verdicts, from what hosts answered (no hosts needed)."""
import json
import os
import shutil
import socket
import subprocess
import sys

import pytest

from hvdtrain.launch import doctor
from hvdtrain.launch.hostfile import Host

VERSIONS = {"python": "3.11.7", "torch": "2.13.0", "horovod": "0.28.1", "mpi4py": "4.1.2", "hvdtrain": "0.1.0"}


def identity(boot, pid_namespace="pid:[4026531836]", machine_id=None):
    return {"boot_id": boot, "pid_namespace": pid_namespace, "net_namespace": "net:[4026531840]",
            "machine_id": machine_id or f"machine-of-{boot}"}


def facts(host, **overrides):
    found = {"hostname": host, "identity": identity(f"{host}-boot-0000-0000"), "executable": "/venv/bin/python",
             "versions": dict(VERSIONS), "cpus": 8, "gpus": 0, "interfaces": ["eth0", "lo"],
             "checkpoint": {"checked": True, "writable": True, "path": "/shared/ckpt"}}
    found.update(overrides)
    return found


def statuses(rows):
    return [(row.check, row.host, row.status) for row in rows]


def test_unreachable_hosts_fail_with_the_reason_and_a_hint():
    rows = doctor.ssh_rows({"hostA": (facts("hostA"), ""), "hostB": (None, "ssh failed: Connection refused")})
    assert statuses(rows) == [("reach", "hostA", "ok"), ("reach", "hostB", "FAIL")]
    assert "Connection refused" in rows[1].detail and "ssh hostB true" in rows[1].detail


def test_a_host_with_other_versions_or_a_missing_package_fails():
    odd = facts("hostB", versions={**VERSIONS, "torch": "2.1.0"})
    bare = facts("hostC", versions={**VERSIONS, "horovod": None})
    rows = doctor.version_rows({"hostA": facts("hostA"), "hostB": odd, "hostC": bare})
    assert statuses(rows) == [("versions", "hostA", "ok"), ("versions", "hostB", "FAIL"),
                              ("versions", "hostC", "FAIL")]
    assert rows[1].detail == "differs: torch 2.1.0 (vs 2.13.0 on hostA)"
    assert rows[2].detail == "not installed: horovod (for /venv/bin/python)"


def test_network_needs_one_interface_name_on_every_host_besides_loopback():
    same = {"a": facts("a", interfaces=["eth0", "ib0", "lo"]), "b": facts("b", interfaces=["ib0", "lo"])}
    assert doctor.interface_rows(same, None)[0].detail == "common interfaces: ib0"
    different = {"a": facts("a", interfaces=["eth0", "lo"]), "b": facts("b", interfaces=["ens3", "lo"])}
    row = doctor.interface_rows(different, None)[0]
    assert row.status == "FAIL" and "a: eth0,lo; b: ens3,lo" in row.detail
    row = doctor.interface_rows(same, "eth0")[0]
    assert row.status == "FAIL" and row.detail == "--network-interface eth0 is missing on b"


@pytest.mark.parametrize("slots,cpus,gpus,status", [
    (4, 8, 0, "ok"), (16, 8, 0, "WARN"), (4, 32, 4, "ok"), (8, 32, 4, "FAIL"), (2, 32, 4, "WARN"),
])
def test_slots_against_cores_and_gpus(slots, cpus, gpus, status):
    rows = doctor.slot_rows([Host("n", slots)], {"n": facts("n", cpus=cpus, gpus=gpus)})
    assert rows[0].status == status
    assert rows[0].detail.startswith(f"{slots} slots, {cpus} cores, " + (f"{gpus} GPUs" if gpus else "no GPU visible"))


def test_a_checkpoint_directory_that_is_not_shared_or_not_writable_fails():
    hosts = {"a": facts("a"), "b": facts("b"),
             "c": facts("c", checkpoint={"checked": True, "writable": False, "error": "Permission denied: /x"})}
    rows = doctor.checkpoint_rows(hosts, {"a": ["a", "b"], "b": ["b"]}, "/shared/ckpt")
    assert statuses(rows) == [("checkpoint dir", "a", "ok"), ("checkpoint dir", "b", "FAIL"),
                              ("checkpoint dir", "c", "FAIL")]
    assert "does not hold the files written on a" in rows[1].detail
    assert rows[2].detail == "not writable: Permission denied: /x"


def test_inside_slurm_scontrol_is_checked_and_outside_nothing_is_said():
    assert doctor.scheduler_rows({}) == []
    assert doctor.scheduler_rows({"SLURM_JOB_ID": "12"})[0].check == "slurm"


def test_the_table_aligns_columns():
    table = doctor.render([doctor.Row("reach", "hostA", "ok", "fine"), doctor.Row("allreduce", "2 ranks", "FAIL", "x")])
    lines = table.splitlines()
    assert lines[0].split() == ["CHECK", "HOST", "STATUS", "DETAIL"]
    column = lines[0].index("STATUS")
    assert [line[column:].split()[0] for line in lines[1:]] == ["ok", "FAIL"]


def test_the_host_facts_script_runs_alone_with_the_standard_library(tmp_path):
    """It is sent to hosts as a script: it must run without hvdtrain, torch or Horovod."""
    args = json.dumps({"checkpoint_dir": str(tmp_path), "token": "t1"})
    done = subprocess.run([sys.executable, "-I", "-", "facts", args], input=doctor.FACTS_SCRIPT,
                          capture_output=True, text=True, timeout=60)
    found = json.loads(done.stdout)
    assert found["checkpoint"]["writable"] and found["cpus"] >= 1 and "lo" in found["interfaces"]
    done = subprocess.run([sys.executable, "-I", "-", "tokens", args], input=doctor.FACTS_SCRIPT,
                          capture_output=True, text=True, timeout=60)
    assert json.loads(done.stdout)["seen"] == [found["hostname"]]
    done = subprocess.run([sys.executable, "-I", "-", "cleanup", args], input=doctor.FACTS_SCRIPT,
                          capture_output=True, text=True, timeout=60)
    assert json.loads(done.stdout) == {"removed": True}
    assert list(tmp_path.iterdir()) == []


def test_the_host_facts_count_the_gpus_nvidia_smi_lists_and_none_without_it(tmp_path):
    """GPUs per host for the slots row: nvidia-smi -L's GPU lines (not its MIG lines); without
    nvidia-smi and without the driver's /proc entries (this machine), none."""
    args = json.dumps({"checkpoint_dir": None, "token": "t2"})
    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/bin/sh\n[ \"$1\" = -L ] || exit 9\necho 'GPU 0: NVIDIA H100 (UUID: GPU-1)'\n"
                    "echo '  MIG 3g.40gb Device 0: (UUID: MIG-1)'\necho 'GPU 1: NVIDIA H100 (UUID: GPU-2)'\n")
    fake.chmod(0o755)
    counts = {}
    for name, path in (("with", f"{tmp_path}:/usr/bin:/bin"), ("without", "/usr/bin:/bin")):
        done = subprocess.run([sys.executable, "-I", "-", "facts", args], input=doctor.FACTS_SCRIPT,
                              capture_output=True, text=True, timeout=60, env={"PATH": path})
        counts[name] = json.loads(done.stdout)["gpus"]
    assert counts["with"] == 2
    assert counts["without"] == (len(os.listdir("/proc/driver/nvidia/gpus"))
                                 if os.path.isdir("/proc/driver/nvidia/gpus") else 0)


def holding(host, flock="held", **more):
    return {"host": host, "flock": flock, "tried": True, **more}, ""


def trying(host, flock, exclusive=True, **more):
    return {"host": host, "holder": "held", "flock": flock, "exclusive": exclusive, **more}, ""


def test_the_checkpoint_lock_row_names_the_flock_the_directory_gives_across_two_hosts():
    coherent = doctor.lock_rows(holding("hostA"), trying("hostB", "refused"))
    node_local = doctor.lock_rows(holding("hostA"), trying("hostB", "granted"))
    none = doctor.lock_rows(holding("hostA", "none", error="Function not implemented"), trying("hostB", None))
    assert statuses(coherent + node_local + none) == [("checkpoint lock", "hostA + hostB", "ok"),
                                                      ("checkpoint lock", "hostA + hostB", "WARN"),
                                                      ("checkpoint lock", "hostA + hostB", "ok")]
    assert coherent[0].detail.startswith("coherent flock: hostB was refused the lock hostA held")
    assert node_local[0].detail.startswith("node-local flock: hostB got the lock hostA held")
    assert none[0].detail.startswith("no flock (Function not implemented)")
    assert all(doctor.LEASE in row.detail for row in coherent + node_local + none)


def test_the_checkpoint_lock_fails_where_o_excl_is_not_exclusive_or_the_probe_failed():
    row, = doctor.lock_rows(holding("hostA"), trying("hostB", "refused", exclusive=False))
    assert row.status == "FAIL" and "hostB created the file hostA had created with O_EXCL" in row.detail
    row, = doctor.lock_rows(holding("hostA"), (None, "no answer in 30 s"))
    assert row.status == "FAIL" and row.detail == "the lock probe did not run: no answer in 30 s"
    row, = doctor.lock_rows(holding("hostA", "error", error="Permission denied: /x"), trying("hostB", None))
    assert (row.host, row.status, row.detail) == ("hostA", "FAIL", "the lock probe failed: Permission denied: /x")


def test_the_host_facts_lock_probe_between_two_processes_of_this_host(tmp_path):
    """The script's two sides, run at once as the doctor runs them: this host's flock is the
    kernel's, so the second process is refused; O_EXCL is exclusive; nothing is left behind."""
    args = json.dumps({"checkpoint_dir": str(tmp_path), "token": "t3"})
    script = tmp_path.parent / "host_facts.py"
    script.write_text(doctor.FACTS_SCRIPT)
    sides = [subprocess.Popen([sys.executable, "-I", str(script), action, args], stdout=subprocess.PIPE, text=True)
             for action in ("lock_hold", "lock_try")]
    answers = [json.loads(side.communicate(timeout=60)[0]) for side in sides]
    assert answers[0]["flock"] == "held" and answers[0]["tried"]
    assert answers[1]["flock"] == "refused" and answers[1]["exclusive"]
    row, = doctor.lock_rows((answers[0], ""), (answers[1], ""))
    assert row.status == "ok" and row.detail.startswith("flock works between processes of ")
    assert list(tmp_path.iterdir()) == []


def test_a_lock_marker_appears_under_its_name_only_with_its_text(tmp_path, monkeypatch):
    """The other side reads a marker as soon as a listing shows its name: a marker created empty
    and written after was once read as '' (CI: the doctor crashed on a probe answer with no flock)."""
    from hvdtrain.launch import host_facts

    args = {"checkpoint_dir": str(tmp_path), "token": "t4"}
    name = os.path.basename(host_facts._probe_path(args, "held"))
    listed_while_writing = []
    real_fsync = os.fsync
    monkeypatch.setattr(host_facts.os, "fsync",
                        lambda fd: (listed_while_writing.append(os.listdir(tmp_path)), real_fsync(fd)))
    host_facts._mark(args, "held", "held")
    assert listed_while_writing and all(name not in listing for listing in listed_while_writing)
    assert os.listdir(tmp_path) == [name] and (tmp_path / name).read_text() == "held"


def test_a_probe_answer_without_a_flock_verdict_fails_the_row_instead_of_crashing():
    row, = doctor.lock_rows(holding("hostA"), ({"host": "hostB", "holder": "", "exclusive": True}, ""))
    assert (row.host, row.status) == ("hostB", "FAIL") and "read hostA's marker as ''" in row.detail


# ---- one machine per host name -------------------------------------------------------------

def test_hosts_with_names_of_their_own_pass():
    rows = doctor.host_name_rows({"node1": facts("node1"), "node2": facts("node2")})
    assert statuses(rows) == [("host names", "all hosts", "ok")]
    assert rows[0].detail == "2 hosts, each answering with a name of its own"
    assert doctor.host_name_rows({"node1": facts("node1")}) == []  # one host: nothing to compare


def test_two_machines_answering_with_one_name_fail_naming_both_boot_ids():
    """Containers with a fixed --hostname on two machines: only their boot ids tell them apart."""
    rows = doctor.host_name_rows({
        "10.0.0.1": facts("node1", identity=identity("ab12cd34-1111-2222-3333-444455556666")),
        "10.0.0.2": facts("node1", identity=identity("cd34ef56-7777-8888-9999-000011112222")),
        "node3": facts("node3")})
    assert statuses(rows) == [("host names", "10.0.0.1 + 10.0.0.2", "FAIL")]
    assert rows[0].detail == (
        "two machines (boot ids ab12cd34…, cd34ef56…) answer as node1: hvdtrain's checkpoint lease, mpirun's "
        "hostfiles and every per-host message tell hosts apart by name. HINT: give each machine its own "
        "hostname (containers: --hostname; images: not localhost)")


def test_a_cloned_image_is_named_and_containers_of_one_kernel_fail_too():
    cloned = doctor.host_name_rows({
        "a": facts("localhost", identity=identity("ab12cd34-1", machine_id="same-image")),
        "b": facts("localhost", identity=identity("cd34ef56-2", machine_id="same-image"))})
    assert cloned[0].status == "FAIL"
    assert cloned[0].detail.startswith("two machines (boot ids ab12cd34…, cd34ef56… and one /etc/machine-id: "
                                       "a cloned image) answer as localhost")
    containers = doctor.host_name_rows({
        "c1": facts("worker", identity=identity("ab12cd34-1", pid_namespace="pid:[4026532201]")),
        "c2": facts("worker", identity=identity("ab12cd34-1", pid_namespace="pid:[4026532305]"))})
    assert containers[0].status == "FAIL"
    assert containers[0].detail.startswith("two containers of one machine (boot id ab12cd34…) answer as worker")


def test_one_machine_listed_under_two_names_warns_that_its_ranks_add_up():
    """Same name, same boot id and namespaces: one machine (two aliases), nothing ambiguous, so
    no FAIL; but both entries' ranks start on it."""
    same = identity("ab12cd34-1111")
    rows = doctor.host_name_rows({"node1": facts("node1", identity=same),
                                  "node1.cluster": facts("node1", identity=same)})
    assert statuses(rows) == [("host names", "node1 + node1.cluster", "WARN")]
    assert rows[0].detail.startswith("node1, node1.cluster are one machine (boot id ab12cd34…), listed 2 times")


def test_without_a_boot_id_one_name_warns_that_it_cannot_tell():
    blind = identity(None)
    rows = doctor.host_name_rows({"a": facts("node1", identity=blind), "b": facts("node1", identity=blind)})
    assert statuses(rows) == [("host names", "a + b", "WARN")]
    assert "cannot be told (no kernel boot id readable)" in rows[0].detail


# ---- each host's clock against the checkpoint directory's file times ------------------------

def measured(offset, uncertainty=0.001, filesystem="nfs4", whole_seconds=False):
    return {"checked": True, "writable": True, "path": "/shared/ckpt", "filesystem": filesystem,
            "clock": {"offset": offset, "uncertainty": uncertainty, "whole_seconds": whole_seconds}}


def test_a_clock_within_the_tolerance_passes_and_one_beyond_it_warns_what_it_affects():
    rows = doctor.clock_rows({"a": facts("a", checkpoint=measured(0.031)),
                              "b": facts("b", checkpoint=measured(-1.84))})
    assert statuses(rows) == [("clock vs checkpoint dir", "a", "ok"), ("clock vs checkpoint dir", "b", "WARN")]
    assert rows[0].detail == "+0.031 s ±0.001 s against the file server's clock (nfs4)"
    assert rows[1].detail.startswith("-1.840 s ±0.001 s against the file server's clock (nfs4): more than "
                                     f"{doctor.CLOCK_TOLERANCE} s")
    assert "flight recorder's cross-host timelines" in rows[1].detail and "log times" in rows[1].detail
    assert "the checkpoint lease does not depend on it" in rows[1].detail


def test_a_clock_warns_only_when_beyond_the_tolerance_by_more_than_the_round_trip_explains():
    slow = doctor.clock_rows({"a": facts("a", checkpoint=measured(0.6, uncertainty=0.5))})
    assert slow[0].status == "ok" and "too slow a round trip to tell within 0.25 s" in slow[0].detail
    coarse = doctor.clock_rows({"a": facts("a", checkpoint=measured(0.7, uncertainty=0.5, whole_seconds=True))})
    assert coarse[0].status == "ok" and "(whole-second file times)" in coarse[0].detail
    off = doctor.clock_rows({"a": facts("a", checkpoint=measured(0.3, uncertainty=0.01))})
    assert off[0].status == "WARN"


def test_every_host_off_alike_points_at_the_file_server():
    rows = doctor.clock_rows({"a": facts("a", checkpoint=measured(4.1)), "b": facts("b", checkpoint=measured(4.2))})
    assert [row.status for row in rows] == ["WARN", "WARN"]
    assert all("as on every host: the file server's clock is likely the one off" in row.detail for row in rows)


def test_where_hosts_set_file_times_the_row_says_the_offset_is_zero_by_construction():
    lustre, local, other = doctor.clock_rows({"a": facts("a", checkpoint=measured(0.0, filesystem="lustre")),
                                              "b": facts("b", checkpoint=measured(0.0, filesystem="ext4")),
                                              "c": facts("c", checkpoint=measured(0.0, filesystem="beegfs"))})
    assert lustre.status == local.status == other.status == "ok"
    assert lustre.detail.startswith("+0.000 s ±0.001 s: ~0 by construction, lustre takes file times from each "
                                    "host's own clock")
    assert "ext4 is local" in local.detail
    assert other.detail == "+0.000 s ±0.001 s (beegfs)"


def test_a_clock_probe_that_failed_warns_and_an_unwritable_directory_gives_no_clock_row():
    failed = {"checked": True, "writable": True, "path": "/x", "clock": {"error": "Permission denied: /x"}}
    unwritable = {"checked": True, "writable": False, "error": "Permission denied: /x"}
    rows = doctor.clock_rows({"a": facts("a", checkpoint=failed), "b": facts("b", checkpoint=unwritable)})
    assert [(row.host, row.status, row.detail) for row in rows] == [("a", "WARN", "not measured: Permission denied: /x")]


def test_the_offset_is_the_midpoint_of_the_round_trip_minus_the_file_time():
    from hvdtrain.launch.host_facts import offset_from

    offset, uncertainty = offset_from(100.0, 100.2, 99 * 10**9, whole_seconds=False)
    assert (round(offset, 9), round(uncertainty, 9)) == (1.1, 0.1)
    # A file system keeping whole seconds truncated the time by up to 1 s.
    offset, uncertainty = offset_from(100.0, 100.2, 99 * 10**9, whole_seconds=True)
    assert (round(offset, 9), round(uncertainty, 9)) == (0.6, 0.6)


def test_the_file_system_type_is_the_innermost_mount_holding_the_directory(tmp_path):
    from hvdtrain.launch.host_facts import filesystem_type

    mountinfo = tmp_path / "mountinfo"
    mountinfo.write_text(
        "22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw\n"
        "40 22 0:40 / /shared rw,relatime shared:20 - nfs4 server:/export rw,vers=4.2\n"
        "41 40 0:41 / /shared/my\\040ckpt rw - lustre 10.0.0.1@tcp:/fs rw\n"
        "42 22 0:42 / /sharedx rw - tmpfs tmpfs rw\n")
    assert filesystem_type("/shared/ckpt/run1", str(mountinfo)) == "nfs4"
    assert filesystem_type("/shared/my ckpt/run1", str(mountinfo)) == "lustre"
    assert filesystem_type("/sharedx/a", str(mountinfo)) == "tmpfs"
    assert filesystem_type("/home/me", str(mountinfo)) == "ext4"
    assert filesystem_type("/home/me", str(tmp_path / "absent")) is None


def test_the_host_facts_measure_this_hosts_clock_and_name_this_machine(tmp_path):
    """The probe for real, as the doctor sends it: a directory on this machine takes its file times
    from this clock, so the offset is small and the row passes; nothing is left behind."""
    args = json.dumps({"checkpoint_dir": str(tmp_path), "token": "t5"})
    done = subprocess.run([sys.executable, "-I", "-", "facts", args], input=doctor.FACTS_SCRIPT,
                          capture_output=True, text=True, timeout=60)
    found = json.loads(done.stdout)
    clock = found["checkpoint"]["clock"]
    assert abs(clock["offset"]) < 0.05 and 0 <= clock["uncertainty"] < 0.05 and not clock["whole_seconds"]
    row, = doctor.clock_rows({"here": found})
    assert row.status == "ok" and row.detail.startswith(f"{clock['offset']:+.3f} s ±")
    with open("/proc/sys/kernel/random/boot_id") as boot:
        assert found["identity"]["boot_id"] == boot.read().strip()
    assert found["identity"]["pid_namespace"] == os.readlink("/proc/self/ns/pid")
    assert [path.name for path in tmp_path.iterdir()] == [f".hvdtrain-doctor-t5-{found['hostname']}"]


@pytest.mark.skipif(os.geteuid() != 0 or not (shutil.which("unshare") and shutil.which("hostname")),
                    reason="UTS and network namespaces need root")
def test_a_namespace_that_takes_this_hosts_name_is_told_apart_and_fails(tmp_path):
    """Two 'hosts' answering with one name, for real: this host, and a UTS + network namespace of
    it (as a container with --hostname) set to this host's name. One kernel: told apart by their
    namespaces only."""
    name = socket.gethostname()
    script = tmp_path / "host_facts.py"
    script.write_text(doctor.FACTS_SCRIPT)
    args = json.dumps({"checkpoint_dir": None, "token": "t6"})
    here = [sys.executable, "-I", str(script), "facts", args]
    inside = ["unshare", "--uts", "--net", "--", "sh", "-c", 'hostname "$0" && exec "$@"', name, *here]
    answers = {entry: json.loads(subprocess.run(argv, capture_output=True, text=True, timeout=60,
                                                check=True).stdout)
               for entry, argv in (("here", here), ("container", inside))}
    assert answers["here"]["hostname"] == answers["container"]["hostname"] == name
    row, = doctor.host_name_rows(answers)
    assert (row.host, row.status) == ("here + container", "FAIL")
    assert row.detail.startswith(f"two containers of one machine (boot id "
                                 f"{answers['here']['identity']['boot_id'][:8]}…) answer as {name}: ")
