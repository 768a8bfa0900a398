"""A Hugging Face model trained by the Trainer comes out as a directory transformers' own
from_pretrained loads to the very logits of the trained model: under fsdp streamed one unit at a
time (never the whole model on a rank), in numbered files with an index past the size limit; at
the end of run() into the run directory's hf/."""
import json
from pathlib import Path

import pytest
import torch

from hvdtrain.distributed import collectives
from hvdtrain.strategies.fsdp import units as fu
from tests.mpi.hf_models import SEQ, VOCAB, causal_lm_step, tiny_llama, trainer_for, transformers

pytestmark = pytest.mark.mpi


def llama_trainer(world, strategy, run_dir=None):
    return trainer_for(world, strategy, tiny_llama(dtype=torch.float64), max_steps=3, run_dir=run_dir)


def logits_of(state, ids):
    """The trained weights in a fresh model of the same class, in one process."""
    model = tiny_llama(dtype=torch.float64)
    model.load_state_dict(state)
    with torch.no_grad():
        return model(ids).logits


def test_fsdp_streams_one_unit_at_a_time_into_numbered_files_that_from_pretrained_loads(world, tmp_path):
    base = Path(collectives.allgather_object(str(tmp_path), name="hf.dir")[0])
    trainer = llama_trainer(world, "fsdp")
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
    trainer = llama_trainer(world, "zero2", run_dir=str(base / "runs"))
    trainer.run()
    trained = trainer.strategy.exported_model_state()

    if world.is_root:
        hf = base / "runs" / "run" / "hf"
        assert sorted(p.name for p in hf.iterdir()) == ["config.json", "model.safetensors"]
        assert json.loads((hf / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
        loaded = transformers.AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float64)
        ids = torch.randint(0, VOCAB, (3, SEQ), generator=torch.Generator().manual_seed(2))
        with torch.no_grad():
            assert torch.equal(loaded(ids).logits, logits_of(trained, ids))


@pytest.mark.timeout(240)
@pytest.mark.parametrize("layout", [{"tensor_parallel": 2}, {"pipeline_parallel": 2, "micro_batches": 2}],
                         ids=["T2", "P2"])
def test_a_mesh_exports_one_whole_tensor_at_a_time_what_from_pretrained_loads(world, tmp_path, layout):
    """Split by its own tp_plan or cut into stages: the tensors are gathered whole one by one, each
    written by rank 0 and let go once the next has come (so at most two are alive: the writer's and
    the one just gathered; holding them all would show here), and the directory loads in plain
    transformers to the logits of the trained model."""
    import weakref

    from hvdtrain.config.train import TrainConfig
    from hvdtrain.trainer import Trainer

    mesh = layout.get("tensor_parallel", 1) * layout.get("pipeline_parallel", 1)
    if world.size % mesh:
        pytest.skip(f"a mesh of {mesh} does not divide {world.size} ranks")
    base = Path(collectives.allgather_object(str(tmp_path), name=f"hf.mesh.dir.{mesh}")[0])
    ids = torch.randint(0, VOCAB, (64, SEQ + 1), generator=torch.Generator().manual_seed(1))
    model = tiny_llama(dtype=torch.float64)
    config = TrainConfig(epochs=1, batch_size=4, warmup_epochs=0, max_steps=2, seed=3, log_every=1000,
                         tensorboard=False, **layout)
    # A pipeline's last stage hands the logits to a loss_fn; one pass runs the step_fn.
    step = ({"loss_fn": lambda logits, targets: torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB),
                                                                                  targets.reshape(-1))}
            if "pipeline_parallel" in layout else {"step_fn": causal_lm_step})
    trainer = Trainer(model, torch.optim.AdamW(model.parameters(), lr=0.01), torch.utils.data.TensorDataset(
        ids[:, :-1], ids[:, 1:]), None, config, world=world, **step)
    trainer.fit()
    alive_at_once = []
    streamed = trainer.strategy.full_tensors

    def watched():
        handed = []
        for name, tensor in streamed():
            handed.append(weakref.ref(tensor))
            alive_at_once.append(sum(ref() is not None for ref in handed))
            del tensor
            yield name, handed[-1]()

    trainer.strategy.full_tensors = watched
    trainer.export_hf(base / "hf")
    trained = trainer.strategy.exported_model_state()  # whole, to compare with
    trainer.close_mesh()

    assert len(alive_at_once) == len(trained) - 1  # every distinct tensor, the tied head once
    assert max(alive_at_once) <= 2, f"whole tensors alive at once while exporting: {alive_at_once}"
    if world.is_root:
        loaded = transformers.AutoModelForCausalLM.from_pretrained(base / "hf", dtype=torch.float64)
        probe = torch.randint(0, VOCAB, (3, SEQ), generator=torch.Generator().manual_seed(2))
        with torch.no_grad():
            assert torch.equal(loaded(probe).logits, logits_of(trained, probe))
