"""train.py on two real hosts, launched every way users launch it across machines, and the doctor.

hostA and hostB are network + UTS namespaces with their own hostname, address and sshd
(tests/cluster/harness.py), so Open MPI, Horovod and SLURM see two machines: each test
checks that Horovod formed 4 workers as 2 hosts x 2 and that training reached 95%.

    .venv/bin/python -m pytest tests/cluster -q -p no:cacheprovider      # as root, on Linux
"""
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.cluster import harness
from tests.cluster.harness import Cluster, Result, log_tail

ROOT = Path(__file__).resolve().parents[2]
PYTHON = sys.executable
HOROVODRUN = str(Path(sys.executable).parent / "horovodrun")
REQUIRED_ACCURACY = 0.95
TRAIN_ARGS = ["train.py", "--epochs", "12", "--require-accuracy", str(REQUIRED_ACCURACY)]
LAUNCH_TIMEOUT = 300  # seconds; one 4-worker training run takes ~35-50 s on a 2-core machine
TEST_TIMEOUT = LAUNCH_TIMEOUT + 60  # pytest-timeout's backstop; the launch's own timeout fires first

# func_only: the session fixture's build (apt-get on a fresh machine) is bounded by the harness's
# own step timeouts, not counted against the first test. signal: a timeout raises in the test,
# so the fixture still tears the cluster down (the thread method would exit at once).
pytestmark = [pytest.mark.cluster,
              pytest.mark.timeout(TEST_TIMEOUT, method="signal", func_only=True)]

START_LINE = re.compile(r"\b4 workers \(2 hosts x 2\)")
FINAL_LINE = re.compile(r"final validation accuracy: ([0-9.]+) on 359 held-out digits, (\d+) workers$")
# mpirun --tag-output's prefix; Open MPI also tags a line's lone trailing newline, leaving a
# stray tag at the end of a line ("... 4 workers[1,0]<stdout>:"), so tags go wherever they are.
MPI_TAG = re.compile(r"\[\d+,\d+\]<std(?:out|err)>:")


def untagged_lines(text):
    lines = (MPI_TAG.sub("", line).rstrip() for line in text.splitlines())
    return [line for line in lines if line]


def assert_trained_on_two_hosts(output, context):
    """The Trainer's start line shows Horovod's size / cross_size / local_size as 4 (2 hosts x 2),
    and the last line of output is rank 0's final accuracy line, at 4 workers and >= 95%."""
    lines = untagged_lines(output)
    assert any(START_LINE.search(line) for line in lines), f"no '4 workers (2 hosts x 2)' start line\n{context}"
    assert lines, f"no output\n{context}"
    final = FINAL_LINE.search(lines[-1])
    assert final, f"the last line is not the final accuracy line: {lines[-1]!r}\n{context}"
    accuracy, workers = float(final.group(1)), int(final.group(2))
    assert workers == 4, f"trained on {workers} workers, not 4\n{context}"
    assert accuracy >= REQUIRED_ACCURACY, f"accuracy {accuracy} < {REQUIRED_ACCURACY}\n{context}"


def launch_from_head(cluster: Cluster, argv) -> Result:
    result = cluster.run_on(cluster.head, argv, LAUNCH_TIMEOUT, cwd=ROOT)
    context = result.describe(lines=60)
    assert not result.timed_out, f"the launch did not finish in {LAUNCH_TIMEOUT} s\n{context}"
    assert result.returncode == 0, context
    return result


def test_horovodrun_on_two_hosts(cluster):
    result = launch_from_head(cluster, [
        HOROVODRUN, "-np", "4", "-H", "hostA:2,hostB:2", "--network-interface", "eth0",
        PYTHON, *TRAIN_ARGS, f"--train.run_dir={cluster.state / 'runs-horovodrun'}"])
    assert_trained_on_two_hosts(result.stdout, result.describe(lines=60))


def test_mpirun_hostfile_on_two_hosts(cluster):
    assert cluster.hostfile.read_text() == "hostA slots=2\nhostB slots=2\n"
    result = launch_from_head(cluster, [
        "mpirun", "-np", "4", "--hostfile", str(cluster.hostfile), "--bind-to", "none",
        PYTHON, *TRAIN_ARGS, f"--train.run_dir={cluster.state / 'runs-mpirun'}"])
    assert_trained_on_two_hosts(result.stdout, result.describe(lines=60))


# The Trainer logs where every rank runs: "ranks per host: hostA: 0,1; hostB: 2,3".
PLACEMENT_LINE = re.compile(r"ranks per host: (.*)$")
# Each script, and the launcher hvdtrain must detect in its ranks (horovodrun hands over to mpirun;
# mpirun inside an allocation inherits SLURM_* but is not srun).
SBATCH_SCRIPTS = {
    "slurm/train.sbatch": "SLURM srun",
    "slurm/train-mpirun.sbatch": "Open MPI mpirun",
    "slurm/train-horovodrun.sbatch": "Open MPI mpirun",
}


def ranks_per_host(output):
    for line in untagged_lines(output):
        found = PLACEMENT_LINE.search(line)
        if found:
            return dict(part.split(": ") for part in found.group(1).split("; "))
    return None


def assert_placed_and_logged(output, script, run_dir, context):
    """Ranks 0,1 on hostA and 2,3 on hostB, started by the launcher the script uses, and one run
    directory (named after the job) with every rank's own log, stamped with its host."""
    assert ranks_per_host(output) == {"hostA": "0,1", "hostB": "2,3"}, context
    assert f"(2 hosts x 2) started by {SBATCH_SCRIPTS[script]}," in output, context
    for rank, host in enumerate(["hostA", "hostA", "hostB", "hostB"]):
        assert f" rank {rank}@{host} INFO " in (run_dir / "logs" / f"rank-{rank}.log").read_text(), context


def sbatch_language_model(cluster, name: str, options: list[str]):
    """train_lm.py through slurm/train.sbatch (SCRIPT=train_lm.py) as a 4-task job on 2 nodes,
    required to reach 4.0 bits/char, well below the unigram model's 4.67: (the sbatch result, the
    job's output, both for an assertion's message)."""
    jobs = cluster.state / name
    jobs.mkdir()
    result = cluster.run_on(cluster.head, [
        "sbatch", "--wait", "--nodes=2", "--ntasks-per-node=2", "--time=00:15:00", f"--output={jobs / 'lm-%j.out'}",
        "slurm/train.sbatch", "--config", "configs/textlm.yaml", *options,
        f"--train.run_dir={jobs / 'runs'}", "--require-bpc", "4.0"],
        LAUNCH_TIMEOUT, cwd=ROOT, env=cluster.env(VENV=sys.prefix, SCRIPT="train_lm.py"))
    output = "\n".join(path.read_text() for path in jobs.glob("lm-*.out"))
    if result.timed_out:
        cancel_jobs(cluster, result)
    return result, output, f"{result.describe()}\n{output[-4000:]}"


def cancel_jobs(cluster: Cluster, result: Result) -> None:
    """sbatch was killed, not its job: cancel that job before tear-down stops the daemons."""
    submitted = re.search(r"Submitted batch job (\d+)", result.stdout)
    if submitted:
        cluster.run_on(cluster.head, ["scancel", "--full", submitted.group(1)], 30)


DOCTOR = str(Path(sys.executable).parent / "hvdtrain")


def run_doctor(cluster: Cluster) -> Result:
    ckpt = cluster.state / "ckpt"
    return cluster.run_on(cluster.head, [
        DOCTOR, "doctor", "-H", "hostA:2,hostB:2", "--network-interface", "eth0",
        "--checkpoint-dir", str(ckpt)], LAUNCH_TIMEOUT, cwd=ROOT)


def doctor_rows(output):
    return {tuple(line.split()[:2]): line.split()[2] for line in output.splitlines()
            if line.split()[:1] and line.split()[0] in ("reach", "versions", "slots")}


def test_doctor_passes_on_the_healthy_cluster(cluster):
    result = run_doctor(cluster)
    assert result.returncode == 0, result.describe(lines=60)
    rows = doctor_rows(result.stdout)
    assert rows[("reach", "hostB")] == rows[("versions", "hostB")] == "ok", result.stdout
    assert "eth0 is up on every host" in result.stdout
    assert re.search(r"allreduce\s+4 ranks, 2 hosts\s+ok\s+16 MiB in [0-9.]+ ms, busbw", result.stdout), result.stdout
    assert "shared by 2 hosts" in result.stdout
    # The hosts share one kernel here, so flock is coherent between them.
    assert re.search(r"checkpoint lock\s+hostA \+ hostB\s+ok\s+coherent flock: hostB was refused the lock hostA held",
                     result.stdout), result.stdout
    # One kernel, so one boot id, but a name of its own each: not a duplicate. The directory's file
    # times come from that kernel's clock, so each host's offset to them is a few ms at most.
    assert re.search(r"host names\s+all hosts\s+ok\s+2 hosts, each answering with a name of its own",
                     result.stdout), result.stdout
    for host in ("hostA", "hostB"):
        assert re.search(rf"clock vs checkpoint dir\s+{host}\s+ok\s+[+-]0\.0\d\d s ±", result.stdout), result.stdout


# One claim of a checkpoint directory's run lock: 'owned PID' (then holds it until killed) or
# 'refused MESSAGE' (exit 3); the takeover's warning goes to stderr.
CLAIM = ("import logging, os, sys, time\n"
         "from hvdtrain.checkpoint import CheckpointError\n"
         "from hvdtrain.checkpoint.ownership import Ownership\n"
         "try:\n"
         "    held = Ownership.claim(sys.argv[1], logging.getLogger(), beat=float(sys.argv[2]))\n"
         "except CheckpointError as error:\n"
         "    print('refused', error, flush=True)\n"
         "    sys.exit(3)\n"
         "print('owned', os.getpid(), flush=True)\n"
         "if sys.argv[3] == 'hold':\n"
         "    time.sleep(3600)\n")
LEASE_BEAT = 5.0  # the lease expires 15 s after a taker first sees the killed owner's record


def test_a_run_lock_held_on_hostA_is_refused_on_hostB_and_taken_over_once_its_lease_expired(cluster):
    directory = cluster.state / "lease"
    directory.mkdir()
    host_a, host_b = cluster.hosts
    owner = subprocess.Popen(host_a.enter() + [PYTHON, "-c", CLAIM, str(directory), str(LEASE_BEAT), "hold"],
                             cwd=ROOT, env=cluster.env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, start_new_session=True)
    try:
        line = owner.stdout.readline().split()
        assert line[:1] == ["owned"], (line, owner.stderr.read() if owner.poll() is not None else "")
        pid = line[1]
        on_b = cluster.run_on(host_b, [PYTHON, "-c", CLAIM, str(directory), str(LEASE_BEAT), "release"], 60, cwd=ROOT)
        assert on_b.returncode == 3 and f"in use by a live run (pid {pid} on hostA" in on_b.stdout, on_b.describe()
    finally:
        os.killpg(owner.pid, signal.SIGKILL)
        owner.communicate()
    # Killed: hostB cannot see hostA's pid, so the lease decides, on hostB's own clock: taken once
    # hostB has seen no renewal for 3 beats, never sooner.
    started = time.monotonic()
    on_b = cluster.run_on(host_b, [PYTHON, "-c", CLAIM, str(directory), str(LEASE_BEAT), "release"], 60, cwd=ROOT)
    waited = time.monotonic() - started
    assert on_b.returncode == 0 and on_b.stdout.startswith("owned "), on_b.describe()
    assert f"its previous owner (pid {pid} on hostA" in on_b.stderr, on_b.describe()
    assert f"its lease was not renewed while this run watched it for {3 * LEASE_BEAT:g} s" in on_b.stderr, \
        on_b.describe()
    assert waited >= 3 * LEASE_BEAT, f"taken over after {waited:.1f} s, before the lease could expire"
    assert sorted(p.name for p in directory.iterdir()) == []  # released on its way out


def test_doctor_names_the_host_whose_sshd_is_stopped(cluster):
    sshd = cluster.hosts[1].sshd
    # SIGSTOP, not kill: the stopped sshd still holds hostB's namespaces for the tests after this.
    os.kill(sshd.pid, signal.SIGSTOP)
    try:
        result = run_doctor(cluster)
    finally:
        os.kill(sshd.pid, signal.SIGCONT)
    assert result.returncode == 1, result.describe(lines=60)
    rows = doctor_rows(result.stdout)
    assert rows[("reach", "hostA")] == "ok" and rows[("reach", "hostB")] == "FAIL", result.stdout
    assert "check(s) failed" in result.stdout and "reach (hostB)" in result.stdout


# How SLURM's preemption warning reaches each script's ranks, sent at once here (the scripts'
# --signal=...@90 arrives 60-90 s before the end, too late for a test to wait on):
# srun tasks directly (--signal=USR1), or the batch shell, which passes it to mpirun (B:USR1).
# Each script runs once, here: the test checks its placement and logs too.
PREEMPTION_SIGNALS = {
    "slurm/train.sbatch": ["scancel", "-s", "USR1"],
    "slurm/train-mpirun.sbatch": ["scancel", "--batch", "-s", "USR1"],
    "slurm/train-horovodrun.sbatch": ["scancel", "--batch", "-s", "USR1"],
}


@pytest.mark.parametrize("script", sorted(PREEMPTION_SIGNALS))
def test_sbatch_job_preempted_with_usr1_checkpoints_requeues_and_resumes(cluster, script):
    """The ranks agree at a step boundary, checkpoint, rank 0 requeues the job, and the requeued
    job resumes from the checkpoint and finishes; both halves place the ranks 2 per host."""
    jobs = cluster.state / f"jobs-preempt-{Path(script).stem}"
    jobs.mkdir()
    log, checkpoints = jobs / "train-%j.out", jobs / "ckpt"
    argv = ["sbatch", "--wait", "--nodes=2", "--ntasks-per-node=2", "--time=00:15:00", f"--output={log}",
            script, *TRAIN_ARGS[1:], "--checkpoint-dir", str(checkpoints),
            "--checkpoint-every", "10", f"--train.run_dir={jobs / 'runs'}"]
    # HVDTRAIN_NIC: the horovodrun script's interface common to both hosts.
    waiting = subprocess.Popen(cluster.head.enter() + argv, cwd=ROOT, env=cluster.env(VENV=sys.prefix, HVDTRAIN_NIC="eth0"),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               start_new_session=True)
    try:
        deadline = time.monotonic() + LAUNCH_TIMEOUT
        while not (checkpoints / "ckpt-000000010.pt").exists():
            assert waiting.poll() is None, f"the job ended before its first checkpoint: {waiting.communicate()}"
            assert time.monotonic() < deadline, "no first checkpoint"
            time.sleep(0.1)
        job = cluster.run_on(cluster.head, ["squeue", "-h", "-o", "%i"], 30).stdout.split()
        assert len(job) == 1, f"expected one job in the queue: {job}"
        signalled = cluster.run_on(cluster.head, [*PREEMPTION_SIGNALS[script], job[0]], 30)
        assert signalled.returncode == 0, signalled.describe()
        out, err = waiting.communicate(timeout=LAUNCH_TIMEOUT)
    finally:
        if waiting.poll() is None:
            os.killpg(waiting.pid, signal.SIGKILL)
            cluster.run_on(cluster.head, ["scancel", "--full", *job], 30)
    output = "\n".join(path.read_text() for path in sorted(jobs.glob("train-*.out")))
    context = f"{out}\n{err}\n{output[-4000:]}\n" + "\n".join(map(log_tail, cluster.slurm_logs))
    assert waiting.returncode == 0, context

    stopped = re.search(rf"preempted after step (\d+): requeueing with `scontrol requeue {job[0]}`", output)
    assert stopped, context
    assert re.search(rf"resumed at epoch \d+, step {stopped.group(1)}, sample \d+ of the epoch", output), context
    # The resumed half trains on to the end: its last line is the 4-worker accuracy line.
    assert_trained_on_two_hosts(output, context)
    run_dir = jobs / "runs" / f"slurm-{job[0]}"
    assert_placed_and_logged(output, script, run_dir, context)
    # The requeued job appended to the same run directory (named after the job): each record's
    # time - elapsed is its start's clock (both rounded to 1 ms; a requeue takes seconds), so the
    # records come from exactly two starts, and the second goes on from the preemption step.
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
    starts = [r["time"] - r["elapsed"] for r in records]
    restarts = [i for i in range(1, len(records)) if abs(starts[i] - starts[i - 1]) > 1.0]
    assert len(restarts) == 1, (records, context)
    before, after = records[restarts[0] - 1], records[restarts[0]]
    assert before["step"] <= int(stopped.group(1)) < after["step"], (records, context)
    assert [r["epochs_done"] for r in records if r["kind"] == "epoch"][-1] == 12, context


def test_doctor_inside_a_slurm_allocation_takes_its_hosts_from_slurm(cluster):
    jobs = cluster.state / "jobs-doctor"
    jobs.mkdir()
    log = jobs / "doctor-%j.out"
    result = cluster.run_on(cluster.head, [
        "sbatch", "--wait", "--nodes=2", "--ntasks-per-node=2", "--time=00:05:00", f"--output={log}",
        f"--wrap={DOCTOR} doctor --network-interface eth0 --checkpoint-dir {jobs / 'ckpt'}"],
        LAUNCH_TIMEOUT, cwd=ROOT)
    output = "\n".join(path.read_text() for path in jobs.glob("doctor-*.out"))
    assert result.returncode == 0, f"{result.describe()}\n{output}"
    rows = doctor_rows(output)
    assert rows[("reach", "hostA")] == rows[("reach", "hostB")] == "ok", output
    assert re.search(r"slurm\s+this host\s+ok\s+job \d+, scontrol found", output), output
    assert re.search(r"allreduce\s+4 ranks, 2 hosts\s+ok", output), output


def test_language_model_pipeline_across_nodes_tensor_inside_each_as_a_slurm_job(cluster):
    """train_lm.py as a 4-task SLURM job on 2 nodes with train.pipeline_parallel=2 across them and
    train.tensor_parallel=2 inside each (tensor innermost: hostA's ranks 0,1 are stage 0, hostB's
    2,3 stage 1; one model replica, so a global batch of 16), 150 steps of a small transformer:
    below the data-parallel SLURM job's bound of 4.0 bits/char."""
    result, output, context = sbatch_language_model(cluster, "jobs-lm-model-parallel", [
        "--model.d_model=64", "--model.layers=2", "--train.pipeline_parallel=2", "--train.tensor_parallel=2",
        "--train.micro_batches=2", "--train.max_steps=150",
        "--train.warmup_epochs=0"])  # one data-parallel worker: the rate is not scaled, and 150 steps run at it
    assert result.returncode == 0, context
    assert ranks_per_host(output) == {"hostA": "0,1", "hostB": "2,3"}, context
    assert "mesh: data 1 x pipeline 2 x tensor 2" in output, context
    placed = [("hostA", 0, 0), ("hostA", 0, 1), ("hostB", 1, 0), ("hostB", 1, 1)]  # (host, stage, tensor)
    for rank, (host, stage, tensor) in enumerate(placed):
        where = f"rank {rank} on {host}: data 0/1, stage {stage}/2, tensor {tensor}/2"
        assert where in output, f"no start line '{where}'\n{context}"
    final = re.search(r"= ([0-9.]+) bits/char on \d+ held-out characters, 4 workers", output)
    assert final and float(final.group(1)) <= 4.0, context


def test_a_second_cluster_runs_beside_the_first(cluster):
    """Two test sessions on one machine (CI beside a developer's run) each get their own
    namespaces and hosts files; the machine's /etc/hosts is never touched, and tearing one
    cluster down leaves the other working."""
    etc_hosts = Path("/etc/hosts").read_bytes()
    with harness.running_cluster() as second:  # its build checks ssh between its hosts and SLURM
        assert {h.netns for h in second.hosts}.isdisjoint(h.netns for h in cluster.hosts)
        assert Path("/etc/hosts").read_bytes() == etc_hosts
        both_idle = "hostA idle\nhostB idle\n"
        for built in (cluster, second):
            assert built.run_on(built.head, ["ssh", "hostB", "hostname"], 30).stdout == "hostB\n"
            assert built.run_on(built.head, ["sinfo", "-h", "-N", "-o", "%N %t"], 30).stdout == both_idle
    assert not {h.netns for h in second.hosts} & set(harness.namespaces_on_machine())
    assert not second.state.exists()
    assert cluster.run_on(cluster.head, ["ssh", "hostB", "hostname"], 30).stdout == "hostB\n"
    assert cluster.run_on(cluster.head, ["sinfo", "-h", "-N", "-o", "%N %t"], 30).stdout == both_idle
    assert Path("/etc/hosts").read_bytes() == etc_hosts


# hsdp across the two hosts: its shard groups are the hosts, its steps one process's, and what crosses
# between the hosts per step, against fsdp over the same 4 ranks (tests/cluster/hsdp_worker.py).
# Bytes per step, for P bytes of (padded float64) parameters over R = 2 hosts of K = 2 ranks, m micro-batches:
# - hsdp: each rank's slice (P / K) all-reduced with the one rank holding it on the other host, K pairs at once.
#   A 2-rank all-reduce of M bytes moves M each way whatever its algorithm (ring: M/2 reduce-scatter + M/2
#   all-gather; recursive doubling: M at once; a lower bound too: 2 (R - 1) / R M per rank), so
#   K x 2 x P / K = 2 P, once per step (2 (R - 1) P for R hosts).
# - fsdp over the 4 ranks, per micro-batch: every unit's slices gathered before its forward and again before
#   its backward (the root part once), its gradients reduce-scattered. No algorithm crosses less than the
#   half of a unit each host lacks, each way: P per gather and per reduce-scatter, so at least
#   m (3 P_units + 2 P_root). A ring over ranks 0-3 crosses hosts on 2 of its 4 links, each carrying 3/4 of
#   the buffer: 1.5 P per collective, m (4.5 P_units + 3 P_root).
HEADERS = 1.07  # Ethernet + IPv4 + TCP headers at the veth's MTU 1500: 66 B per 1448-B segment and a 66-B ACK per two
CONTROL = 1.03  # Horovod's negotiation and Open MPI's control messages, well under 3% of 2 P = 12.7 MB per step


def hsdp_cross_host_bytes(total: int, hosts: int = 2) -> float:
    return 2 * (hosts - 1) * total


def fsdp_cross_host_bytes_at_least(units: int, root: int, micro_batches: int) -> float:
    return micro_batches * (3 * units + 2 * root)


def fsdp_ring_cross_host_bytes(units: int, root: int, micro_batches: int) -> float:
    return micro_batches * 1.5 * (3 * units + 2 * root)


def veth_bytes(cluster: Cluster) -> int:
    """tx + rx of hostA's eth0, read from /sys inside its namespace (`ip netns exec` mounts that
    namespace's /sys): every byte between the hosts, launches included."""
    files = [f"/sys/class/net/eth0/statistics/{kind}_bytes" for kind in ("tx", "rx")]
    read = harness.run_bounded(["ip", "netns", "exec", cluster.head.netns, "cat", *files], 30)
    assert read.returncode == 0, read.describe()
    return sum(int(value) for value in read.stdout.split())


def test_hsdp_on_two_hosts_takes_one_process_steps_and_crosses_hosts_less_than_fsdp(cluster, tmp_path):
    before = veth_bytes(cluster)
    out = tmp_path / "hsdp.json"
    launch_from_head(cluster, ["mpirun", "-np", "4", "--hostfile", str(cluster.hostfile), "--bind-to", "none",
                               PYTHON, "-m", "tests.cluster.hsdp_worker", str(out)])
    job_bytes = veth_bytes(cluster) - before
    found = json.loads(out.read_text())
    steps, micro = found["steps"], found["micro_batches"]
    units, root = found["bytes"]["units"], found["bytes"]["root"]
    hsdp, fsdp = found["hsdp_crossed"] / steps, found["fsdp_crossed"] / steps
    print(f"\nbytes crossing hosts per step: hsdp {hsdp / 1e6:.2f} MB (formula {hsdp_cross_host_bytes(units + root) / 1e6:.2f}), "
          f"fsdp {fsdp / 1e6:.2f} MB (ring {fsdp_ring_cross_host_bytes(units, root, micro) / 1e6:.2f}, "
          f"at least {fsdp_cross_host_bytes_at_least(units, root, micro) / 1e6:.2f}); whole job {job_bytes / 1e6:.1f} MB; "
          f"max |hsdp - one process| {found['max_difference']:.1e}")

    # The shard groups are the hosts, found from the hostnames hsdp gathers at set-up.
    assert found["label"] == "hsdp 2 x 2", found
    assert found["shard_group_hosts"] == [["hostA"], ["hostA"], ["hostB"], ["hostB"]], found
    # Float64, bound 1e-10: hsdp differs from one process only in the order of float64 additions (the
    # reduce-scatter's mean within a host, then the mean across hosts), 1e-16 relative per step (measured:
    # 5e-13 after Adam's normalization); without the mean across the hosts the weights differ by 8e-2.
    assert found["ranks_agree"], "the ranks' gathered models differ"
    assert found["max_moved"] > 1e-3, "the steps did not move the weights: the test proves nothing"
    assert found["max_difference"] < 1e-10, found
    # The counters in the window are a part of what crossed in the whole job (launch and set-up included).
    assert found["hsdp_crossed"] + found["fsdp_crossed"] < job_bytes
    # hsdp: its all-reduce's bytes, plus headers and control messages, at most.
    assert hsdp_cross_host_bytes(units + root) <= hsdp <= hsdp_cross_host_bytes(units + root) * HEADERS * CONTROL
    assert fsdp >= fsdp_cross_host_bytes_at_least(units, root, micro)
    # So hsdp crosses less than any fsdp could: 2 P x 1.10 against 3 m P (m = 2 micro-batches: ratio <= 0.37).
    bound = hsdp_cross_host_bytes(units + root) * HEADERS * CONTROL / fsdp_cross_host_bytes_at_least(units, root, micro)
    assert bound < 1 and hsdp / fsdp <= bound, (hsdp, fsdp, bound)
