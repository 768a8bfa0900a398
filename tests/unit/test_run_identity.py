"""Who owns a checkpoint directory, and whether a checkpoint's settings are this run's."""
import logging
import os
import signal
import subprocess
import sys

import pytest

from hvdtrain.checkpoint import CheckpointError
from hvdtrain.checkpoint.formats.compatibility import check_settings, differing_settings
from hvdtrain.checkpoint.ownership import OWNER, Ownership, read_owner

LOG = logging.getLogger("test")


def claim_in_another_process(directory, then):
    """A Python process that owns ``directory``, then runs ``then`` (its own code)."""
    code = ("import logging, os, sys; from hvdtrain.checkpoint.ownership import Ownership; "
            f"Ownership.claim({str(directory)!r}, logging.getLogger()); print(os.getpid(), flush=True); {then}")
    return subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def test_a_live_owner_is_named_and_its_end_frees_the_directory(tmp_path):
    holder = claim_in_another_process(tmp_path, "sys.stdin.read()")
    pid = int(holder.stdout.readline())
    with pytest.raises(CheckpointError, match=rf"is in use by a live run \(pid {pid} on .*, started "):
        Ownership.claim(tmp_path, LOG)
    holder.communicate("", timeout=30)  # it releases on its way out
    ownership = Ownership.claim(tmp_path, LOG)
    assert read_owner(tmp_path).pid == os.getpid()
    ownership.release()
    assert not (tmp_path / OWNER).exists()


def test_a_killed_owner_is_reported_and_taken_over(tmp_path, caplog):
    holder = claim_in_another_process(tmp_path, "os.kill(os.getpid(), 9)")
    pid = int(holder.stdout.readline())
    assert holder.wait(timeout=30) == -signal.SIGKILL
    with caplog.at_level(logging.WARNING):
        ownership = Ownership.claim(tmp_path, LOG)
    assert f"its previous owner (pid {pid} on " in caplog.text and "takes it over" in caplog.text
    assert read_owner(tmp_path).pid == os.getpid()
    ownership.release()


def test_trainers_of_one_process_share_its_claim(tmp_path):
    first = Ownership.claim(tmp_path, LOG)
    second = Ownership.claim(tmp_path / ".." / tmp_path.name, LOG)  # the same directory, spelt otherwise
    assert second is first
    first.release()
    assert read_owner(tmp_path).pid == os.getpid()  # the second user still holds it
    second.release()
    assert read_owner(tmp_path) is None


SAVED = {"train": {"lr": 0.05, "seed": 3, "max_steps": 30, "strategy": "ddp"}, "model": {"hidden": 32}}


def test_only_the_settings_that_define_the_run_must_match():
    longer_elsewhere = {"train": {**SAVED["train"], "max_steps": 90, "strategy": "zero2"}, "model": {"hidden": 32}}
    assert differing_settings(SAVED, longer_elsewhere) == []
    other = {"train": {**SAVED["train"], "lr": 0.1}, "model": {"hidden": 64, "dropout": 0.1}}
    assert differing_settings(SAVED, other) == [
        "model.dropout: '(absent)' -> 0.1", "model.hidden: 32 -> 64", "train.lr: 0.05 -> 0.1"]


def test_a_setting_newer_than_the_checkpoint_is_compared_with_its_default():
    """A checkpoint written before train.lr_schedule existed trained at a constant rate."""
    assert "lr_schedule" not in SAVED["train"]
    assert differing_settings(SAVED, {"train": {**SAVED["train"], "lr_schedule": "constant"}, "model": {"hidden": 32}}) == []
    assert differing_settings(SAVED, {"train": {**SAVED["train"], "lr_schedule": "cosine"}, "model": {"hidden": 32}}) == [
        "train.lr_schedule: 'constant' -> 'cosine'"]


def test_a_checkpoint_of_other_settings_is_refused_unless_forced(caplog):
    other = {"train": {**SAVED["train"], "lr": 0.1}, "model": {"hidden": 32}}
    checkpoint = {"config": SAVED, "step": 30}
    with pytest.raises(CheckpointError, match=r"the checkpoint of step 30 was written with other settings than "
                                              r"this run's: train.lr: 0.05 -> 0.1\. .*train.resume=force"):
        check_settings(checkpoint, other, force=False, log=LOG)
    with caplog.at_level(logging.WARNING):
        check_settings(checkpoint, other, force=True, log=LOG)
    assert "train.resume=force" in caplog.text and "train.lr: 0.05 -> 0.1" in caplog.text
    check_settings({"step": 30}, other, force=False, log=LOG)  # recorded no settings: nothing to compare
