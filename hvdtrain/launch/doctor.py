"""The checks of ``hvdtrain doctor`` (hvdtrain.cli.doctor), each a row of one table: ssh, one machine
per host name, versions, network interface, slots, the checkpoint directory, each host's clock
against it, and the file locks it gives (coherent, node-local or no flock, from two hosts), an
all-reduce probe, SLURM. Runs on login nodes: no torch import here (host_facts.py runs on each
host; probe.py inside a short job).
"""
from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from hvdtrain.launch.commands import LaunchSpec, exports_present, openmpi_argv
from hvdtrain.launch.hostfile import Host, total_slots

FACTS_SCRIPT = (Path(__file__).with_name("host_facts.py")).read_text()
SSH_CONNECT_TIMEOUT = 5
HOST_TIMEOUT = 30
PROBE_TIMEOUT = 120
OK, WARN, FAIL = "ok", "WARN", "FAIL"
# NTP keeps a host within tens of ms of true time, and the file server as well; with a file system's
# timestamp tick (<= 10 ms) a healthy host and server differ by 0.1 s at most. Beyond 0.25 s (more
# than the probe's own round trip explains) nothing keeps that clock, and a quarter second already
# misorders one step's collectives between hosts in the flight recorder's timelines.
CLOCK_TOLERANCE = 0.25
# Whose clock sets a file's times, by the type of the mount holding the checkpoint directory.
SERVER_TIMED = frozenset({"nfs", "nfs4", "cifs", "smb3"})  # the file server's: the probe measures against it
CLIENT_TIMED = frozenset({"lustre", "gpfs", "gfs2"})  # the writing host's own: the offset is ~0 by construction
LOCAL = frozenset({"ext2", "ext3", "ext4", "xfs", "btrfs", "zfs", "f2fs", "tmpfs", "overlay", "ramfs"})


@dataclass(frozen=True)
class Row:
    check: str
    host: str
    status: str
    detail: str


def is_local(host: str) -> bool:
    return host in ("localhost", socket.gethostname(), socket.getfqdn()) or host.startswith("127.")


def host_argv(host: str, python: str, args: Sequence[str]) -> List[str]:
    """Run ``python - args`` on ``host`` (locally without ssh); the script comes on stdin."""
    if is_local(host):
        return [python, "-", *args]
    remote = " ".join(shlex.quote(part) for part in (python, "-", *args))
    return ["ssh", "-o", "BatchMode=yes", "-o", f"ConnectTimeout={SSH_CONNECT_TIMEOUT}", host, remote]


def run_on_host(host: str, python: str, args: Sequence[str]) -> Tuple[Optional[dict], str]:
    """(parsed JSON, "") on success, or (None, why it failed)."""
    try:
        done = subprocess.run(host_argv(host, python, args), input=FACTS_SCRIPT, capture_output=True,
                              text=True, timeout=HOST_TIMEOUT)
    except subprocess.TimeoutExpired:
        return None, f"no answer in {HOST_TIMEOUT} s"
    last_error = (done.stderr.strip().splitlines() or ["(no message)"])[-1]
    if done.returncode == 255 and not is_local(host):
        return None, f"ssh failed: {last_error}"
    if done.returncode != 0:
        return None, f"{python} failed there (exit {done.returncode}): {last_error}"
    try:
        return json.loads(done.stdout.strip().splitlines()[-1]), ""
    except (ValueError, IndexError):
        return None, f"unexpected answer: {done.stdout.strip()[-200:]!r}"


def on_every_host(hosts: Sequence[Host], python: str, args: Sequence[str]) -> Dict[str, Tuple[Optional[dict], str]]:
    with ThreadPoolExecutor(max_workers=min(32, len(hosts))) as pool:
        answers = pool.map(lambda h: run_on_host(h.name, python, args), hosts)
        return dict(zip((h.name for h in hosts), answers))


# ---- the checks: pure functions of what the hosts answered ---------------------------------

def ssh_rows(answers: Mapping[str, Tuple[Optional[dict], str]]) -> List[Row]:
    rows = []
    for host, (facts, error) in answers.items():
        if facts is not None:
            how = "local" if is_local(host) else "ssh"
            rows.append(Row("reach", host, OK, f"{how}: answered as {facts['hostname']}"))
        else:
            rows.append(Row("reach", host, FAIL, f"{error}. HINT: passwordless ssh from here must work "
                                                 f"(ssh {host} true) and the host name must resolve"))
    return rows


def _short_id(identifier: Optional[str]) -> str:
    return f"{identifier[:8]}…" if identifier else "unknown"


def _machine(found: dict) -> Optional[Tuple[str, Optional[str], Optional[str]]]:
    """What one running system is known by, as hvdtrain's checkpoint lease knows it (plus the network
    namespace): the kernel's boot id and the namespaces; None without a boot id (/etc/machine-id
    alone proves nothing: images cloned without clearing it share one)."""
    identity = found.get("identity") or {}
    if not identity.get("boot_id"):
        return None
    return identity["boot_id"], identity.get("pid_namespace"), identity.get("net_namespace")


def _who(identities: Sequence[dict], machines: int) -> str:
    """"two machines (boot ids ab12…, cd34…)", or containers when they share one kernel."""
    count = {2: "two", 3: "three"}.get(machines, str(machines))
    boots = sorted({identity["boot_id"] for identity in identities})
    if len(boots) == 1:  # one kernel: containers, told apart by their namespaces only
        return f"{count} containers of one machine (boot id {_short_id(boots[0])})"
    machine_ids = {identity.get("machine_id") for identity in identities}
    cloned = " and one /etc/machine-id: a cloned image" if len(machine_ids) == 1 and None not in machine_ids else ""
    return f"{count} machines (boot ids {', '.join(_short_id(boot) for boot in boots)}{cloned})"


def _one_name_row(name: str, entries: Sequence[str], facts: Mapping[str, dict]) -> Row:
    """The row of hostfile entries ``entries`` that all answered as ``name``."""
    where, listed = " + ".join(entries), ", ".join(entries)
    machines = [_machine(facts[entry]) for entry in entries]
    if None in machines:
        return Row("host names", where, WARN, f"{listed} all answer as {name}; whether they are one machine "
                                              f"cannot be told (no kernel boot id readable)")
    if len(set(machines)) == 1:
        # Not a FAIL: one name, one machine, so nothing is ambiguous; but its ranks add up there.
        return Row("host names", where, WARN,
                   f"{listed} are one machine (boot id {_short_id(machines[0][0])}), listed {len(entries)} times: "
                   f"every entry's ranks start on it, sharing its cores and GPUs. HINT: list it once")
    who = _who([facts[entry]["identity"] for entry in entries], len(set(machines)))
    return Row("host names", where, FAIL,
               f"{who} answer as {name}: hvdtrain's checkpoint lease, mpirun's hostfiles and every per-host "
               f"message tell hosts apart by name. HINT: give each machine its own hostname (containers: "
               f"--hostname; images: not localhost)")


def host_name_rows(facts: Mapping[str, dict]) -> List[Row]:
    """One machine per host name: hostfile entries (facts' keys) that answered with one name are
    either one machine listed twice or machines that only their boot ids tell apart."""
    by_name: Dict[str, List[str]] = {}
    for entry, found in facts.items():
        by_name.setdefault(found["hostname"], []).append(entry)
    rows = [_one_name_row(name, entries, facts) for name, entries in by_name.items() if len(entries) > 1]
    if not rows and len(facts) > 1:
        rows.append(Row("host names", "all hosts", OK, f"{len(facts)} hosts, each answering with a name of its own"))
    return rows


def version_rows(facts: Mapping[str, dict]) -> List[Row]:
    """Every host against the first one: a mismatch is the usual cause of crashes at init."""
    if not facts:
        return []
    reference_host = next(iter(facts))
    reference = facts[reference_host]["versions"]
    rows = []
    for host, found in facts.items():
        versions = found["versions"]
        missing = [name for name, version in versions.items() if version is None]
        differ = [f"{name} {versions[name]} (vs {reference[name]} on {reference_host})"
                  for name in versions if versions[name] != reference[name] and versions[name] is not None]
        summary = " ".join(f"{name} {version}" for name, version in versions.items())
        if missing:
            rows.append(Row("versions", host, FAIL, f"not installed: {', '.join(missing)} (for {found['executable']})"))
        elif differ:
            rows.append(Row("versions", host, FAIL, "differs: " + "; ".join(differ)))
        else:
            rows.append(Row("versions", host, OK, summary))
    return rows


def interface_rows(facts: Mapping[str, dict], wanted: Optional[str]) -> List[Row]:
    if not facts:
        return []
    every = "all hosts"
    if wanted:
        lacking = [host for host, found in facts.items() if wanted not in found["interfaces"]]
        if lacking:
            return [Row("network", every, FAIL, f"--network-interface {wanted} is missing on {', '.join(lacking)}")]
        return [Row("network", every, OK, f"{wanted} is up on every host")]
    common = set.intersection(*(set(found["interfaces"]) for found in facts.values()))
    if len(facts) > 1:
        common.discard("lo")  # loopback reaches no other host
    if not common:
        listing = "; ".join(f"{host}: {','.join(found['interfaces'])}" for host, found in facts.items())
        return [Row("network", every, FAIL, f"no interface name is common to every host ({listing}). HINT: "
                                            f"horovodrun needs one name everywhere; pass --network-interface")]
    return [Row("network", every, OK, "common interfaces: " + ", ".join(sorted(common)))]


def slot_rows(hosts: Sequence[Host], facts: Mapping[str, dict]) -> List[Row]:
    rows = []
    for host in hosts:
        found = facts.get(host.name)
        if found is None:
            continue
        cpus, gpus = found["cpus"], found["gpus"]
        detail = f"{host.slots} slots, {cpus} cores, " + (f"{gpus} GPUs" if gpus else "no GPU visible")
        if gpus and host.slots > gpus:
            rows.append(Row("slots", host.name, FAIL, f"{detail}: more ranks than GPUs; lower the slots to {gpus}"))
        elif gpus and host.slots < gpus:
            rows.append(Row("slots", host.name, WARN, f"{detail}: {gpus - host.slots} GPUs stay idle"))
        elif host.slots > cpus:
            rows.append(Row("slots", host.name, WARN, f"{detail}: more ranks than cores (oversubscribed)"))
        else:
            rows.append(Row("slots", host.name, OK, detail))
    return rows


def checkpoint_rows(facts: Mapping[str, dict], seen: Mapping[str, List[str]], directory: str) -> List[Row]:
    """Writable on every host, and one directory: each host sees the files all the others wrote."""
    rows = []
    writers = sorted(found["hostname"] for found in facts.values() if found["checkpoint"].get("writable"))
    for host, found in facts.items():
        result = found["checkpoint"]
        if not result.get("writable"):
            rows.append(Row("checkpoint dir", host, FAIL, f"not writable: {result.get('error')}"))
            continue
        unseen = sorted(set(writers) - set(seen.get(host, [])))
        if unseen:
            rows.append(Row("checkpoint dir", host, FAIL,
                            f"{directory} here does not hold the files written on {', '.join(unseen)}: not "
                            f"a shared filesystem. HINT: put checkpoints where every host mounts the same disk"))
        else:
            rows.append(Row("checkpoint dir", host, OK, f"{result['path']} writable, shared by {len(writers)} hosts"))
    return rows


def _whose_clock(filesystem: Optional[str]) -> str:
    """What the offset is measured against, for the row's text."""
    if filesystem in SERVER_TIMED:
        return f" against the file server's clock ({filesystem})"
    if filesystem in CLIENT_TIMED:
        return (f": ~0 by construction, {filesystem} takes file times from each host's own clock, so this does not "
                f"show how far the hosts' clocks are apart (check NTP on each: chronyc tracking)")
    if filesystem in LOCAL:
        return f": ~0 by construction, {filesystem} is local and takes file times from this host's clock"
    return f" ({filesystem})" if filesystem else ""


def _clock_row(host: str, clock: dict, filesystem: Optional[str], alike: bool) -> Row:
    """``alike``: every host is off by about as much (then the file server's clock is the odd one)."""
    if "error" in clock:
        return Row("clock vs checkpoint dir", host, WARN, f"not measured: {clock['error']}")
    offset, uncertainty = clock["offset"], clock["uncertainty"]
    measured = f"{offset:+.3f} s ±{uncertainty:.3f} s"
    if clock["whole_seconds"]:
        measured += " (whole-second file times)"
    if abs(offset) - uncertainty <= CLOCK_TOLERANCE:
        unsure = uncertainty > CLOCK_TOLERANCE
        return Row("clock vs checkpoint dir", host, OK, measured + _whose_clock(filesystem)
                   + (f"; too slow a round trip to tell within {CLOCK_TOLERANCE} s" if unsure else ""))
    if alike:
        return Row("clock vs checkpoint dir", host, WARN,
                   f"{measured}{_whose_clock(filesystem)}, as on every host: the file server's clock is likely the "
                   f"one off. The hosts agree with each other, but file times there are off by as much (the flight "
                   f"recorder's stall verdict compares them with the hosts' clocks; the checkpoint lease does not)")
    return Row("clock vs checkpoint dir", host, WARN,
               f"{measured}{_whose_clock(filesystem)}: more than {CLOCK_TOLERANCE} s, further than NTP keeps clocks "
               f"(tens of ms): the flight recorder's cross-host timelines and this host's log times are off by as "
               f"much (the checkpoint lease does not depend on it). HINT: check NTP here (chronyc tracking)")


def clock_rows(facts: Mapping[str, dict]) -> List[Row]:
    """Each host's clock minus the clock that sets file times in the checkpoint directory (the
    probe in host_facts.clock_offset), where the host could write there."""
    measured = {host: found["checkpoint"] for host, found in facts.items() if "clock" in found["checkpoint"]}
    offsets = [result["clock"]["offset"] for result in measured.values() if "offset" in result["clock"]]
    alike = (len(offsets) > 1 and max(offsets) - min(offsets) <= CLOCK_TOLERANCE
             and min(abs(offset) for offset in offsets) > CLOCK_TOLERANCE)
    return [_clock_row(host, result["clock"], result.get("filesystem"), alike) for host, result in measured.items()]


LEASE = "the run lock (a lease on owner.json, no flock needed) works here"


def lock_rows(holding: Tuple[Optional[dict], str], trying: Tuple[Optional[dict], str]) -> List[Row]:
    """What flock the checkpoint directory gives, from one host holding a lock while another
    (or, with one host, another process) tries it; and whether O_EXCL creation, which the run
    lock relies on, is exclusive across them (host_facts.lock_hold and lock_try)."""
    (hold, hold_error), (tried, try_error) = holding, trying
    if hold is None or tried is None:
        return [Row("checkpoint lock", "all hosts", FAIL, f"the lock probe did not run: {hold_error or try_error}")]
    a, b = hold["host"], tried["host"]
    where = a if a == b else f"{a} + {b}"
    for found, host in ((hold, a), (tried, b)):
        if found.get("flock") == "error":
            return [Row("checkpoint lock", host, FAIL, f"the lock probe failed: {found.get('error')}")]
    if not tried.get("exclusive"):
        return [Row("checkpoint lock", where, FAIL,
                    f"{b} created the file {a} had created with O_EXCL: creation is not exclusive here, so "
                    f"hvdtrain's run lock cannot hold. HINT: put checkpoints on a file system that makes "
                    f"O_EXCL atomic (NFSv3 or later, Lustre, GPFS, BeeGFS)")]
    if "none" in (hold.get("flock"), tried.get("flock")):
        error = hold.get("error") or tried.get("error")
        return [Row("checkpoint lock", where, OK, f"no flock ({error}); {LEASE}")]
    if tried.get("flock") not in ("refused", "granted"):
        return [Row("checkpoint lock", b, FAIL, f"the lock probe failed: {b} read {a}'s marker as "
                                                f"{tried.get('holder')!r}, not 'held'")]
    if a == b:
        if tried["flock"] == "refused":
            return [Row("checkpoint lock", where, OK, f"flock works between processes of {a} (one host: whether "
                                                      f"other hosts see each other's locks was not checked); {LEASE}")]
        return [Row("checkpoint lock", where, WARN, f"flock excludes nothing: a second process of {a} got the lock "
                                                    f"the first held; {LEASE}")]
    if tried["flock"] == "refused":
        return [Row("checkpoint lock", where, OK, f"coherent flock: {b} was refused the lock {a} held; {LEASE}")]
    return [Row("checkpoint lock", where, WARN,
                f"node-local flock: {b} got the lock {a} held, so tools that rely on flock are unsafe "
                f"across hosts here; {LEASE}")]


def lock_probe(hosts: Sequence[Host], python: str, arguments: str) -> List[Row]:
    """The first two hosts (one host: two processes of it) at once: one holds, the other tries."""
    holder, tryer = hosts[0], hosts[1 if len(hosts) > 1 else 0]
    with ThreadPoolExecutor(max_workers=2) as pool:
        holding = pool.submit(run_on_host, holder.name, python, ["lock_hold", arguments])
        trying = pool.submit(run_on_host, tryer.name, python, ["lock_try", arguments])
        return lock_rows(holding.result(), trying.result())


def scheduler_rows(environ: Mapping[str, str]) -> List[Row]:
    if "SLURM_JOB_ID" not in environ:
        return []
    if shutil.which("scontrol"):
        return [Row("slurm", "this host", OK, f"job {environ['SLURM_JOB_ID']}, scontrol found (requeue works)")]
    return [Row("slurm", "this host", FAIL, "scontrol not on PATH: preempted jobs cannot requeue themselves")]


# ---- the probe ------------------------------------------------------------------------------

def probe_row(hosts: Sequence[Host], python: str, interface: Optional[str]) -> Row:
    spec = LaunchSpec(np=total_slots(hosts), command=[python, "-m", "hvdtrain.launch.probe"], hosts=hosts,
                      network_interface=interface, exports=exports_present(os.environ),
                      as_root=os.geteuid() == 0)
    argv = openmpi_argv(spec)
    where = f"{spec.np} ranks"
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               start_new_session=True)
    try:
        out, err = process.communicate(timeout=PROBE_TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.communicate()
        return Row("allreduce", where, FAIL, f"no result in {PROBE_TIMEOUT} s: ranks cannot reach each other "
                                             f"(firewall, or a wrong --network-interface)")
    results = [line for line in out.splitlines() if line.startswith("{")]
    if process.returncode != 0 or not results:
        tail = (err.strip().splitlines() or out.strip().splitlines() or ["(no output)"])[-1]
        return Row("allreduce", where, FAIL, f"exit {process.returncode}: {tail}")
    result = json.loads(results[-1])
    return Row("allreduce", f"{result['ranks']} ranks, {len(result['hosts'])} hosts", OK,
               f"{result['size_mb']} MiB in {result['seconds'] * 1e3:.1f} ms, "
               f"busbw {result['busbw_gbps']:.2f} GB/s")


# ---- the command ----------------------------------------------------------------------------

def diagnose(hosts: Sequence[Host], python: str, checkpoint_dir: Optional[str],
             interface: Optional[str], probe: bool, environ: Mapping[str, str]) -> List[Row]:
    """Every check of ``hvdtrain doctor`` over ``hosts``, one row each: ssh, one machine per host name, versions,
    network interfaces, slots, the shared checkpoint directory, each host's clock against it and its file
    locks, the scheduler and, with ``probe``, an all-reduce.

    Args:
        hosts: the hosts to check, with their slots.
        python: the Python each host runs the checks with.
        checkpoint_dir: a directory every host must see as the same one (None: not checked).
        interface: the network interface the job will use (None: not checked).
        probe: also run a small all-reduce over every host.
        environ: the environment the launchers are found in.
    """
    token = uuid.uuid4().hex[:12]
    arguments = json.dumps({"checkpoint_dir": checkpoint_dir, "token": token})
    answers = on_every_host(hosts, python, ["facts", arguments])
    rows = ssh_rows(answers)
    facts = {host: found for host, (found, _) in answers.items() if found is not None}
    rows += host_name_rows(facts) + version_rows(facts) + interface_rows(facts, interface) + slot_rows(hosts, facts)
    if checkpoint_dir:
        reachable = [host for host in hosts if host.name in facts]
        seen = {host: (found or {}).get("seen", [])
                for host, (found, _) in on_every_host(reachable, python, ["tokens", arguments]).items()}
        on_every_host(reachable, python, ["cleanup", arguments])
        rows += checkpoint_rows(facts, seen, checkpoint_dir) + clock_rows(facts)
        writable = [host for host in reachable if facts[host.name]["checkpoint"].get("writable")]
        if writable:
            rows += lock_probe(writable, python, arguments)
    rows += scheduler_rows(environ)
    if probe:
        if len(facts) == len(hosts):
            rows.append(probe_row(hosts, python, interface))
        else:
            rows.append(Row("allreduce", "all hosts", FAIL, "not run: some hosts cannot be reached"))
    return rows


def render(rows: Sequence[Row]) -> str:
    headers = Row("CHECK", "HOST", "STATUS", "DETAIL")
    widths = [max(len(getattr(r, f)) for r in (headers, *rows)) for f in ("check", "host", "status")]
    lines = [f"{r.check:<{widths[0]}}  {r.host:<{widths[1]}}  {r.status:<{widths[2]}}  {r.detail}"
             for r in (headers, *rows)]
    return "\n".join(lines)
