"""Fencing: each irreversible step of a save checks the lease first, and what is published carries
the claim it was made under, so a resume tells a checkpoint published by a deposed owner.

Claims are stamped by hand here ({"generation": g, "token": t}): the lease itself is
tests/unit/test_checkpoint_lease.py's, a real takeover tests/launch/test_storage_faults.py's.
"""
import logging

import pytest
import torch

from hvdtrain.checkpoint import CheckpointError
from hvdtrain.checkpoint.formats import sharded
from hvdtrain.checkpoint.formats.full import CheckpointStore, lease_of
from hvdtrain.checkpoint.formats.run_state import RunState

LOG = logging.getLogger("test")


def state(step):
    return {"format": 1, "model": {"w": torch.full((4,), float(step))}, "optimizer": {}, "scheduler": {},
            "epoch": 0, "step": step, "epoch_position": step * 4, "global_batch": 4, "world_size": 1}


def claim(generation):
    return {"generation": generation, "token": f"token-{generation}"}


def saved_under(store, step, generation):
    store.stamp = claim(generation)
    return store.save(state(step), step)


def test_a_checkpoint_published_by_a_deposed_owner_is_set_aside_not_resumed(tmp_path, caplog):
    """Claim 1 published step 2; claim 2 took over and published step 4; claim 1, deposed, then
    published step 6 (stopped between its last fence and its rename): a later step of an older claim."""
    store = CheckpointStore(tmp_path, keep=5, log=LOG)
    saved_under(store, 2, 1)
    saved_under(store, 4, 2)
    saved_under(store, 6, 1)
    with caplog.at_level(logging.WARNING):
        path, found = CheckpointStore(tmp_path, keep=5, log=LOG).read_newest_valid(set_aside=True)
    assert path.name == "ckpt-000000004.pt" and found["step"] == 4
    assert (tmp_path / "ckpt-000000006.pt.deposed").is_file()
    assert "ckpt-000000006.pt was published under the directory's claim 1, though claim 2 had published step 4" \
           in caplog.text
    assert lease_of(tmp_path / "ckpt-000000006.pt.deposed") == claim(1)  # its checksum went with it


def test_claims_in_step_order_are_all_resumable(tmp_path):
    store = CheckpointStore(tmp_path, keep=5, log=LOG)
    for step, generation in ((2, 1), (4, 1), (6, 3), (8, 4)):
        saved_under(store, step, generation)
    path, _ = store.read_newest_valid(set_aside=True)
    assert path.name == "ckpt-000000008.pt" and store.generation_floor() == 4


def test_a_checkpoint_without_a_claim_is_not_judged(tmp_path):
    """Written by a tool (consolidate, a copy) or before fencing: nothing to compare, resumed as before."""
    store = CheckpointStore(tmp_path, keep=5, log=LOG)
    saved_under(store, 2, 3)
    store.stamp = None
    store.save(state(4), 4)
    path, _ = store.read_newest_valid(set_aside=True)
    assert path.name == "ckpt-000000004.pt" and lease_of(path) is None


class Fence:
    """A lease that holds for ``holds`` checks, then is lost (raises), counting every check."""

    def __init__(self, holds):
        self.holds, self.checks = holds, 0

    def __call__(self):
        self.checks += 1
        if self.checks > self.holds:
            raise CheckpointError("checkpoint_dir is no longer this run's")


def test_every_irreversible_step_of_a_full_save_is_fenced(tmp_path):
    """The old checksum's removal and the data's rename, the checksum's rename, `latest`, the prune:
    each comes after a check, and a check that fails stops the save before its step."""
    store = CheckpointStore(tmp_path, keep=1, log=LOG)
    store.save(state(2), 2)
    store.fence = counting = Fence(holds=10**6)
    store.save(state(4), 4)
    assert counting.checks == 5  # the old checksum's removal, the data, the checksum, latest, prune (of step 2)
    for holds in range(5):
        directory = tmp_path / f"lost-after-{holds}"
        store = CheckpointStore(directory, keep=1, log=LOG)
        store.save(state(2), 2)
        store.fence = Fence(holds)
        with pytest.raises(CheckpointError, match="no longer this run's"):
            store.save(state(4), 4)
        names = sorted(p.name for p in directory.iterdir())
        data, checksum = ["ckpt-000000004.pt"], ["ckpt-000000004.pt.checksum"]
        published = {0: [], 1: [], 2: data, 3: data + checksum, 4: data + checksum}[holds]
        assert names == sorted(["ckpt-000000002.pt", "ckpt-000000002.pt.checksum", "latest", *published]), holds
        assert (directory / "latest").read_text().strip() == ("ckpt-000000004.pt" if holds == 4 else "ckpt-000000002.pt")


def test_a_sharded_publish_is_fenced_and_carries_its_claim(tmp_path):
    run_state = RunState(epoch=0, step=4, epoch_position=16, global_batch=4, world_size=1, scheduler={}).shared()
    temporary = sharded.temporary_directory(tmp_path, 4, "a" * 32)
    assert temporary.name == ".ckpt-000000004.tmp-" + "a" * 16 and sharded.LEFTOVER.match(temporary.name)
    sharded.prepare(temporary)
    record = sharded.write_shard(temporary, 0, 1, {"strategy": {}, "rng": {}})
    with pytest.raises(CheckpointError, match="no longer this run's"):
        sharded.publish(tmp_path, 4, "zero1", [record], run_state, temporary, Fence(holds=0), claim(2))
    assert not (tmp_path / "ckpt-000000004").exists() and temporary.is_dir()
    published = sharded.publish(tmp_path, 4, "zero1", [record], run_state, temporary, Fence(holds=1), claim(2))
    assert lease_of(published) == claim(2)


def test_a_save_whose_state_would_not_load_back_writes_nothing(tmp_path):
    import datetime

    store = CheckpointStore(tmp_path, log=LOG)
    with pytest.raises(CheckpointError, match=r"the checkpoint's state\['callbacks'\]\[0\]\['when'\] is a "
                                              r"datetime.datetime"):
        store.save({**state(2), "callbacks": [{"when": datetime.datetime(2026, 11, 28)}]}, 2)
    assert list(tmp_path.iterdir()) == []
