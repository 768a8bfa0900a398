"""What one host can tell about itself, for ``hvdtrain doctor``.

This file is sent as a script to each host (``ssh HOST PYTHON - ARGS`` with this source on
stdin), so it imports nothing outside the standard library and never imports torch: versions
come from the installed packages' metadata. It prints one JSON object.

    python host_facts.py facts '{"checkpoint_dir": "/shared/ckpt", "token": "abc"}'
    python host_facts.py tokens '{"checkpoint_dir": "/shared/ckpt", "token": "abc"}'
    python host_facts.py cleanup '{"checkpoint_dir": "/shared/ckpt", "token": "abc"}'
"""
import json
import os
import socket
import sys
from importlib import metadata

PACKAGES = ("torch", "horovod", "mpi4py", "hvdtrain")
TOKEN_PREFIX = ".hvdtrain-doctor-"


def versions():
    found = {"python": "%d.%d.%d" % sys.version_info[:3]}
    for name in PACKAGES:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = None
    return found


def gpu_count():
    """NVIDIA GPUs a job step on this host can use (no CUDA import: this runs on login nodes too):
    the lines of ``nvidia-smi -L`` when it is installed (it lists only the GPUs of this cgroup when
    SLURM confines the devices), else the driver's /proc entries, else 0 (no GPU visible)."""
    import shutil
    import subprocess

    if shutil.which("nvidia-smi"):
        try:
            done = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20)
        except subprocess.TimeoutExpired:
            done = None
        if done is not None and done.returncode == 0:
            return sum(1 for line in done.stdout.splitlines() if line.strip().startswith("GPU "))
    try:
        return len(os.listdir("/proc/driver/nvidia/gpus"))
    except OSError:
        return 0


def interfaces():
    """Interfaces that are up and have an IPv4 address (what MPI and Gloo can use)."""
    names = []
    for _, name in socket.if_nameindex():
        try:
            with open(f"/sys/class/net/{name}/operstate") as state:
                up = state.read().strip() in ("up", "unknown")
        except OSError:
            up = False
        if up:
            names.append(name)
    return sorted(names)


def write_token(directory, token):
    """Create this host's token file; say why not when it cannot."""
    if not directory:
        return {"checked": False}
    path = os.path.join(directory, TOKEN_PREFIX + token + "-" + socket.gethostname())
    try:
        os.makedirs(directory, exist_ok=True)
        with open(path, "w") as handle:
            handle.write(socket.gethostname())
            handle.flush()
            os.fsync(handle.fileno())
    except OSError as error:
        return {"checked": True, "writable": False, "error": f"{error.strerror}: {directory}"}
    return {"checked": True, "writable": True, "path": os.path.realpath(directory)}


def facts(args):
    return {
        "hostname": socket.gethostname(),
        "executable": sys.executable,
        "versions": versions(),
        "cpus": len(os.sched_getaffinity(0)),
        "gpus": gpu_count(),
        "interfaces": interfaces(),
        "checkpoint": write_token(args.get("checkpoint_dir"), args["token"]),
    }


def tokens(args):
    """The hosts whose token this host sees (every host lists before any host cleans up)."""
    directory, prefix = args["checkpoint_dir"], TOKEN_PREFIX + args["token"] + "-"
    try:
        seen = sorted(name[len(prefix):] for name in os.listdir(directory) if name.startswith(prefix))
    except OSError as error:
        return {"error": f"{error.strerror}: {directory}", "seen": []}
    return {"seen": seen}


def cleanup(args):
    path = os.path.join(args["checkpoint_dir"], TOKEN_PREFIX + args["token"] + "-" + socket.gethostname())
    try:
        os.remove(path)
    except OSError:
        return {"removed": False}
    return {"removed": True}


if __name__ == "__main__":
    action, arguments = sys.argv[1], json.loads(sys.argv[2])
    print(json.dumps({"facts": facts, "tokens": tokens, "cleanup": cleanup}[action](arguments)))
