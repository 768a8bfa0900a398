"""Checkpoint integrity, in one process: every format's checksum (xxh3_128, hashed as written; old
manifests' sha256 still read), a corrupt checkpoint set aside and the previous one read, a sharded
publish killed between its renames recovered, and `hvdtrain checkpoint verify`."""
import json
import logging
import os

import pytest
import torch
import xxhash
from safetensors.torch import save_file

from hvdtrain import cli
from hvdtrain.checkpoint import CorruptCheckpoint
from hvdtrain.checkpoint.consolidate import consolidate
from hvdtrain.checkpoint.formats import sharded
from hvdtrain.checkpoint.formats import full as full_format
from hvdtrain.checkpoint.formats.full import FORMAT_VERSION, CheckpointStore
from tests.unit.test_sharded_checkpoint import model, optimizer_for, parts_of, save_sharded


@pytest.fixture(scope="module")
def trained():
    """A model and its AdamW state after 2 steps (test_sharded_checkpoint's layout)."""
    net = model()
    optimizer = optimizer_for(net)
    for step in range(2):
        inputs = torch.randn(8, 6, generator=torch.Generator().manual_seed(step), dtype=torch.float64)
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(net(inputs), torch.arange(8) % 3).backward()
        optimizer.step()
    return {"model": net.state_dict(), "optimizer": optimizer.state_dict()}


def state(step, size=4000):
    """A full checkpoint whose file is mostly one tensor's bytes (a flipped byte mid-file lands in it)."""
    return {"format": FORMAT_VERSION, "model": {"w": torch.arange(size, dtype=torch.float32) * step},
            "optimizer": {"state": {}, "param_groups": []}, "scheduler": {"last_epoch": step},
            "epoch": 0, "step": step, "epoch_position": 0, "global_batch": 64, "world_size": 2}


def flip_a_byte(path, where=None):
    data = bytearray(path.read_bytes())
    data[len(data) // 2 if where is None else where] ^= 0x10
    path.write_bytes(bytes(data))


# --- the full format -------------------------------------------------------------------------------

def test_a_full_checkpoint_carries_its_xxh3_checksum_hashed_as_written(tmp_path):
    path = CheckpointStore(tmp_path).save(state(10), 10)
    record = json.loads(full_format.checksum_path(path).read_text())
    data = path.read_bytes()
    assert record == {"name": "ckpt-000000010.pt", "bytes": len(data), "xxh3_128": xxhash.xxh3_128_hexdigest(data)}


def test_a_flipped_bit_in_a_full_checkpoint_is_found_and_it_is_set_aside_for_the_previous_one(tmp_path, caplog):
    """torch.load reads a full checkpoint with a flipped bit in a tensor without a word: it resumed."""
    store = CheckpointStore(tmp_path, keep=3)
    store.save(state(10), 10)
    newest = store.save(state(20), 20)
    flip_a_byte(newest)
    with pytest.raises(CorruptCheckpoint, match=r"ckpt-000000020.pt does not match .*ckpt-000000020.pt.checksum: "
                                                r"its xxh3_128 is [0-9a-f]{32}, [0-9a-f]{32} was written"):
        CheckpointStore.read(newest)
    with caplog.at_level(logging.WARNING):
        path, loaded = store.read_newest_valid(set_aside=True)
    assert path.name == "ckpt-000000010.pt" and loaded["step"] == 10
    assert "the checkpoint " + str(newest) + " is corrupt (" in caplog.text
    assert "set aside as ckpt-000000020.pt.corrupt; falling back to the previous checkpoint" in caplog.text
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "ckpt-000000010.pt", "ckpt-000000010.pt.checksum", "ckpt-000000020.pt.corrupt",
        "ckpt-000000020.pt.corrupt.checksum", "latest"]
    # Set aside, it is never listed, pruned or counted as a leftover; the next save of step 20 is a new one.
    store.save(state(20), 20)
    for step in (30, 40, 50):
        store.save(state(step), step)
    assert store.remove_leftovers() == (0, 0)
    assert (tmp_path / "ckpt-000000020.pt.corrupt").exists() and [s for s, _ in store.steps()] == [50, 40, 30]


def test_a_full_checkpoint_without_a_checksum_still_loads_with_a_warning(tmp_path, caplog):
    path = tmp_path / "ckpt-000000010.pt"
    torch.save(state(10), path)  # written before checksums, or by hand
    with caplog.at_level(logging.WARNING):
        assert CheckpointStore(tmp_path).read_newest_valid(set_aside=True)[1]["step"] == 10
    assert f"{path} has no checksum (ckpt-000000010.pt.checksum): it is read unverified" in caplog.text


def test_a_step_saved_again_gets_its_own_checksum_and_a_kill_before_it_leaves_none(tmp_path, monkeypatch):
    store = CheckpointStore(tmp_path)
    store.save(state(10), 10)
    path = store.save(state(10, size=3000), 10)
    assert CheckpointStore.read(path)["model"]["w"].numel() == 3000  # its checksum is the new file's
    real = full_format.write_atomically

    def killed_before_the_checksum(target, write, before_rename=None):
        if target.name.endswith(".checksum"):
            raise KeyboardInterrupt
        real(target, write, before_rename)
    monkeypatch.setattr(full_format, "write_atomically", killed_before_the_checksum)
    with pytest.raises(KeyboardInterrupt):
        store.save(state(10, size=2000), 10)
    # Never the old file's checksum beside the new file (which would set a sound checkpoint aside).
    assert not full_format.checksum_path(path).exists()
    assert CheckpointStore.read(path)["model"]["w"].numel() == 2000


def test_a_checksum_whose_checkpoint_is_gone_is_a_leftover(tmp_path):
    store = CheckpointStore(tmp_path)
    store.save(state(10), 10)
    (tmp_path / "ckpt-000000005.pt.checksum").write_text('{"bytes": 1}')
    (tmp_path / ".ckpt-000000020.pt.checksum.tmp-12").write_text("{")
    assert store.remove_leftovers() == (2, 13)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-000000010.pt", "ckpt-000000010.pt.checksum", "latest"]


def test_a_name_already_set_aside_is_not_overwritten(tmp_path):
    store = CheckpointStore(tmp_path)
    for _ in range(2):
        store.save(state(10), 10)
        store.set_aside(tmp_path / "ckpt-000000010.pt")
    assert sorted(p.name for p in tmp_path.iterdir() if "corrupt" in p.name) == [
        "ckpt-000000010.pt.corrupt", "ckpt-000000010.pt.corrupt-2", "ckpt-000000010.pt.corrupt-2.checksum",
        "ckpt-000000010.pt.corrupt.checksum"]


# --- the sharded format ----------------------------------------------------------------------------

def test_a_sharded_checkpoint_with_a_flipped_bit_is_set_aside_and_the_previous_one_read(tmp_path, trained, caplog):
    store = CheckpointStore(tmp_path, keep=3)
    parts = parts_of(trained)
    save_sharded(tmp_path, 10, parts, store)
    newest = save_sharded(tmp_path, 20, parts, store)
    victim = newest / sharded.shard_name(1, 2)
    flip_a_byte(victim)
    with caplog.at_level(logging.WARNING):
        path, manifest = store.read_newest_valid(set_aside=True, verify_shards=True)
    assert path.name == "ckpt-000000010" and manifest["step"] == 10
    assert f"{victim} does not match {newest / 'manifest.json'}: its xxh3_128 is" in caplog.text
    assert "set aside as ckpt-000000020.corrupt" in caplog.text
    assert (tmp_path / "ckpt-000000020.corrupt" / "rank-00001-of-00002.pt").exists() and not newest.exists()


def test_a_manifest_of_sha256_checksums_is_still_checked(tmp_path, trained):
    """Checkpoints written before xxh3: their manifests name sha256."""
    path = save_sharded(tmp_path, 10, parts_of(trained))
    manifest = json.loads((path / sharded.MANIFEST).read_text())
    for entry in manifest["files"]:
        import hashlib
        del entry["xxh3_128"]
        entry["sha256"] = hashlib.sha256((path / entry["name"]).read_bytes()).hexdigest()
    (path / sharded.MANIFEST).write_text(json.dumps(manifest))
    read = sharded.read_manifest(path)
    sharded.read_shard(path, read, 0)
    flip_a_byte(path / sharded.shard_name(1, 2))
    with pytest.raises(CorruptCheckpoint, match="rank-00001-of-00002.pt does not match .*: its sha256 is"):
        sharded.read_shard(path, read, 1)


def killed_between_the_renames(monkeypatch, calls_before_the_kill):
    """A kill (KeyboardInterrupt) at the ``calls_before_the_kill``+1-th rename of a directory (a
    file's atomic write, the manifest's, goes through)."""
    real, calls = os.replace, []

    def replace(source, target):
        if os.path.isdir(source):
            calls.append((source, target))
            if len(calls) > calls_before_the_kill:
                raise KeyboardInterrupt("killed")
        real(source, target)
    monkeypatch.setattr(sharded.os, "replace", replace)
    return calls


@pytest.mark.parametrize("resaved", [True, False], ids=["same-step-resaved", "new-step"])
def test_a_publish_killed_between_its_renames_is_restored_at_the_next_start(tmp_path, trained, monkeypatch,
                                                                            resaved):
    """Re-saving step 20: final -> .ckpt-20.old, then the complete .ckpt-20.tmp -> final. Killed
    between them, the start removed both hidden directories: the checkpoint was lost."""
    store = CheckpointStore(tmp_path, keep=3)
    parts = parts_of(trained)
    save_sharded(tmp_path, 10, parts, store)
    if resaved:
        save_sharded(tmp_path, 20, parts, store)
    killed_between_the_renames(monkeypatch, calls_before_the_kill=1 if resaved else 0)
    with pytest.raises(KeyboardInterrupt):
        save_sharded(tmp_path, 20, parts, store)
    monkeypatch.undo()
    left = sorted(p.name for p in tmp_path.iterdir())
    assert ".ckpt-000000020.tmp" in left and "ckpt-000000020" not in left
    assert (".ckpt-000000020.old" in left) == resaved

    removed, _ = store.remove_leftovers()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-000000010", "ckpt-000000020", "latest"]
    assert removed == int(resaved)  # the old directory, once the new one is in place
    path, manifest = store.read_newest_valid(set_aside=True, verify_shards=True)
    assert path.name == "ckpt-000000020" and manifest["step"] == 20


def test_a_publish_killed_before_its_first_rename_keeps_the_step_in_place(tmp_path, trained, monkeypatch):
    store = CheckpointStore(tmp_path)
    parts = parts_of(trained)
    save_sharded(tmp_path, 20, parts, store)
    before = (tmp_path / "ckpt-000000020" / sharded.MANIFEST).read_text()
    killed_between_the_renames(monkeypatch, calls_before_the_kill=0)
    with pytest.raises(KeyboardInterrupt):
        save_sharded(tmp_path, 20, parts, store)
    monkeypatch.undo()
    assert store.remove_leftovers()[0] == 1  # the temporary directory: the step's own stays
    assert (tmp_path / "ckpt-000000020" / sharded.MANIFEST).read_text() == before


# --- hvdtrain checkpoint verify -----------------------------------------------------------------

def test_verify_says_ok_of_every_format_and_names_what_is_wrong(tmp_path, trained, capsys):
    parts = parts_of(trained)
    directory = save_sharded(tmp_path, 20, parts)
    assert cli.main(["checkpoint", "verify", str(directory)]) == 0
    out = capsys.readouterr().out
    assert f"OK {directory}: step 20, sharded, 2 files, strategy zero2; 2 files match their checksums" in out
    assert cli.main(["checkpoint", "consolidate", str(directory)]) == 0
    consolidated = tmp_path / "ckpt-000000020.pt"
    assert full_format.checksum_path(consolidated).exists()  # consolidate writes its checksum too
    capsys.readouterr()
    assert cli.main(["checkpoint", "verify", str(consolidated)]) == 0
    assert f"OK {consolidated}: step 20, full, strategy zero2; 1 file matches its checksum" in capsys.readouterr().out

    flip_a_byte(directory / sharded.shard_name(0, 2))
    assert cli.main(["checkpoint", "verify", str(directory)]) == 1
    assert f"FAILED {directory}: {directory / sharded.shard_name(0, 2)} does not match" in capsys.readouterr().out
    assert cli.main(["checkpoint", "verify", str(tmp_path)]) == 1  # a checkpoint_dir: each checkpoint
    out = capsys.readouterr().out
    assert f"OK {consolidated}" in out and f"FAILED {directory}" in out and "1 of 2 checkpoints OK" in out

    full_format.checksum_path(consolidated).unlink()
    assert cli.main(["checkpoint", "verify", str(consolidated)]) == 0
    assert "note: " in capsys.readouterr().out
    assert cli.main(["checkpoint", "verify", str(tmp_path / "nothing")]) == 1
    assert "nothing does not exist" in capsys.readouterr().err


def test_verify_compares_checkpoints_of_any_layout_bitwise(tmp_path, trained, capsys):
    two = save_sharded(tmp_path / "two", 20, parts_of(trained, size=2))
    four = save_sharded(tmp_path / "four", 20, parts_of(trained, size=4))
    full = tmp_path / "full.pt"
    full_format.write_full(full, consolidate(two))
    for a, b in ((two, four), (four, full), (full, two)):
        assert cli.main(["checkpoint", "verify", str(a), str(b)]) == 0, capsys.readouterr()
        out = capsys.readouterr().out
        assert "identical: " in out and "tensors compared bitwise" in out

    changed = consolidate(two)
    changed["model"]["0.weight"] = changed["model"]["0.weight"].clone()
    changed["model"]["0.weight"][1, 2] += 0.25
    changed["optimizer"]["state"][0]["exp_avg"] = changed["optimizer"]["state"][0]["exp_avg"].clone()
    changed["optimizer"]["state"][0]["exp_avg"][0, 0] = -1.0
    other = tmp_path / "other.pt"
    full_format.write_full(other, changed)
    assert cli.main(["checkpoint", "verify", str(four), str(other)]) == 1
    out = capsys.readouterr().out
    assert "2 difference(s)" in out
    assert "model 0.weight: 1 of 30 elements differ, the first at index (1, 2)" in out
    assert "max |A - B| 0.25" in out
    assert "optimizer exp_avg of parameter 0 (0.weight): 1 of 30 elements differ, the first at index (0, 0)" in out


def test_verify_compares_a_checkpoint_with_a_hugging_face_directory_model_only(tmp_path, trained, capsys):
    two = save_sharded(tmp_path, 20, parts_of(trained))
    weights = tmp_path / "hf"
    weights.mkdir()
    model = {name: tensor.clone().contiguous() for name, tensor in trained["model"].items()}
    save_file(model, str(weights / "model.safetensors"))
    assert cli.main(["checkpoint", "verify", str(two), str(weights)]) == 0
    out = capsys.readouterr().out
    assert "identical: " in out and "optimizer state not compared: B holds none (model only)" in out
    assert cli.main(["checkpoint", "verify", str(weights)]) == 0
    assert "OK " in capsys.readouterr().out

    model["3.bias"] = model["3.bias"].to(torch.float32)
    del model["1.running_var"]
    save_file(model, str(weights / "model.safetensors"))
    assert cli.main(["checkpoint", "verify", str(two), str(weights)]) == 1
    out = capsys.readouterr().out
    assert "model 1.running_var: only in A" in out
    assert "model 3.bias: float64 of shape [3] in A, float32 of shape [3] in B" in out
