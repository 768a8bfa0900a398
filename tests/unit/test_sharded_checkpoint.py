"""Sharded checkpoints on disk, in one process: two ranks simulated (ZeRO's layout needs no
collective to cut a full state into rank r's part), the manifest checked, both kinds pruned
together, an interrupted save ignored, and `hvdtrain checkpoint consolidate`."""
import json
import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hvdtrain import cli
from hvdtrain.checkpoint.formats import sharded
from hvdtrain.checkpoint.consolidate import consolidate
from hvdtrain.checkpoint.formats.full import FORMAT_VERSION, CheckpointError, CheckpointStore
from hvdtrain.config.train import TrainConfig
from hvdtrain.distributed.startup import World
from hvdtrain.strategies.fsdp.strategy import FSDPStrategy
from hvdtrain.strategies.zero import Zero2Strategy

WORLD_SIZE = 2


def world(rank, size=WORLD_SIZE):
    return World(rank=rank, size=size, local_rank=rank, local_size=size, cross_rank=0, cross_size=1,
                 hostname="nodeA", controller="mpi", launcher="test", threads=1, device=torch.device("cpu"))


def model(seed=0):
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(6, 5), nn.BatchNorm1d(5), nn.Tanh(), nn.Linear(5, 3)).double()
    return net


def optimizer_for(net):
    weights = [p for n, p in net.named_parameters() if n.endswith("weight")]
    others = [p for n, p in net.named_parameters() if not n.endswith("weight")]
    return torch.optim.AdamW([{"params": weights, "lr": 0.02, "weight_decay": 0.1},
                              {"params": others, "lr": 0.005, "weight_decay": 0.0}], betas=(0.8, 0.95))


@pytest.fixture(scope="module")
def trained():
    """The full state of one process after 3 AdamW steps: what ddp's checkpoint would hold."""
    net = model()
    optimizer = optimizer_for(net)
    generator = torch.Generator().manual_seed(1)
    for _ in range(3):
        inputs = torch.randn(8, 6, generator=generator, dtype=torch.float64)
        optimizer.zero_grad()
        F.cross_entropy(net(inputs), torch.arange(8) % 3).backward()
        optimizer.step()
    return {"model": net.state_dict(), "optimizer": optimizer.state_dict()}


def parts_of(full, size=WORLD_SIZE):
    """Every rank's own part of ``full``, as zero2 on ``size`` ranks holds it (small buckets: several)."""
    parts = []
    for rank in range(size):
        net = model(seed=10 + rank)
        strategy = Zero2Strategy(net, optimizer_for(net), world(rank, size), 1, False, bucket_bytes=15 * 8)
        strategy.load_state_dict(full)  # local: each rank keeps its slices of the full state
        parts.append(strategy.shard_state_dict())
        strategy.close()
    return parts


def run_state(step):
    return {"scheduler": {"last_epoch": step, "base_lrs": [0.1, 0.025]}, "epoch": 1, "step": step,
            "epoch_position": 64, "global_batch": 32, "config": {"train": {"strategy": "zero2"}},
            "precision": {"name": "fp16", "scale": 512.0, "good_steps": 3, "skipped_steps": 1}}


def save_sharded(directory, step, parts, store=None, publish=True):
    """What every rank, then rank 0, do in a sharded save (hvdtrain.checkpoint.coordination), in one process."""
    temporary = sharded.temporary_directory(directory, step)
    sharded.prepare(temporary)
    records = [sharded.write_shard(temporary, rank, len(parts), {"strategy": part, "rng": {"torch": torch.ones(2)}})
               for rank, part in enumerate(parts)]
    if not publish:
        return temporary
    path = sharded.publish(directory, step, "zero2", records, run_state(step))
    (store or CheckpointStore(directory)).point_latest_at(path, step)
    return path


def full_state(step):
    return {"format": FORMAT_VERSION, "model": {"w": torch.full((3,), float(step))},
            "optimizer": {"state": {}, "param_groups": []}, "scheduler": {"last_epoch": step},
            "epoch": 0, "step": step, "epoch_position": 0, "global_batch": 64, "world_size": 2}


def same_optimizer_state(ours, theirs):
    if ours["param_groups"] != theirs["param_groups"] or list(ours["state"]) != list(theirs["state"]):
        return False
    return all(list(ours["state"][i]) == list(s) and all(torch.equal(ours["state"][i][k], v) for k, v in s.items())
               for i, s in theirs["state"].items())


def test_the_parts_of_every_rank_consolidate_into_exactly_the_full_state(tmp_path, trained):
    parts = parts_of(trained)
    path = save_sharded(tmp_path, 30, parts)
    full = consolidate(path)

    assert sorted(p.name for p in path.iterdir()) == ["manifest.json", "rank-00000-of-00002.pt", "rank-00001-of-00002.pt"]
    assert list(full["model"]) == list(trained["model"])  # the BatchNorm's buffers included
    assert all(torch.equal(full["model"][k], v) for k, v in trained["model"].items())
    assert same_optimizer_state(full["optimizer"], trained["optimizer"])
    assert full["optimizer"]["param_groups"][0]["betas"] == (0.8, 0.95)  # a tuple still, as torch wrote it
    assert (full["step"], full["world_size"], full["strategy"], full["format"]) == (30, 2, "zero2", FORMAT_VERSION)
    assert full["scheduler"] == run_state(30)["scheduler"] and len(full["rng"]) == 2
    assert full["precision"] == run_state(30)["precision"]  # fp16's loss scale survives consolidation
    # Each rank's file holds its slices only (torch.save writes a view's whole storage: a ZeRO
    # shard is a view of its full bucket, so it must be saved as a copy of its own).
    assert sum(len(part["params"][0]) for part in parts) == parts[0]["layout"]["buckets"][0]["padded_numel"]
    for rank in range(2):
        own = torch.load(path / f"rank-0000{rank}-of-00002.pt", weights_only=True)["strategy"]
        tensors = own["params"] + [v for s in own["optimizer"]["state"].values() for v in s.values()]
        assert all(t.untyped_storage().nbytes() == t.numel() * t.element_size() for t in tensors)


def test_the_manifest_records_every_file_and_the_run_state(tmp_path, trained):
    path = save_sharded(tmp_path, 30, parts_of(trained))
    manifest = json.loads((path / "manifest.json").read_text())
    assert (manifest["kind"], manifest["strategy"], manifest["world_size"], manifest["step"]) == ("sharded", "zero2", 2, 30)
    assert [(f["name"], f["rank"], f["bytes"]) for f in manifest["files"]] == [
        (f"rank-0000{r}-of-00002.pt", r, (path / f"rank-0000{r}-of-00002.pt").stat().st_size) for r in range(2)]
    assert all(len(f["xxh3_128"]) == 32 for f in manifest["files"])  # hashed as written (xxhash)
    assert manifest["epoch_position"] == 64 and manifest["config"] == {"train": {"strategy": "zero2"}}


def broken(manifest_path, change):
    manifest = json.loads(manifest_path.read_text())
    change(manifest)
    manifest_path.write_text(json.dumps(manifest))


@pytest.mark.parametrize("damage,message", [
    (lambda p: (p / "manifest.json").unlink(), "has no manifest.json: not a complete sharded checkpoint"),
    (lambda p: (p / "manifest.json").write_text("{half"), "manifest.json is garbled: JSONDecodeError"),
    (lambda p: broken(p / "manifest.json", lambda m: m.pop("scheduler")), "not an hvdtrain manifest: missing scheduler"),
    (lambda p: broken(p / "manifest.json", lambda m: m.update(format=7)), "has format 7 (sharded), this hvdtrain reads 1"),
    (lambda p: broken(p / "manifest.json", lambda m: m.update(world_size=3)), "expected one file per rank"),
    (lambda p: (p / "rank-00001-of-00002.pt").unlink(), "rank-00001-of-00002.pt is missing"),
    (lambda p: (p / "rank-00000-of-00002.pt").write_bytes(b"short"), "rank-00000-of-00002.pt has 5 bytes"),
])
def test_a_bad_manifest_or_a_missing_file_is_refused_naming_it(tmp_path, trained, damage, message):
    path = save_sharded(tmp_path, 30, parts_of(trained))
    damage(path)
    with pytest.raises(CheckpointError, match=message.replace("(", r"\(").replace(")", r"\)")):
        sharded.read_manifest(path)


def test_a_file_with_its_size_but_not_its_content_is_found_by_its_reader(tmp_path, trained):
    path = save_sharded(tmp_path, 30, parts_of(trained))
    victim = path / "rank-00001-of-00002.pt"
    data = bytearray(victim.read_bytes())
    data[100] ^= 0xFF
    victim.write_bytes(bytes(data))
    manifest = sharded.read_manifest(path)  # sizes only: rank 0 does not read every rank's file
    sharded.read_shard(path, manifest, 0)
    with pytest.raises(CheckpointError, match="rank-00001-of-00002.pt does not match .*manifest.json"):
        sharded.read_shard(path, manifest, 1)


def test_both_kinds_are_pruned_together_and_a_consolidated_file_stays_with_its_directory(tmp_path, trained):
    store = CheckpointStore(tmp_path, keep=2)
    parts = parts_of(trained)
    store.save(full_state(10), 10)
    save_sharded(tmp_path, 20, parts, store)
    store.save(full_state(30), 30)
    assert [(step, p.name) for step, p in store.steps()] == [(30, "ckpt-000000030.pt"), (20, "ckpt-000000020")]
    save_sharded(tmp_path, 40, parts, store)
    (tmp_path / "ckpt-000000040.pt").write_bytes(b"consolidated")  # hvdtrain checkpoint consolidate's output
    store.save(full_state(50), 50)
    assert [(step, p.name) for step, p in store.steps()] == [
        (50, "ckpt-000000050.pt"), (40, "ckpt-000000040.pt"), (40, "ckpt-000000040")]
    assert sorted(p.name for p in tmp_path.iterdir()) == [  # each full file's checksum pruned with it
        "ckpt-000000040", "ckpt-000000040.pt", "ckpt-000000050.pt", "ckpt-000000050.pt.checksum", "latest"]


def test_at_the_same_step_the_full_checkpoint_wins(tmp_path, trained):
    store = CheckpointStore(tmp_path)
    path = save_sharded(tmp_path, 20, parts_of(trained), store)
    assert store.read_newest_valid()[1]["kind"] == "sharded"
    CheckpointStore(tmp_path).save(consolidate(path), 20)
    newest, state = store.read_newest_valid()
    assert newest.name == "ckpt-000000020.pt" and "kind" not in state and state["step"] == 20


def test_a_save_killed_before_its_manifest_leaves_the_previous_checkpoint_in_use(tmp_path, trained, caplog):
    store = CheckpointStore(tmp_path, keep=3)
    parts = parts_of(trained)
    save_sharded(tmp_path, 10, parts, store)
    # Killed after every rank wrote its file, before rank 0 published: only the hidden directory exists.
    temporary = save_sharded(tmp_path, 20, parts, store, publish=False)
    assert temporary.name == ".ckpt-000000020.tmp" and len(list(temporary.iterdir())) == 2
    # A directory without a manifest (copied by hand, say) is not taken either.
    (tmp_path / "ckpt-000000025").mkdir()
    with caplog.at_level(logging.WARNING):
        path, state = store.read_newest_valid()
    assert path.name == "ckpt-000000010" and state["step"] == 10 and state["path"] == str(path)
    assert "ckpt-000000025 has no manifest.json" in caplog.text
    assert store.latest_pointer() == "ckpt-000000010"
    # The next save publishes its own and removes what the killed one left.
    save_sharded(tmp_path, 30, parts, store)
    assert not temporary.exists()
    assert [p.name for _, p in store.steps()] == ["ckpt-000000030", "ckpt-000000025", "ckpt-000000010"]


def test_a_rank_whose_file_rank_0_cannot_see_means_no_shared_filesystem(tmp_path, trained):
    temporary = sharded.temporary_directory(tmp_path, 20)
    sharded.prepare(temporary)
    records = [sharded.write_shard(temporary, rank, 2, {"strategy": part, "rng": {}})
               for rank, part in enumerate(parts_of(trained))]
    (temporary / records[1]["name"]).unlink()  # written on another host's own disk
    with pytest.raises(CheckpointError, match="rank 1 wrote rank-00001-of-00002.pt .* rank 0 does not see it: "
                                              "checkpoint_dir .* is not one directory shared by every rank"):
        sharded.publish(tmp_path, 20, "zero2", records, run_state(20))
    assert not (tmp_path / "ckpt-000000020").exists()


def test_only_the_same_worker_count_and_strategy_take_back_their_own_files():
    state = {"path": "/c/ckpt-000000020", "world_size": 4, "strategy": "fsdp"}
    assert sharded.resumes_as_written(state, "fsdp", 4)
    assert not sharded.resumes_as_written(state, "fsdp", 2) and not sharded.resumes_as_written(state, "zero2", 4)


def test_sharded_checkpoints_are_refused_with_ddp_when_the_settings_are_read():
    with pytest.raises(ValueError, match="checkpoint_format=sharded needs a strategy that shards the state .* "
                                         "got strategy=ddp: under ddp every rank holds the whole model .* "
                                         "Use checkpoint_format=full with ddp"):
        TrainConfig(checkpoint_format="sharded")
    with pytest.raises(ValueError, match="checkpoint_format must be one of full, sharded"):
        TrainConfig(checkpoint_format="zip")
    assert TrainConfig(strategy="fsdp", checkpoint_format="sharded").checkpoint_format == "sharded"


def test_consolidate_writes_the_full_file_beside_the_directory_and_refuses_to_overwrite(tmp_path, trained, capsys):
    path = save_sharded(tmp_path, 30, parts_of(trained))
    assert cli.main(["checkpoint", "consolidate", str(path)]) == 0
    out = tmp_path / "ckpt-000000030.pt"
    assert f"wrote {out}: the full checkpoint of step 30" in capsys.readouterr().out
    written = CheckpointStore.read(out)  # today's format: the resume path reads it
    assert all(torch.equal(written["model"][k], v) for k, v in trained["model"].items())
    assert same_optimizer_state(written["optimizer"], trained["optimizer"])

    assert cli.main(["checkpoint", "consolidate", str(path)]) == 1
    assert f"{out} exists: choose another --out, or --force" in capsys.readouterr().err
    assert cli.main(["checkpoint", "consolidate", str(path), "--force"]) == 0
    other = tmp_path / "elsewhere.pt"
    assert cli.main(["checkpoint", "consolidate", str(path), "--out", str(other)]) == 0 and other.exists()


@pytest.mark.parametrize("damage,message", [
    (lambda p: (p / "rank-00001-of-00002.pt").unlink(), "rank-00001-of-00002.pt is missing (listed in"),
    (lambda p: (p / "rank-00000-of-00002.pt").write_bytes(b"x" * (p / "rank-00000-of-00002.pt").stat().st_size),
     "rank-00000-of-00002.pt does not match"),
    (lambda p: (p / "manifest.json").unlink(), "has no manifest.json: not a sharded checkpoint"),
])
def test_consolidate_names_the_file_that_is_missing_or_corrupt(tmp_path, trained, capsys, damage, message):
    path = save_sharded(tmp_path, 30, parts_of(trained))
    damage(path)
    assert cli.main(["checkpoint", "consolidate", str(path)]) == 1
    err = capsys.readouterr().err
    assert message in err and str(path) in err
    assert not (tmp_path / "ckpt-000000030.pt").exists()


def test_consolidate_of_a_checkpoint_dir_points_at_its_newest_sharded_checkpoint(tmp_path, trained, capsys):
    save_sharded(tmp_path, 30, parts_of(trained))
    assert cli.main(["checkpoint", "consolidate", str(tmp_path)]) == 1
    assert f"the newest sharded checkpoint in it is {tmp_path / 'ckpt-000000030'}" in capsys.readouterr().err


def test_a_zero_strategy_cut_anew_for_another_world_holds_that_worlds_part(trained):
    """Horovod elastic's world change, rank 0 of 2 becoming rank 1 of 3: follow_world cuts the
    buckets for 3 ranks (each parameter keeps its value), the same optimizer object steps the new
    slice with its state dropped, and the full state loaded then is exactly what a strategy built
    as rank 1 of 3 holds."""
    net = model(seed=10)
    strategy = Zero2Strategy(net, optimizer_for(net), world(0, 2), 1, False, bucket_bytes=15 * 8)
    strategy.load_state_dict(trained)
    optimizer, hooks, values = strategy.optimizer, len(strategy._hooks), [p.detach().clone() for p in net.parameters()]

    strategy.follow_world(world(1, 3))
    assert strategy.optimizer is optimizer and not optimizer.state
    assert [p for g in optimizer.param_groups for p in g["params"]] == [b.shard for b in strategy.buckets]
    assert all(b.padded_numel % 3 == 0 and b.rank == 1 for b in strategy.buckets)
    assert all(torch.equal(p, v) for p, v in zip(net.parameters(), values))
    assert len(strategy._hooks) == hooks
    strategy.load_state_dict(trained)
    assert identical(strategy.shard_state_dict(), parts_of(trained, size=3)[1])
    strategy.close()


def test_an_fsdp_strategy_cut_anew_for_another_world_holds_that_worlds_part(trained):
    """As for ZeRO: fsdp's rank 0 of 2 re-cut as rank 1 of 3 (its units' buffers, shards at zero),
    then the full state loaded, holds exactly what fsdp built as rank 1 of 3 holds."""
    net = model(seed=10)
    strategy = FSDPStrategy(net, optimizer_for(net), world(0, 2), 1, False)
    strategy.load_state_dict(trained)
    optimizer = strategy.optimizer

    strategy.follow_world(world(1, 3))
    assert strategy.optimizer is optimizer and not optimizer.state
    assert all(b.padded_numel % 3 == 0 and b.rank == 1 and not b.shard.any() for b in strategy.buckets)
    strategy.load_state_dict(trained)
    fresh_net = model(seed=11)
    fresh = FSDPStrategy(fresh_net, optimizer_for(fresh_net), world(1, 3), 1, False)
    fresh.load_state_dict(trained)
    assert identical(strategy.shard_state_dict(), fresh.shard_state_dict())
    strategy.close()
    fresh.close()


def identical(ours, theirs) -> bool:
    """The same structure, and tensors equal bit for bit in the same dtype."""
    if isinstance(ours, torch.Tensor):
        return isinstance(theirs, torch.Tensor) and ours.dtype == theirs.dtype and torch.equal(ours, theirs)
    if isinstance(ours, dict):
        return isinstance(theirs, dict) and ours.keys() == theirs.keys() and all(identical(ours[k], theirs[k]) for k in ours)
    if isinstance(ours, (list, tuple)):
        return type(ours) is type(theirs) and len(ours) == len(theirs) and all(map(identical, ours, theirs))
    return ours == theirs


def sharded_source(trained):
    """zero2's parts of ``trained`` on 2 ranks, read as a sharded checkpoint of any layout is."""
    from hvdtrain.checkpoint.sources.sharded import ShardedSource
    return ShardedSource("ckpt", [{"strategy": part} for part in parts_of(trained)])


def test_a_read_outside_the_stored_tensor_is_refused_never_read_from_its_neighbour(trained):
    """0.weight holds 30 elements, 0.bias follows it in the bucket: a range past its end (or
    before its start) is refused naming the tensor, for the tensor and its optimizer state alike."""
    source = sharded_source(trained)
    weight = trained["model"]["0.weight"].reshape(-1)
    assert torch.equal(source.read("0.weight", 25, 30), weight[25:30])
    for start, stop in ((25, 35), (-1, 3), (0, 31), (31, 32), (4, 2)):
        with pytest.raises(CheckpointError, match=r"elements \[.*\) of 0.weight .* has 30 \(shape \[5, 6\]\)"):
            source.read("0.weight", start, stop)
    with pytest.raises(CheckpointError, match=r"of the optimizer's exp_avg of 0.weight"):
        source.read("0.weight", 20, 40, "exp_avg")


@pytest.mark.parametrize("width,dtype", [(4, torch.float64), (7, torch.float64), (5, torch.float32)],
                         ids=["smaller", "larger", "float32"])
def test_a_resharded_read_refuses_a_model_whose_tensors_differ_before_reading_any(trained, width, dtype):
    """The same names, a smaller or larger layer (or another dtype): zero1 reading zero2's
    checkpoint refuses it naming the tensor, the saved shape and dtype and this model's, instead of
    reading past one tensor into the next (smaller) or an IndexError (larger)."""
    from hvdtrain.strategies.zero import Zero1Strategy
    torch.manual_seed(3)
    net = nn.Sequential(nn.Linear(6, width), nn.BatchNorm1d(width), nn.Tanh(), nn.Linear(width, 3)).to(dtype)
    strategy = Zero1Strategy(net, optimizer_for(net), world(0), 1, False)
    # the buckets are filled from the last parameter: 3.weight is the first one checked
    with pytest.raises(CheckpointError, match=r"3.weight in ckpt is float64 of shape \[3, 5\], this model's "
                                              rf"{str(dtype)[6:]} of shape \[3, {width}\]: it belongs to another model"):
        strategy.read_part(sharded_source(trained))
    strategy.close()
