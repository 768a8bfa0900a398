"""Sharded checkpoints under expert parallelism, without MPI: the E ranks of every expert group are
built in one process (the strategy's own split and optimizer cut), each writes its file as a save
does, and the files are read back as a resume, ``consolidate`` and ``export`` read them.

Every expert is written once (by the first expert group's ranks), the rest once (by rank 0), and the
files put together give the whole model and AdamW state bit for bit: a checkpoint moves values and
never computes with them."""
import copy

import pytest
import torch

from hvdtrain.checkpoint.consolidate import consolidate
from hvdtrain.checkpoint.formats import sharded
from hvdtrain.checkpoint.sources import sharded as sources
from hvdtrain.config.train import TrainConfig
from hvdtrain.parallel import experts as ep
from hvdtrain.parallel.mesh import Group
from hvdtrain.strategies import expert_shards
from tests.unit.test_expert_parallel import qwen3_experts

transformers = pytest.importorskip("transformers")


def trained_whole():
    """A Qwen3-MoE model (4 experts) and its AdamW after one step: every state entry set."""
    model, _ = qwen3_experts(experts=4, seed=3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    for parameter in model.parameters():
        parameter.grad = torch.randn_like(parameter)
    optimizer.step()
    return model, optimizer


def rank_of(whole, whole_optimizer, rank, world_size, experts):
    """Rank ``rank``'s model and optimizer at E=``experts``, split as ExpertParallelStrategy splits them."""
    from hvdtrain.strategies.experts import replace_experts

    model = copy.deepcopy(whole)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    optimizer.load_state_dict(whole_optimizer.state_dict())
    groups = ep.ExpertGroups(experts, Group(ep.expert_group_ranks(world_size, rank, experts), rank, None),
                             Group(ep.replica_group_ranks(world_size, rank, experts), rank, None), [])
    replace_experts(model, optimizer, groups)
    return model, optimizer


def written(directory, world_size, experts):
    """The whole model and optimizer, and the sharded checkpoint its ranks write at E=``experts``."""
    whole, optimizer = trained_whole()
    files = []
    temporary = sharded.temporary_directory(directory, 1)
    for rank in range(world_size):
        model, split_optimizer = rank_of(whole, optimizer, rank, world_size, experts)
        part = expert_shards.shard_part(model, split_optimizer, rank, world_size, experts)
        files.append(sharded.write_shard(temporary, rank, world_size, {"strategy": part, "rng": {}}))
    config = {"train": TrainConfig(expert_parallel=experts, checkpoint_format="sharded").to_dict()}
    run_state = {"scheduler": {}, "epoch": 0, "step": 1, "epoch_position": 8, "global_batch": 8, "precision": {},
                 "config": config}
    path = sharded.publish(directory, 1, "ddp", files, run_state)
    return whole, optimizer, path


def differences(ours, theirs):
    """Names (model) and (index, key) (optimizer state) whose values are not bit for bit the same."""
    wrong = [name for name in theirs["model"] if not torch.equal(ours["model"][name], theirs["model"][name])]
    for index, state in theirs["optimizer"]["state"].items():
        for key, value in state.items():
            mine = ours["optimizer"]["state"].get(index, {}).get(key)
            if not (torch.equal(mine, value) if isinstance(value, torch.Tensor) else mine == value):
                wrong.append((index, key))
    return wrong


@pytest.mark.parametrize("world_size, experts", [(2, 2), (4, 2), (4, 4)])
def test_each_expert_is_written_once_and_the_files_make_the_whole_state(tmp_path, world_size, experts):
    whole, optimizer, path = written(tmp_path, world_size, experts)
    manifest = sharded.read_manifest(path)
    source = sources.open_source(path, manifest)
    parts = [file["strategy"] for file in source.files]
    expert_names = [name for name, value in whole.state_dict().items() if name.endswith(("gate_up_proj", "down_proj"))
                    and value.dim() == 3]

    # Every expert once: the first expert group's ranks hold 1/E of each expert tensor (and of its
    # AdamW moments), the other groups' ranks none; the replicated rest by rank 0 alone.
    assert len(expert_names) == 2
    for name in expert_names:
        held = [part["model"][name].shape[0] for part in parts if name in part["model"]]
        assert held == [4 // experts] * experts, (name, held)
        assert [part["model_shards"][name] for part in parts[:experts]] == [[0, experts, i, 1] for i in range(experts)]
    rest = [name for name in whole.state_dict() if name not in expert_names]
    assert rest and all(name in parts[0]["model"] for name in rest)
    assert not any(name in part["model"] for part in parts[1:] for name in rest)
    assert not any(part["model"] or part["optimizer"]["state"] for part in parts[experts:])
    moments = sum(value.numel() for part in parts for state in part["optimizer"]["state"].values()
                  for key, value in state.items() if key == "exp_avg")
    assert moments == sum(p.numel() for p in whole.parameters())

    # Put together: the whole model and AdamW state, bitwise (as a resume at any E, consolidate and export read it).
    expected = {"model": whole.state_dict(), "optimizer": optimizer.state_dict()}
    assert differences(source.full_state(), expected) == []
    assert differences(consolidate(path), expected) == []
    exported = dict(source.model_tensors())
    assert sorted(exported) == sorted(expected["model"])
    assert all(torch.equal(exported[name], value) for name, value in expected["model"].items())


def test_a_sharded_checkpoint_resumes_as_written_only_at_its_own_expert_parallel(tmp_path):
    _, _, path = written(tmp_path, 2, 2)
    manifest = sharded.read_manifest(path)
    assert sharded.resumes_as_written(manifest, "ddp", 2, experts=2)
    assert not sharded.resumes_as_written(manifest, "ddp", 2, experts=1)  # other experts on each rank
    older = {**manifest, "config": {}}  # written before checkpoints recorded their settings: E=1
    assert sharded.resumes_as_written(older, "ddp", 2) and not sharded.resumes_as_written(older, "ddp", 2, experts=2)


def test_sharded_checkpoints_are_accepted_under_expert_parallelism():
    for strategy in ("ddp", "fsdp"):
        config = TrainConfig(expert_parallel=2, strategy=strategy, checkpoint_format="sharded")
        assert config.checkpoint_format == "sharded"
    with pytest.raises(ValueError, match="strategy=ddp does not work with checkpoint_format=sharded"):
        TrainConfig(checkpoint_format="sharded")  # plain ddp still has nothing to shard
