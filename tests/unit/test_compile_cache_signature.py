"""The compile cache is code (Inductor unpickles and runs its entries), so only a file this user's
runs signed, unchanged since, reaches ``torch.compiler.load_cache_artifacts``; the key that signs it
is this user's alone, made once, race-free, by whichever process of whichever host comes first.

torch's save/load of the artifacts are faked: what is tested is which bytes reach them, not Inductor
(tests/launch/test_compile_cache.py compiles for real)."""
import logging
import multiprocessing
import os
import stat
from types import SimpleNamespace

import pytest
import torch

import hvdtrain.components.compile_cache as compile_cache
from hvdtrain.components.compile_cache import CACHE_FILE, CompileCache

KEY_VARIABLE = "HVDTRAIN_COMPILE_CACHE_KEY_FILE"  # spelled out: the old code has no constant for it
ARTIFACTS = b"\x80\x04compiled artifacts, a pickle to Inductor\n\x00\x01"


class FakeInductor:
    """torch.compiler's portable cache: ``saves`` what a process compiled, records what it is given to load."""

    def __init__(self) -> None:
        self.artifacts, self.count = ARTIFACTS, 2
        self.loaded = []

    def info(self):
        return SimpleNamespace(artifacts={"inductor": [f"graph-{index}" for index in range(self.count)]})

    def save_cache_artifacts(self):
        return self.artifacts, self.info()

    def load_cache_artifacts(self, data):
        self.loaded.append(bytes(data))
        return self.info()


@pytest.fixture
def inductor(monkeypatch):
    fake = FakeInductor()
    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", fake.save_cache_artifacts)
    monkeypatch.setattr(torch.compiler, "load_cache_artifacts", fake.load_cache_artifacts)
    return fake


@pytest.fixture
def key_file(tmp_path, monkeypatch):
    path = tmp_path / "keys" / "compile-cache.key"
    monkeypatch.setenv(KEY_VARIABLE, str(path))
    return path


@pytest.fixture
def checkpoints(tmp_path):
    directory = tmp_path / "ckpt"
    directory.mkdir()
    return directory


def warnings(caplog):
    return [record.getMessage() for record in caplog.records if record.levelno == logging.WARNING]


def saved(directory, **kwargs):
    """Rank 0's save after the first step; the file's bytes."""
    CompileCache(str(directory), True, logging.getLogger("test"), **kwargs).save()
    return (directory / CACHE_FILE).read_bytes()


def loaded(directory):
    """Another rank's load before its first compile: how many artifacts it loaded."""
    return CompileCache(str(directory), False, logging.getLogger("test")).load()


# --- what is loaded -------------------------------------------------------------------------------

def test_a_file_this_user_signed_is_loaded_without_its_header(inductor, key_file, checkpoints, caplog):
    content = saved(checkpoints)
    assert content.startswith(b"hvdtrain-compile-cache/1 key=") and content.endswith(b"\n" + ARTIFACTS)
    assert loaded(checkpoints) == 2
    assert inductor.loaded == [ARTIFACTS]
    assert warnings(caplog) == []


def test_a_file_whose_bytes_changed_is_not_loaded(inductor, key_file, checkpoints, caplog):
    content = bytearray(saved(checkpoints))
    content[-5] ^= 0x01  # one bit of the artifacts, the header left as written
    (checkpoints / CACHE_FILE).write_bytes(bytes(content))
    assert loaded(checkpoints) == 0
    assert inductor.loaded == []
    [warning] = warnings(caplog)
    assert "do not match its signature" in warning and "compiling from nothing" in warning, warning


def test_an_unsigned_file_written_by_an_earlier_hvdtrain_is_not_loaded(inductor, key_file, checkpoints, caplog):
    (checkpoints / CACHE_FILE).write_bytes(ARTIFACTS)  # the old format: torch's bytes alone
    assert loaded(checkpoints) == 0
    assert inductor.loaded == []
    [warning] = warnings(caplog)
    assert "unsigned" in warning and "replaced after the first step" in warning, warning


def test_a_file_signed_with_another_key_is_not_loaded(inductor, key_file, checkpoints, tmp_path, monkeypatch, caplog):
    saved(checkpoints)
    monkeypatch.setenv(KEY_VARIABLE, str(tmp_path / "other-home" / "compile-cache.key"))  # another user, or host
    assert loaded(checkpoints) == 0
    assert inductor.loaded == []
    [warning] = warnings(caplog)
    assert "signed with another key" in warning and KEY_VARIABLE in warning, warning


def test_a_header_of_another_format_is_not_loaded(inductor, key_file, checkpoints, caplog):
    (checkpoints / CACHE_FILE).write_bytes(b"hvdtrain-compile-cache/2 something new\n" + ARTIFACTS)
    assert loaded(checkpoints) == 0
    assert inductor.loaded == []
    [warning] = warnings(caplog)
    assert "not this hvdtrain's format hvdtrain-compile-cache/1" in warning, warning


def test_a_restart_after_a_refusal_replaces_the_file_with_a_signed_one(inductor, key_file, checkpoints):
    (checkpoints / CACHE_FILE).write_bytes(ARTIFACTS)
    root = CompileCache(str(checkpoints), True, logging.getLogger("test"))
    assert root.load() == 0
    root.after_first_step()
    assert loaded(checkpoints) == 2 and inductor.loaded == [ARTIFACTS]


# --- the key --------------------------------------------------------------------------------------

def test_the_key_is_made_on_first_use_0600_in_a_0700_directory_of_the_user_cache(
        inductor, checkpoints, tmp_path, monkeypatch):
    monkeypatch.delenv(KEY_VARIABLE, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    previous = os.umask(0o000)  # a permissive umask must not widen the modes
    try:
        saved(checkpoints)
    finally:
        os.umask(previous)
    key = tmp_path / "cache" / "hvdtrain" / "compile-cache.key"
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    assert stat.S_IMODE(key.parent.stat().st_mode) == 0o700
    assert len(key.read_bytes()) == 32 and key.read_bytes() != bytes(32)
    assert loaded(checkpoints) == 2  # the same key signs and verifies


def test_without_xdg_cache_home_the_key_is_under_the_home_directory(tmp_path, monkeypatch):
    monkeypatch.delenv(KEY_VARIABLE, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    for unset in ("", "relative/cache"):  # the XDG spec: empty or relative means unset
        monkeypatch.setenv("XDG_CACHE_HOME", unset)
        assert compile_cache.key_path() == tmp_path / ".cache" / "hvdtrain" / "compile-cache.key"


def test_a_key_others_can_read_is_refused_once_and_nothing_is_loaded_or_written(
        inductor, key_file, checkpoints, caplog):
    content = saved(checkpoints)
    key_file.chmod(0o644)
    root = CompileCache(str(checkpoints), True, logging.getLogger("test"))
    assert root.load() == 0
    inductor.count = 3
    root.save()
    assert inductor.loaded == []
    assert (checkpoints / CACHE_FILE).read_bytes() == content
    [warning] = warnings(caplog)
    assert f"(mode 0644): run chmod 600 {key_file}" in warning, warning


def test_a_key_of_another_user_is_refused(key_file):
    if os.geteuid() != 0:
        pytest.skip("only root can give a file to another user")
    compile_cache.read_or_create_key(key_file)
    os.chown(key_file, 12345, -1)
    with pytest.raises(compile_cache.UnusableKey, match="belongs to uid 12345, not to you"):
        compile_cache.read_key(key_file)


def test_a_key_of_the_wrong_length_is_refused(key_file):
    key_file.parent.mkdir()
    key_file.write_bytes(b"short")
    key_file.chmod(0o600)
    with pytest.raises(compile_cache.UnusableKey, match="holds 5 bytes, not 32: remove it"):
        compile_cache.read_key(key_file)


def test_a_key_that_cannot_be_made_is_named_and_nothing_is_loaded(inductor, checkpoints, tmp_path, monkeypatch,
                                                                   caplog):
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv(KEY_VARIABLE, str(tmp_path / "a-file" / "compile-cache.key"))
    (checkpoints / CACHE_FILE).write_bytes(ARTIFACTS)
    assert loaded(checkpoints) == 0 and inductor.loaded == []
    [warning] = warnings(caplog)
    assert "cannot be read or made (NotADirectoryError" in warning and KEY_VARIABLE in warning, warning


def test_a_process_that_loses_the_race_to_make_the_key_uses_the_winners(key_file, monkeypatch):
    winner = os.urandom(32)
    link = os.link

    def another_host_links_first(source, destination):
        key_file.write_bytes(winner)
        key_file.chmod(0o600)
        link(source, destination)

    monkeypatch.setattr(os, "link", another_host_links_first)
    assert compile_cache.read_or_create_key(key_file) == winner
    assert os.listdir(key_file.parent) == [key_file.name]  # the loser's own key is gone


def make_key(path, start, keys):
    start.wait()
    keys.put(compile_cache.read_or_create_key(path))


def test_processes_making_the_key_at_once_all_end_with_one_key(key_file):
    context = multiprocessing.get_context("fork")
    processes, start, keys = 8, context.Barrier(8), context.Queue()
    workers = [context.Process(target=make_key, args=(key_file, start, keys)) for _ in range(processes)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=60)
    assert [worker.exitcode for worker in workers] == [0] * processes
    made = [keys.get(timeout=5) for _ in workers]
    assert set(made) == {key_file.read_bytes()}
    assert os.listdir(key_file.parent) == [key_file.name]


# --- fencing --------------------------------------------------------------------------------------

def test_a_refused_publish_leaves_the_old_file_and_training_goes_on(inductor, key_file, checkpoints, caplog):
    before = saved(checkpoints)
    inductor.count, inductor.artifacts = 3, ARTIFACTS + b"more"

    def lease_lost():
        raise RuntimeError("the lease of ckpt is held by host-b")

    saved(checkpoints, before_publish=lease_lost)  # no exception: training goes on
    assert (checkpoints / CACHE_FILE).read_bytes() == before
    assert os.listdir(checkpoints) == [CACHE_FILE]  # no temporary file left
    [warning] = warnings(caplog)
    assert "no longer owns the checkpoint directory" in warning and "held by host-b" in warning, warning


def test_publish_is_checked_right_before_the_rename(inductor, key_file, checkpoints):
    before = saved(checkpoints)
    inductor.count, inductor.artifacts = 3, ARTIFACTS + b"more"
    seen = []
    after = saved(checkpoints, before_publish=lambda: seen.append((checkpoints / CACHE_FILE).read_bytes()))
    assert seen == [before]  # called once, the new file written but not yet in place
    assert after.endswith(b"\n" + ARTIFACTS + b"more")


def test_a_failed_write_is_not_taken_for_a_refused_publish(inductor, key_file, checkpoints, monkeypatch):
    def full_disk(path, write, before_rename=None):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(compile_cache, "write_atomically", full_disk)
    with pytest.raises(OSError, match="No space left"):
        saved(checkpoints, before_publish=lambda: None)
