"""The Trainer under every strategy: checkpoints written under one resume under another, a sharded
strategy refuses Horovod elastic before any collective, and every rank reports what it holds."""
import json
from pathlib import Path

import pytest
import torch
from torch import nn

from hvdtrain.distributed import collectives
from hvdtrain.config.train import TrainConfig
from hvdtrain.trainer import Trainer
from tests.mpi.helpers import flat_parameters, small_mlp, synthetic_classification

# The launches of scripts/run_tests.sh this file runs in besides the one at $NP ranks under MPI,
# each with what it shows there (the markers: setup.cfg).
pytestmark = [
    pytest.mark.mpi,
    pytest.mark.np1(reason="one rank holds every strategy's whole state: no shards to switch between"),
    pytest.mark.np4(reason="each strategy's shards and padding, and its checkpoints', change with the world size"),
    pytest.mark.gloo_np4(reason="the same shards at 4 ranks over Gloo's collectives"),
]


def train(world, strategy, max_steps, directory=None, run_dir=None, model=None, max_grad_norm=None):
    model = model or small_mlp(seed=0)
    config = TrainConfig(epochs=3, batch_size=4, accumulation=2, lr=0.05, warmup_epochs=0.5, seed=5,
                         strategy=strategy, max_steps=max_steps, checkpoint_dir=directory, run_dir=run_dir,
                         run_name="run" if run_dir else None, log_every=1000, tensorboard=False,
                         max_grad_norm=max_grad_norm)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=0.01)
    trainer = Trainer(model, optimizer, synthetic_classification(samples=192), None, config, world=world)
    trainer.fit()
    trainer.close()
    trainer.strategy.whole_model()  # fsdp: parameters hold no memory between uses until made whole
    return trainer


@pytest.mark.parametrize("first,then", [("zero1", "ddp"), ("ddp", "zero2"), ("zero2", "fsdp"), ("fsdp", "zero1"),
                                        ("ps", "ddp"), ("ddp", "ps")])
def test_a_checkpoint_written_under_one_strategy_resumes_under_another(world, tmp_path, first, then):
    """Checkpoints hold the full model and the plain optimizer's state, whatever wrote them: the
    run continues as if it had never changed strategy (float64: summation order differs at 1e-16)."""
    base = collectives.allgather_object(str(tmp_path), name=f"switch.dir.{first}.{then}")[0]
    whole = train(world, then, max_steps=10)
    train(world, first, max_steps=4, directory=f"{base}/switch")
    resumed = train(world, then, max_steps=10, directory=f"{base}/switch", model=small_mlp(seed=77))

    difference = (flat_parameters(resumed.model) - flat_parameters(whole.model)).abs().max()
    rows = collectives.allgather_rows(difference.reshape(1), name=f"switch.diff.{first}.{then}")
    assert resumed.global_step == whole.global_step == 10
    assert (rows < 1e-10).all(), f"max |resumed - uninterrupted| per rank: {rows.flatten().tolist()}"


@pytest.mark.parametrize("strategy,refusal", [
    ("ps", "train.strategy=ps does not support Horovod elastic"),
    # zero1, zero2 and fsdp continue from the newest checkpoint after a world change: they need a directory.
    ("zero1", "train.strategy=zero1 under Horovod elastic continues from the newest checkpoint.*set train.checkpoint_dir"),
    ("fsdp", "train.strategy=fsdp under Horovod elastic continues from the newest checkpoint.*set train.checkpoint_dir"),
])
def test_what_cannot_run_under_horovod_elastic_is_refused_before_any_collective(world, monkeypatch, strategy, refusal):
    monkeypatch.setenv("HOROVOD_ELASTIC", "1")
    model = small_mlp(seed=0)
    with pytest.raises(ValueError, match=refusal):
        Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), synthetic_classification(samples=64),
                config=TrainConfig(strategy=strategy, checkpoint_dir=None), world=world)


@pytest.mark.parametrize("strategy", ["ddp", "zero2"])
def test_after_an_elastic_sync_every_rank_decides_alike_whether_to_save(world, monkeypatch, tmp_path, strategy):
    """Under Horovod elastic a survivor may have written the very checkpoint the new world continues
    from (no step since), while a worker that joins wrote nothing. The sync makes every rank forget:
    else, when the larger world has no step left in the epoch, the survivors skipped the epoch's save
    that the joiner made, and the job hung in mismatched collectives (zero2, sharded, in test_elastic)."""
    monkeypatch.setenv("HOROVOD_ELASTIC", "1")
    base = collectives.allgather_object(str(tmp_path), name=f"elastic.saved.dir.{strategy}")[0]
    model = small_mlp(seed=0)
    config = TrainConfig(epochs=1, batch_size=4, lr=0.05, warmup_epochs=0, seed=5, strategy=strategy,
                         checkpoint_dir=f"{base}/ckpt", checkpoint_format="full" if strategy == "ddp" else "sharded",
                         log_every=1000, tensorboard=False)
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=config.lr), synthetic_classification(samples=64),
                      None, config, world=world)
    state = trainer._elastic_state()
    state.sync()  # zero2: rank 0's state everywhere, and step 0's checkpoint
    trainer.parts.checkpoints.save_unless_saved()  # ddp: its own (zero2: the one the sync wrote, not again)
    # Rank 0 as a worker that joins; the others as survivors that wrote the checkpoint and took no step since.
    trainer.parts.checkpoints.saved_at = None if world.is_root else trainer.parts.position.step
    state.sync()
    remembered = collectives.allgather_object(trainer.parts.checkpoints.saved_at, name=f"elastic.saved.{strategy}")
    trainer.close()

    assert remembered == [None] * world.size, f"each rank's last saved step after the sync: {remembered}"


def wide_mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 256), nn.Tanh(), nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 4)).double()


def test_every_rank_reports_its_memory_and_sharding_divides_it(world, tmp_path):
    """Adam's state is 2 tensors per parameter: ddp holds all of it on every rank, zero2 a 1/N
    share of it and of the gradients (plus padding of under N elements per bucket)."""
    base = collectives.allgather_object(str(tmp_path), name="memory.dir")[0]
    held = {}
    for strategy in ("ddp", "zero2"):
        trainer = train(world, strategy, max_steps=1, run_dir=f"{base}/{strategy}", model=wide_mlp())
        held[strategy] = trainer.parts.reporter.memory.per_rank
    records = []
    if world.is_root:
        lines = Path(f"{base}/zero2/run/metrics.jsonl").read_text().splitlines()
        records = [json.loads(line) for line in lines if json.loads(line)["kind"] == "memory"]

    size, psi_bytes = world.size, sum(p.numel() for p in wide_mlp().parameters()) * 8
    for rank in range(size):
        ddp, zero2 = held["ddp"][rank], held["zero2"][rank]
        assert ddp["parameters"] == psi_bytes and ddp["gradients"] == psi_bytes
        assert ddp["optimizer_state"] >= 2 * psi_bytes  # exp_avg and exp_avg_sq (and the step counts)
        assert abs(zero2["parameters"] - psi_bytes) < 0.01 * psi_bytes  # flat buckets: padding
        assert abs(zero2["gradients"] - psi_bytes / size) < 0.01 * psi_bytes
        assert abs(zero2["optimizer_state"] - ddp["optimizer_state"] / size) < 0.01 * ddp["optimizer_state"]
        assert zero2["peak_rss"] > 0
    if world.is_root:
        assert len(records) == 1 and records[0]["strategy"] == "zero2" and len(records[0]["per_rank"]) == size


def lm_run(world, strategy, activation_checkpointing):
    """The example transformer (2 blocks, dropout 0.1, float64) trained 3 steps; its final parameters."""
    from hvdtrain.examples.textlm import TinyTransformerLM, lm_loss
    from torch.utils.data import TensorDataset

    torch.manual_seed(0)
    model = TinyTransformerLM(11, seq_len=8, d_model=16, layers=2, heads=4, dropout=0.1).double()
    ids = torch.randint(0, 11, (64, 9), generator=torch.Generator().manual_seed(3))
    config = TrainConfig(epochs=1, batch_size=4, lr=0.01, warmup_epochs=0, max_steps=3, seed=5, strategy=strategy,
                         log_every=1000, activation_checkpointing=activation_checkpointing)
    initial = flat_parameters(model)  # the same on every rank (one seed), before fsdp shards it
    trainer = Trainer(model, torch.optim.AdamW(model.parameters(), lr=config.lr), TensorDataset(ids[:, :-1], ids[:, 1:]),
                      None, config, world=world, loss_fn=lm_loss)
    blocks = trainer.parts.recomputed_blocks
    trainer.fit()
    trainer.close()
    trainer.strategy.whole_model()
    return initial, flat_parameters(model), blocks


@pytest.mark.parametrize("strategy", ["ddp", "zero1", "zero2", "fsdp"])
def test_activation_checkpointing_trains_exactly_as_without_it(world, strategy):
    """The recompute replays the first forward's random stream (dropout) and autocast: the same
    steps. 1e-12 in float64: only Horovod's fusion, which groups gradients by when backward produces
    them (the recompute moves that), may change the order of a sum (1e-16 a step); a mask drawn anew
    or a gradient lost moves parameters by more than 1e-4."""
    initial, plain, none = lm_run(world, strategy, "none")
    _, full, every_block = lm_run(world, strategy, "full")
    _, every_k, second_block = lm_run(world, strategy, "every_k")
    _, selective, _ = lm_run(world, strategy, "selective")
    local = torch.stack([(full - plain).abs().max(), (every_k - plain).abs().max(), (selective - plain).abs().max(),
                         (plain - initial).abs().max()])
    everywhere = collectives.allgather_rows(local.reshape(1, 4), name=f"recompute.{strategy}")

    assert (none, every_block, second_block) == ([], ["blocks.0", "blocks.1"], ["blocks.1"])
    assert (everywhere[:, 3] > 1e-3).all(), "training did not move the parameters: the test proves nothing"
    assert (everywhere[:, :3] < 1e-12).all(), f"max |with - without activation checkpointing|: {everywhere.tolist()}"
