"""Trainer.load_pretrained: a Hugging Face directory (several safetensors files and an index) read by
slice, each rank only what it keeps, gives every strategy exactly the weights from_pretrained gives
one process; a directory of another model is refused on every rank."""
from pathlib import Path

import pytest
import torch

from hvdtrain.checkpoint import CheckpointError
from hvdtrain.distributed import collectives
from tests.mpi.hf_models import tiny_llama, trainer_for, transformers

pytestmark = pytest.mark.mpi


@pytest.fixture(scope="module")
def pretrained_dir(world, tmp_path_factory):
    base = Path(collectives.allgather_object(str(tmp_path_factory.mktemp("pretrained")), name="pretrained.dir")[0])
    if world.is_root:
        tiny_llama(seed=0).save_pretrained(base / "llama", max_shard_size="40KB")  # several files + an index
    collectives.allgather_object(None, name="pretrained.written")
    return base / "llama"


@pytest.mark.parametrize("strategy", ["ddp", "zero2", "fsdp"])
def test_each_rank_reads_what_it_keeps_and_gets_from_pretrained_weights(world, pretrained_dir, strategy):
    expected = transformers.AutoModelForCausalLM.from_pretrained(pretrained_dir).state_dict()
    total = sum(t.numel() * t.element_size() for name, t in expected.items() if name != "lm_head.weight")
    trainer = trainer_for(world, strategy, tiny_llama(seed=5), max_steps=1)  # other weights: the load must replace them
    read = trainer.load_pretrained(pretrained_dir)
    loaded = trainer.strategy.exported_model_state()
    reads = collectives.allgather_object(read, name=f"pretrained.read.{strategy}")
    different = [name for name, value in expected.items() if not torch.equal(loaded[name], value)]

    assert len(list(pretrained_dir.glob("model-*.safetensors"))) > 2
    assert not different, f"not the pretrained values: {different}"
    if strategy == "ddp":
        assert reads == [total] * world.size  # a replica reads the whole model, the tied weight once
    else:  # its slice of every bucket: the ranks together read the model once (padding is not read)
        assert sum(reads) == total and (world.size == 1 or max(reads) < 0.6 * total), reads


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
