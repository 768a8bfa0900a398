"""Trainer.load_pretrained: a Hugging Face directory (several safetensors files and an index) read by
slice, each rank only what it keeps, gives every strategy exactly the weights from_pretrained gives
one process, for Llama (tied embedding and head) and Qwen3 (its own head, per-head norms), and to a
model built on the meta device as to one built whole; a directory of another model is refused on
every rank."""
from pathlib import Path

import pytest
import torch

from hvdtrain.checkpoint import CheckpointError
from hvdtrain.distributed import collectives
from tests.mpi.hf_models import tiny_config, tiny_llama, tiny_model, trainer_for, transformers

pytestmark = pytest.mark.mpi


@pytest.fixture(scope="module")
def pretrained_dirs(world, tmp_path_factory):
    """family -> a directory save_pretrained wrote for it, in several files with an index."""
    base = Path(collectives.allgather_object(str(tmp_path_factory.mktemp("pretrained")), name="pretrained.dir")[0])
    if world.is_root:
        for family in ("llama", "qwen3"):
            tiny_model(family, seed=0).save_pretrained(base / family, max_shard_size="40KB")
    collectives.allgather_object(None, name="pretrained.written")
    return {family: base / family for family in ("llama", "qwen3")}


@pytest.fixture(scope="module")
def pretrained_dir(pretrained_dirs):
    return pretrained_dirs["llama"]


def pretrained_weights(directory):
    """(from_pretrained's state_dict, the bytes of its distinct tensors: a tied weight once)."""
    expected = transformers.AutoModelForCausalLM.from_pretrained(directory).state_dict()
    distinct = {t.untyped_storage().data_ptr(): t.numel() * t.element_size() for t in expected.values()}
    return expected, sum(distinct.values())


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("strategy", ["ddp", "zero1", "zero2", "fsdp"])
def test_each_rank_reads_what_it_keeps_and_gets_from_pretrained_weights(world, pretrained_dirs, strategy, family):
    directory = pretrained_dirs[family]
    expected, total = pretrained_weights(directory)
    # Other weights: the load must replace them.
    trainer = trainer_for(world, strategy, tiny_model(family, seed=5), max_steps=1)
    read = trainer.load_pretrained(directory)
    loaded = trainer.strategy.exported_model_state()
    reads = collectives.allgather_object(read, name=f"pretrained.read.{strategy}.{family}")
    different = [name for name, value in expected.items() if not torch.equal(loaded[name], value)]

    assert len(list(directory.glob("model-*.safetensors"))) > 2
    assert not different, f"not the pretrained values: {different}"
    if strategy == "ddp":
        assert reads == [total] * world.size  # a replica reads the whole model, a tied weight once
    else:  # its slice of every bucket: the ranks together read the model once (padding is not read)
        assert sum(reads) == total and (world.size == 1 or max(reads) < 0.6 * total), reads


@pytest.mark.parametrize("strategy", ["zero1", "fsdp"])
def test_a_model_built_on_meta_gets_from_pretrained_weights_bitwise(world, pretrained_dir, strategy):
    """Built on the meta device, initialized by the Trainer (under fsdp unit by unit, never whole),
    then loaded: exactly from_pretrained's weights, as the model built whole gets them."""
    expected, _ = pretrained_weights(pretrained_dir)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(tiny_config("llama"))
    trainer = trainer_for(world, strategy, model, max_steps=1)
    trainer.load_pretrained(pretrained_dir)
    loaded = trainer.strategy.exported_model_state()
    different = [name for name, value in expected.items() if not torch.equal(loaded[name], value)]

    assert trainer.parts.initialization is not None, "the Trainer initialized the model from the meta device"
    assert not different, f"not the pretrained values: {different}"


def test_another_models_weights_are_refused_on_every_rank(world, pretrained_dir):
    trainer = trainer_for(world, "zero2", tiny_llama(seed=5, layers=3), max_steps=1)
    with pytest.raises(CheckpointError, match="has no weights for model.layers.2"):
        trainer.load_pretrained(pretrained_dir)
    trainer.fit()  # one step: afterwards the run's weights are newer than any pretrained ones
    with pytest.raises(ValueError, match="this one is at step 1"):
        trainer.load_pretrained(pretrained_dir)


@pytest.mark.process_sets
@pytest.mark.parametrize("layout", [(2, 1), (1, 2)], ids=["T2", "P2"])
def test_model_parallel_ranks_read_only_their_part_of_the_pretrained_weights(world, pretrained_dir, layout):
    """T=2 by the model's own plan, or two pipeline stages: each rank reads its stage's tensors and
    of each split one its slice (the tied embedding and head cut once); gathered back, they are
    from_pretrained's weights."""
    from torch.utils.data import TensorDataset

    from hvdtrain.config.train import TrainConfig
    from hvdtrain.trainer import Trainer
    from tests.mpi.hf_models import SEQ, VOCAB, causal_lm_step

    tensor, pipeline = layout
    if world.size % 2:
        pytest.skip("a mesh of 2 needs an even number of ranks")
    expected = transformers.AutoModelForCausalLM.from_pretrained(pretrained_dir).state_dict()
    total = sum(t.numel() * t.element_size() for name, t in expected.items() if name != "lm_head.weight")
    model = tiny_llama(seed=5)
    ids = torch.randint(0, VOCAB, (16, SEQ + 1), generator=torch.Generator().manual_seed(1))
    config = TrainConfig(epochs=1, batch_size=4, max_steps=1, seed=3, log_every=1000, tensorboard=False,
                         tensor_parallel=tensor, pipeline_parallel=pipeline, micro_batches=2)
    loss = (lambda out, targets: torch.nn.functional.cross_entropy(out.reshape(-1, VOCAB), targets.reshape(-1)))
    trainer = Trainer(model, torch.optim.AdamW(model.parameters(), lr=0.01), TensorDataset(ids[:, :-1], ids[:, 1:]),
                      None, config, world=world, **({"step_fn": causal_lm_step} if pipeline == 1 else {"loss_fn": loss}))
    read = trainer.load_pretrained(pretrained_dir)
    loaded = trainer.strategy.exported_model_state()
    reads = collectives.allgather_object(read, name=f"pretrained.mp.read.{layout}")
    held = {name: tuple(p.shape) for name, p in model.named_parameters(remove_duplicate=False)}
    trainer.close_mesh()
    different = [name for name, value in expected.items() if not torch.equal(loaded[name], value)]

    assert not different, f"not the pretrained values: {different}"
    # A rank's part: half the layers or half of each; the ranks together read the model at least once.
    assert max(reads) < 0.6 * total and sum(reads[:2]) >= total, (reads, total)
    if tensor == 2:
        assert held["model.layers.0.self_attn.q_proj.weight"] == (16, 32)  # this rank's 2 of 4 heads
        assert model.lm_head.weight is model.model.embed_tokens.weight


def test_a_weights_file_unreadable_on_one_rank_is_refused_alike_on_every_rank_naming_the_rank(
        world, pretrained_dir, tmp_path, monkeypatch):
    """The last rank sees a corrupt file in place of the first weights file (a bad copy on its node):
    every rank raises the same CheckpointError naming that rank and the file; none fails alone."""
    import safetensors

    victim = sorted(pretrained_dir.glob("model-*.safetensors"))[0]
    corrupt = tmp_path / "corrupt.safetensors"
    corrupt.write_bytes(b"\x10" + b"\x00" * 7 + b"not a safetensors header")
    real = safetensors.safe_open
    if world.rank == world.size - 1:
        monkeypatch.setattr(safetensors, "safe_open",
                            lambda path, *args, **kwargs: real(str(corrupt) if Path(path) == victim else path,
                                                               *args, **kwargs))
    trainer = trainer_for(world, "zero2", tiny_llama(seed=5), max_steps=1)
    with pytest.raises(CheckpointError) as raised:
        trainer.load_pretrained(pretrained_dir)
    messages = collectives.allgather_object(str(raised.value), name="pretrained.unreadable.messages")

    assert messages == [messages[0]] * world.size, messages
    assert f"rank {world.size - 1}: {victim} is not a readable safetensors file" in messages[0], messages[0]
