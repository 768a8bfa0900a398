"""A Hugging Face model trained by the Trainer comes out as a directory transformers' own
from_pretrained loads to the very logits of the trained model: under fsdp streamed one unit at a
time (never the whole model on a rank), in numbered files with an index past the size limit; at
the end of run() into the run directory's hf/."""
import json
from pathlib import Path

import pytest
import torch
from torch.utils.data import TensorDataset

from hvdtrain.config.train import TrainConfig
from hvdtrain.distributed import collectives
from hvdtrain.strategies.fsdp import units as fu
from hvdtrain.trainer import Trainer

pytestmark = pytest.mark.mpi
transformers = pytest.importorskip("transformers")

VOCAB, SEQ = 64, 8


def tiny_llama():
    """Llama's layout at toy size: grouped-query attention (2 key/value heads for 4), tied embeddings."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                                      tie_word_embeddings=True)
    return transformers.LlamaForCausalLM(config).double()


def causal_lm_step(model, batch):
    inputs, targets = batch
    logits = model(input_ids=inputs).logits
    return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1)), {}


def trainer_for(world, strategy, run_dir=None):
    ids = torch.randint(0, VOCAB, (64, SEQ + 1), generator=torch.Generator().manual_seed(1))
    config = TrainConfig(epochs=1, batch_size=4, lr=0.01, warmup_epochs=0, max_steps=3, seed=3, strategy=strategy,
                         log_every=1000, tensorboard=False, run_dir=run_dir, run_name="run" if run_dir else None)
    model = tiny_llama()
    return Trainer(model, torch.optim.AdamW(model.parameters(), lr=config.lr), TensorDataset(ids[:, :-1], ids[:, 1:]),
                   None, config, world=world, step_fn=causal_lm_step)


def logits_of(state, ids):
    """The trained weights in a fresh model of the same class, in one process."""
    model = tiny_llama()
    model.load_state_dict(state)
    with torch.no_grad():
        return model(ids).logits


def test_fsdp_streams_one_unit_at_a_time_into_numbered_files_that_from_pretrained_loads(world, tmp_path):
    base = Path(collectives.allgather_object(str(tmp_path), name="hf.dir")[0])
    trainer = trainer_for(world, "fsdp")
    trainer.fit()
    gathered_at_once = []
    streamed = trainer.strategy.full_tensors

    def counting():
        for item in streamed():
            gathered_at_once.append(sum(unit.state != fu.FREE for unit in trainer.strategy.all_units))
            yield item

    trainer.strategy.full_tensors = counting
    trainer.export_hf(base / "hf", max_shard_bytes=40_000)  # the tensors are 4-33 KB: several files
    trained = trainer.strategy.exported_model_state()  # whole, to compare with
    trainer.close()

    assert max(gathered_at_once) == 1, f"units gathered at once while exporting: {gathered_at_once}"
    if world.is_root:
        written = sorted(p.name for p in (base / "hf").iterdir())
        index = json.loads((base / "hf" / "model.safetensors.index.json").read_text())
        loaded = transformers.AutoModelForCausalLM.from_pretrained(base / "hf", dtype=torch.float64)
        ids = torch.randint(0, VOCAB, (3, SEQ), generator=torch.Generator().manual_seed(2))
        with torch.no_grad():
            ours = loaded(ids).logits

        assert written[0] == "config.json" and written[-1] == "model.safetensors.index.json"
        parts = written[1:-1]
        assert len(parts) > 2 and parts[0] == f"model-00001-of-{len(parts):05d}.safetensors", written
        # every distinct tensor once: the tied head is not written again, and loading ties it back
        assert "lm_head.weight" not in index["weight_map"] and len(index["weight_map"]) == len(trained) - 1
        assert type(loaded).__name__ == "LlamaForCausalLM"
        assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()
        assert torch.equal(ours, logits_of(trained, ids))


def test_run_writes_the_hf_directory_at_its_end(world, tmp_path):
    base = Path(collectives.allgather_object(str(tmp_path), name="hf.run.dir")[0])
    trainer = trainer_for(world, "zero2", run_dir=str(base / "runs"))
    trainer.run()

    if world.is_root:
        hf = base / "runs" / "run" / "hf"
        assert sorted(p.name for p in hf.iterdir()) == ["config.json", "model.safetensors"]
        assert json.loads((hf / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
        loaded = transformers.AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float64)
        ids = torch.randint(0, VOCAB, (3, SEQ), generator=torch.Generator().manual_seed(2))
        with torch.no_grad():
            assert torch.equal(loaded(ids).logits, logits_of(trainer.final_model_state, ids))
