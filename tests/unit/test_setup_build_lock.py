"""scripts/setup.sh builds a missing Horovod wheel once when several set-ups share a WHEELHOUSE: one
takes the lock (a directory: mkdir is atomic on NFS, where flock may not work) and builds, the others
wait for its wheel; a lock left by a set-up of this host that no longer runs is taken over, one held
too long is an error naming its holder, and a failed build lets go of it. The build itself is a stand-in
here (a real one: tests/cluster/test_install_as_user.py)."""
import os
import platform
import subprocess
import time
from pathlib import Path

from tests.unit.test_setup_cuda import functions

# Stands in for build_horovod_wheel: counts its builds, takes a while, and puts the wheel in place in
# one rename as the real one does (or fails as the real one does, through die).
FAKE_BUILD = '''
build_horovod_wheel() {
  echo build >> "$BUILDS"
  sleep "${BUILD_SECONDS:-0}"
  [ "${BUILD_FAILS:-0}" = 1 ] && die "Horovod build failed; see build.log"
  mkdir -p "$1" && touch "$1/horovod-0.28.1.whl.tmp" && mv "$1/horovod-0.28.1.whl.tmp" "$1/horovod-0.28.1-cp311-linux_x86_64.whl"
}
'''


def start(tmp_path: Path, **env) -> subprocess.Popen:
    script = functions() + FAKE_BUILD + 'build_once "$WHEELHOUSE/horovod-key" && ls "$WHEELHOUSE/horovod-key"'
    environment = {"PATH": "/usr/bin:/bin", "WHEELHOUSE": str(tmp_path / "wheels"), "BUILDS": str(tmp_path / "builds"),
                   "HOROVOD_BUILD": "auto", **env}
    return subprocess.Popen(["bash", "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=environment)


def finish(process: subprocess.Popen):
    out, err = process.communicate(timeout=60)
    return process.returncode, out, err


def builds(tmp_path: Path) -> int:
    path = tmp_path / "builds"
    return len(path.read_text().split()) if path.exists() else 0


def test_two_set_ups_at_once_build_one_wheel_and_both_install_it(tmp_path):
    first = start(tmp_path, BUILD_SECONDS="3")
    lock = tmp_path / "wheels" / "horovod-key.lock"
    deadline = time.monotonic() + 30
    while not (lock / "owner").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    second = start(tmp_path)
    (code1, out1, err1), (code2, out2, err2) = finish(first), finish(second)

    assert (code1, code2) == (0, 0), (err1, err2)
    assert builds(tmp_path) == 1
    assert "horovod-0.28.1-cp311-linux_x86_64.whl" in out1 and "horovod-0.28.1-cp311-linux_x86_64.whl" in out2
    assert f"waiting for the Horovod wheel that host {platform.node()} pid {first.pid} since" in out2, out2
    assert not lock.exists(), "the lock outlived the build"


def test_a_lock_left_by_a_set_up_of_this_host_that_no_longer_runs_is_taken_over(tmp_path):
    dead = subprocess.Popen(["true"])
    dead.wait()
    lock = tmp_path / "wheels" / "horovod-key.lock"
    lock.mkdir(parents=True)
    (lock / "owner").write_text(f"host {platform.node()} pid {dead.pid} since 2026-11-27T10:00:00Z\n")
    code, out, err = finish(start(tmp_path))

    assert code == 0, err
    assert f"taking over the Horovod build lock of a set-up that no longer runs (host {platform.node()} pid {dead.pid}" in out
    assert builds(tmp_path) == 1 and not lock.exists()


def test_a_lock_held_elsewhere_past_the_wait_is_an_error_naming_its_holder(tmp_path):
    lock = tmp_path / "wheels" / "horovod-key.lock"
    lock.mkdir(parents=True)
    holder = f"host node17 pid {os.getpid()} since 2026-11-27T10:00:00Z"  # another host: its pid says nothing here
    (lock / "owner").write_text(holder + "\n")
    code, out, err = finish(start(tmp_path, HOROVOD_BUILD_WAIT="1"))

    assert code == 1
    assert f"no Horovod wheel in {tmp_path}/wheels/horovod-key after 2 s of waiting for {holder} (lock {lock})" in err, err
    assert f"If no set-up is building it, remove {lock} and run this again" in err
    assert builds(tmp_path) == 0 and lock.exists(), "a lock held by another host's set-up was taken"


def test_a_failed_build_lets_go_of_the_lock(tmp_path):
    code, out, err = finish(start(tmp_path, BUILD_FAILS="1"))

    assert code == 1 and "Horovod build failed" in err, err
    assert not (tmp_path / "wheels" / "horovod-key.lock").exists(), "a failed build left its lock: the next set-up would wait"
