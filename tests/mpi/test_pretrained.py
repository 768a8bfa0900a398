"""Trainer.load_pretrained: a Hugging Face directory (several safetensors files and an index) read by
slice, each rank only what it keeps, gives every strategy exactly the weights from_pretrained gives
one process; a directory of another model is refused on every rank."""
from pathlib import Path

import pytest
import torch
from torch.utils.data import TensorDataset

from hvdtrain.checkpoint import CheckpointError
from hvdtrain.config.train import TrainConfig
from hvdtrain.distributed import collectives
from hvdtrain.trainer import Trainer

pytestmark = pytest.mark.mpi
transformers = pytest.importorskip("transformers")

VOCAB, SEQ = 64, 8


def tiny_llama(seed, layers=2):
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                                      tie_word_embeddings=True)
    return transformers.LlamaForCausalLM(config)


def causal_lm_step(model, batch):
    inputs, targets = batch
    logits = model(input_ids=inputs).logits
    return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1)), {}


def trainer_for(world, strategy, model):
    ids = torch.randint(0, VOCAB, (64, SEQ + 1), generator=torch.Generator().manual_seed(1))
    config = TrainConfig(epochs=1, batch_size=4, lr=0.01, warmup_epochs=0, max_steps=1, seed=3, strategy=strategy,
                         log_every=1000)
    return Trainer(model, torch.optim.AdamW(model.parameters(), lr=config.lr), TensorDataset(ids[:, :-1], ids[:, 1:]),
                   None, config, world=world, step_fn=causal_lm_step)


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
    trainer = trainer_for(world, strategy, tiny_llama(seed=5))  # other weights: the load must replace them
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
    trainer = trainer_for(world, "zero2", tiny_llama(seed=5, layers=3))
    with pytest.raises(CheckpointError, match="has no weights for model.layers.2"):
        trainer.load_pretrained(pretrained_dir)
    trainer.fit()  # one step: afterwards the run's weights are newer than any pretrained ones
    with pytest.raises(ValueError, match="this one is at step 1"):
        trainer.load_pretrained(pretrained_dir)
