"""Checkpoint files: atomic, pruned, and read back safely or not at all."""
import logging

import pytest
import torch

from hvdtrain.checkpoint.formats import full as ckpt
from hvdtrain.checkpoint import CorruptCheckpoint
from hvdtrain.checkpoint.formats.full import CheckpointError, CheckpointStore


def state(step, **extra):
    base = {"format": ckpt.FORMAT_VERSION, "model": {"w": torch.full((3,), float(step))},
            "optimizer": {"state": {}, "param_groups": []}, "scheduler": {"last_epoch": step},
            "epoch": 0, "step": step, "epoch_position": 0, "global_batch": 64, "world_size": 2}
    base.update(extra)
    return base


def test_save_keeps_the_last_k_and_points_latest_at_the_newest(tmp_path):
    store = CheckpointStore(tmp_path, keep=2)
    for step in (10, 20, 30):
        store.save(state(step), step)
    assert [step for step, _ in store.steps()] == [30, 20]
    assert store.latest_pointer() == "ckpt-000000030.pt"
    path, loaded = store.read_newest_valid()
    assert path.name == "ckpt-000000030.pt" and torch.equal(loaded["model"]["w"], torch.full((3,), 30.0))


def test_a_truncated_newest_checkpoint_is_reported_and_the_previous_one_used(tmp_path, caplog):
    store = CheckpointStore(tmp_path, keep=3)
    store.save(state(10), 10)
    newest = store.save(state(20), 20)
    newest.write_bytes(newest.read_bytes()[:100])  # a disk that filled up, a copy cut short
    with caplog.at_level(logging.WARNING):
        path, loaded = store.read_newest_valid()
    assert path.name == "ckpt-000000010.pt" and loaded["step"] == 10
    assert "ckpt-000000020.pt has 100 bytes, " in caplog.text  # its checksum file says more
    assert "falling back to the previous checkpoint" in caplog.text


def test_a_save_killed_while_writing_leaves_the_previous_checkpoint_and_pointer(tmp_path, monkeypatch):
    store = CheckpointStore(tmp_path, keep=3)
    store.save(state(10), 10)

    def dies_half_way(obj, handle):
        handle.write(b"PK\x03\x04 half a checkpoint")
        raise KeyboardInterrupt("killed mid-save")

    monkeypatch.setattr(ckpt.torch, "save", dies_half_way)
    with pytest.raises(KeyboardInterrupt):
        store.save(state(20), 20)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != "latest") == [
        "ckpt-000000010.pt", "ckpt-000000010.pt.checksum"]
    assert store.latest_pointer() == "ckpt-000000010.pt"
    assert store.read_newest_valid()[1]["step"] == 10


def test_leftover_temporary_files_are_never_taken_for_checkpoints(tmp_path):
    store = CheckpointStore(tmp_path)
    store.save(state(10), 10)
    (tmp_path / ".ckpt-000000020.pt.tmp-1234").write_bytes(b"partial")
    assert [step for step, _ in store.steps()] == [10]


def test_loading_refuses_pickled_objects(tmp_path):
    class Payload:
        def __reduce__(self):
            return (print, ("this code must never run",))

    path = tmp_path / "ckpt-000000001.pt"
    torch.save(state(1, config=Payload()), path)
    with pytest.raises(CheckpointError, match=r"holds a value a resume does not read back \(weights_only: GLOBAL "
                                              r".*print\).*nothing was set aside") as refused:
        CheckpointStore.read(path)
    assert not isinstance(refused.value, CorruptCheckpoint)  # intact: it is not set aside


@pytest.mark.parametrize("content,message", [
    ({"model": {}}, "not an hvdtrain checkpoint: missing format, optimizer"),
    (state(1, format=99), "has format 99, this hvdtrain reads 1"),
    ([1, 2, 3], "not an hvdtrain checkpoint"),
])
def test_files_that_are_not_our_checkpoints_are_refused(tmp_path, content, message):
    path = tmp_path / "ckpt-000000001.pt"
    torch.save(content, path)
    with pytest.raises(CheckpointError, match=message):
        CheckpointStore.read(path)


def test_no_checkpoint_at_all_is_none_not_an_error(tmp_path):
    assert CheckpointStore(tmp_path / "new").read_newest_valid() is None
    with pytest.raises(ValueError, match="keep must be >= 1"):
        CheckpointStore(tmp_path, keep=0)


def test_pruning_keeps_the_save_just_written_and_never_touches_newer_steps(tmp_path):
    """A run that fell back from an unreadable newer checkpoint (or started below another run's
    steps) used to see each save deleted at once: the highest step numbers were kept."""
    store = CheckpointStore(tmp_path, keep=2)
    for step in (10, 20, 30):
        store.save(state(step), step)
    for step in (4, 8, 12):
        store.save(state(step), step)
    assert [step for step, _ in store.steps()] == [30, 20, 12, 8]
    assert store.latest_pointer() == "ckpt-000000012.pt"


def test_what_killed_saves_left_is_removed_and_counted(tmp_path):
    store = CheckpointStore(tmp_path)
    store.save(state(10), 10)
    (tmp_path / ".ckpt-000000020.pt.tmp-1234").write_bytes(b"x" * 1000)
    (tmp_path / ".latest.tmp-99").write_bytes(b"ckpt")
    (tmp_path / ".ckpt-000000030.tmp").mkdir()
    (tmp_path / ".ckpt-000000030.tmp" / "rank-00000-of-00002.pt").write_bytes(b"y" * 500)
    (tmp_path / ".ckpt-000000040.pt.tmp-77").touch()  # killed right after it was opened: still removed
    (tmp_path / "notes.txt").write_text("the user's own file")
    assert store.remove_leftovers() == (4, 1504)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "ckpt-000000010.pt", "ckpt-000000010.pt.checksum", "latest", "notes.txt"]
