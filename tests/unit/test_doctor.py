"""The doctor's verdicts, from what hosts answered (no hosts needed)."""
import json
import os
import subprocess
import sys

import pytest

from hvdtrain.launch import doctor
from hvdtrain.launch.hostfile import Host

VERSIONS = {"python": "3.11.7", "torch": "2.13.0", "horovod": "0.28.1", "mpi4py": "4.1.2", "hvdtrain": "0.1.0"}


def facts(host, **overrides):
    found = {"hostname": host, "executable": "/venv/bin/python", "versions": dict(VERSIONS), "cpus": 8,
             "gpus": 0, "interfaces": ["eth0", "lo"],
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
