"""Sharded checkpoints under expert parallelism (train.expert_parallel=E, checkpoint_format=sharded):
every rank writes what it alone writes (its experts if it is in the first expert group; the rest on
rank 0 under ddp, each rank its ranges of fsdp's flat buckets under fsdp; nothing gathered), and the
checkpoint

- holds each expert once (the files' expert elements add up to the whole experts once),
- continues bitwise at its own E (each rank's RNG from its own file),
- is resumed at E=1 (plain ddp, full format; zero1, sharded), at E=2 and, at 4 ranks, at E=4, to
  exactly the state written; a zero1 sharded checkpoint at E=1 is resumed at E=2 alike,
- under fsdp x E, is resumed at its own layout bitwise, at E=1 (plain fsdp, ddp), under ddp x E and,
  at 4 ranks (E=2 x D=2), at E=4; a ddp x E sharded checkpoint is resumed under fsdp x E alike,
- consolidates (``hvdtrain checkpoint consolidate``) and exports (``hvdtrain export --format hf``) to
  what transformers' from_pretrained loads, with the written model's logits bit for bit.

Tiny Qwen3-MoE in float64 (test_hf_moe.py's). "Exactly": torch.equal, since a checkpoint moves
values and never computes with them.
"""
import copy

import pytest
import torch

from hvdtrain.checkpoint import CheckpointError
from hvdtrain.checkpoint.formats.full import CheckpointStore
from hvdtrain.cli import main as cli
from hvdtrain.distributed import collectives
from tests.mpi.test_hf_moe import SHAPE, VOCAB, expert_names, make_model, make_trainer, token_data
from tests.mpi.test_mesh_checkpoint import differences

transformers = pytest.importorskip("transformers")

pytestmark = [pytest.mark.mpi, pytest.mark.process_sets,
              pytest.mark.np4(reason="E=4, and E=2 with two replica groups of each expert, fit only at 4 ranks")]

FAMILY, STEPS = "qwen3_moe", 2


def trainer_in(world, directory, max_steps, seed, **settings):
    """A trainer of a fresh model (another on every rank: what is loaded must overwrite it)."""
    return make_trainer(world, make_model(FAMILY, seed), token_data(), max_steps=max_steps,
                        checkpoint_dir=str(directory), **settings)


def gathered(trainer):
    """The whole state as a gathered checkpoint holds it; the trainer's expert groups closed."""
    state = copy.deepcopy(trainer.strategy.state_dict())
    trainer.close_mesh()  # left open, every later test's collectives slow down
    return state


def resumed_from(world, checkpoint, directory, **settings):
    """The gathered state of a run resuming ``checkpoint`` (linked into a directory of its own: the
    resume's own save leaves it as it is), at its last step: nothing left to train."""
    if world.is_root:
        directory.mkdir()
        (directory / checkpoint.name).symlink_to(checkpoint, target_is_directory=True)
    collectives.barrier()
    trainer = trainer_in(world, directory, STEPS, 300 + world.rank, **settings)
    trainer.fit()
    return gathered(trainer)


def layouts(world):
    """Every layout that fits this world (E=1 under ddp and zero1, E=2, E=4): the resuming run's settings."""
    found = {"E1": {"checkpoint_format": "full"}, "E1-zero1": {"strategy": "zero1", "checkpoint_format": "sharded"}}
    for experts in (2, 4):
        if world.size % experts == 0:
            found[f"E{experts}"] = {"expert_parallel": experts, "checkpoint_format": "sharded"}
    return found


def read_in_one_process(checkpoint, saved, directory):
    """What rank 0 alone finds in ``checkpoint``: each file's expert elements, the consolidated
    checkpoint's and the Hugging Face export's differences from ``saved``, and whether the exported
    model's logits are the saved model's bit for bit."""
    files = sorted(checkpoint.glob("rank-*.pt"))
    parts = [torch.load(file, weights_only=True)["strategy"]["model"] for file in files]
    on_disk = {name: sum(part[name].numel() for part in parts if name in part) for name in expert_names(saved["model"])}
    holders = {name: [rank for rank, part in enumerate(parts) if name in part] for name in on_disk}
    # The rest: each tensor's elements once over the files (tied names share one tensor), and which ranks wrote any.
    rest = [name for name in saved["model"] if name not in on_disk]
    rest_held_otherwise = [name for name in rest if sum(part[name].numel() for part in parts if name in part)
                           != saved["model"][name].numel()]
    rest_writers = sorted({rank for rank, part in enumerate(parts) for name in rest if name in part})
    codes = [cli(["checkpoint", "consolidate", str(checkpoint), "--out", str(directory / "whole.pt")])]
    make_model(FAMILY, 0).config.save_pretrained(directory / "hf-config")
    codes.append(cli(["export", str(checkpoint), "--format", "hf", "--hf-config", str(directory / "hf-config"),
                      "--out", str(directory / "hf")]))
    # eager experts: transformers' default kernel has no float64 form
    loaded = transformers.AutoModelForCausalLM.from_pretrained(directory / "hf", dtype=torch.float64,
                                                               experts_implementation="eager")
    model = make_model(FAMILY, 0)
    model.load_state_dict(saved["model"])
    ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        logits_equal = torch.equal(loaded(input_ids=ids).logits, model(input_ids=ids).logits)
    return {"codes": codes, "files": len(files), "on_disk": on_disk, "holders": holders,
            "rest_held_otherwise": rest_held_otherwise, "rest_writers": rest_writers,
            "consolidated": differences(CheckpointStore.read(directory / "whole.pt"), saved),
            "exported": [name for name, t in loaded.state_dict().items() if not torch.equal(t, saved["model"][name])],
            "logits_equal": logits_equal}


def read_on_root(world, checkpoint, saved, directory):
    """read_in_one_process on rank 0, its outcome on every rank (a failure there is every rank's: the
    others wait for its outcome, not for Horovod's timeout)."""
    seen = None
    if world.is_root:
        try:
            seen = read_in_one_process(checkpoint, saved, directory)
        except Exception as error:  # noqa: BLE001 - reported on every rank below
            seen = {"error": f"{type(error).__name__}: {error}"}
    return collectives.broadcast_object(seen, root_rank=0, name="ep_checkpoint.read")


def save_continue_and_resume(world, shared_tmp_path, settings, resumes):
    """One save at STEPS under ``settings``, then: (the state written, what one process reads of the
    checkpoint, the names a run continuing it has off an uninterrupted one, per resume of ``resumes``
    (name -> settings) the names off the state written)."""
    directory = shared_tmp_path / "ckpt"
    written = trainer_in(world, directory, STEPS, 100 + world.rank, **settings)
    written.fit()
    saved = gathered(written)
    checkpoint = directory / f"ckpt-{STEPS:09d}"
    # The same layout continues; a run not stopped is the reference.
    continued = trainer_in(world, directory, 2 * STEPS, 200, **settings)
    continued.fit()
    after_resume = gathered(continued)
    uninterrupted = trainer_in(world, shared_tmp_path / "uninterrupted", 2 * STEPS, 100 + world.rank, **settings)
    uninterrupted.fit()
    continued_off = differences(after_resume, gathered(uninterrupted))
    resumed = {name: differences(resumed_from(world, checkpoint, shared_tmp_path / f"resume-{name}", **layout), saved)
               for name, layout in resumes.items()}
    # One process reads the files: what each holds, consolidated, exported to Hugging Face's format.
    return saved, read_on_root(world, checkpoint, saved, shared_tmp_path), continued_off, resumed


@pytest.mark.timeout(600)
def test_each_expert_is_written_once_and_the_checkpoint_reshards_to_any_expert_parallel(world, shared_tmp_path):
    if world.size % 2:
        pytest.skip("expert_parallel=2 needs an even world")
    saved, seen, continued_off, resumed = save_continue_and_resume(
        world, shared_tmp_path, {"expert_parallel": 2, "checkpoint_format": "sharded"}, layouts(world))

    assert "error" not in seen, seen["error"]
    whole = {name: saved["model"][name].numel() for name in expert_names(saved["model"])}
    assert whole and seen["on_disk"] == whole, "every expert once: the whole experts' elements, no more"
    assert all(ranks == [0, 1] for ranks in seen["holders"].values()), seen["holders"]  # the first expert group
    assert seen["codes"] == [0, 0] and seen["files"] == world.size
    assert continued_off == [], "the continued run left the uninterrupted one"
    assert set(resumed) == set(layouts(world)) and all(wrong == [] for wrong in resumed.values()), resumed
    assert seen["consolidated"] == [] and seen["exported"] == [] and seen["logits_equal"]


FSDP_EXPERTS = {"strategy": "fsdp", "expert_parallel": 2, "checkpoint_format": "sharded"}


def fsdp_layouts(world):
    """The layouts an fsdp x E=2 checkpoint is resumed under: E=1 (ddp, full; fsdp, sharded), ddp x E=2
    and, where it fits, fsdp x E=4."""
    found = {"E1": {"checkpoint_format": "full"}, "E1-fsdp": {"strategy": "fsdp", "checkpoint_format": "sharded"},
             "E2-ddp": {"expert_parallel": 2, "checkpoint_format": "sharded"}}
    if world.size % 4 == 0:
        found["E4-fsdp"] = {**FSDP_EXPERTS, "expert_parallel": 4}
    return found


@pytest.mark.timeout(600)
def test_fsdp_with_experts_writes_its_own_slices_and_each_expert_once_and_reshards(world, shared_tmp_path):
    if world.size % 2:
        pytest.skip("expert_parallel=2 needs an even world")
    saved, seen, continued_off, resumed = save_continue_and_resume(world, shared_tmp_path, FSDP_EXPERTS,
                                                                   fsdp_layouts(world))

    assert "error" not in seen, seen["error"]
    whole = {name: saved["model"][name].numel() for name in expert_names(saved["model"])}
    assert whole and seen["on_disk"] == whole, "every expert once: the whole experts' elements, no more"
    assert all(ranks == [0, 1] for ranks in seen["holders"].values()), seen["holders"]  # the first expert group
    assert seen["rest_held_otherwise"] == [], "every other tensor's elements once over the files"
    assert seen["rest_writers"] == list(range(world.size)), "each rank writes its own slices: nothing gathered"
    assert seen["codes"] == [0, 0] and seen["files"] == world.size
    assert continued_off == [], "the continued run left the uninterrupted one"
    assert set(resumed) == set(fsdp_layouts(world)) and all(wrong == [] for wrong in resumed.values()), resumed
    assert seen["consolidated"] == [] and seen["exported"] == [] and seen["logits_equal"]


@pytest.mark.timeout(300)
def test_an_fsdp_with_experts_checkpoint_resharded_into_other_layer_sizes_is_refused_on_every_rank(world,
                                                                                                  shared_tmp_path):
    """Its flat ranges carry their tensor's shape: resumed under plain fsdp by a model whose dense MLP
    is narrower (the same names), every rank refuses it naming the tensor, both shapes and what to do."""
    if world.size % 2:
        pytest.skip("expert_parallel=2 needs an even world")
    written = trainer_in(world, shared_tmp_path / "ckpt", STEPS, 100 + world.rank, **FSDP_EXPERTS)
    written.fit()
    written.close_mesh()
    if world.is_root:
        (shared_tmp_path / "resume").mkdir()
        (shared_tmp_path / "resume" / f"ckpt-{STEPS:09d}").symlink_to(shared_tmp_path / "ckpt" / f"ckpt-{STEPS:09d}")
    collectives.barrier()
    torch.manual_seed(5)
    narrower = transformers.AutoModelForCausalLM.from_config(
        transformers.Qwen3MoeConfig(**{**SHAPE, "intermediate_size": 40}, head_dim=8, num_experts=4,
                                    moe_intermediate_size=16, mlp_only_layers=[1]), experts_implementation="eager")
    try:
        make_trainer(world, narrower.double(), token_data(), max_steps=STEPS, strategy="fsdp",
                     checkpoint_format="sharded", checkpoint_dir=str(shared_tmp_path / "resume"))
        outcome = "no error"
    except CheckpointError as error:
        outcome = str(error)
    outcomes = collectives.allgather_object(outcome, name="ep_checkpoint.other_sizes")

    assert len(set(outcomes)) == 1, f"the ranks did not agree: {outcomes}"
    assert "mlp.gate_proj.weight" in outcomes[0] and "float64 of shape [48, 32]" in outcomes[0], outcomes[0]
    assert "this model's float64 of shape [40, 32]" in outcomes[0], outcomes[0]
    assert "it belongs to another model" in outcomes[0] and "fresh checkpoint_dir" in outcomes[0], outcomes[0]


@pytest.mark.timeout(300)
def test_a_ddp_with_experts_sharded_checkpoint_resumes_under_fsdp_with_experts_exactly(world, shared_tmp_path):
    if world.size % 2:
        pytest.skip("expert_parallel=2 needs an even world")
    directory = shared_tmp_path / "ckpt"
    written = trainer_in(world, directory, STEPS, 100 + world.rank, expert_parallel=2, checkpoint_format="sharded")
    written.fit()
    saved = gathered(written)
    resumed = resumed_from(world, directory / f"ckpt-{STEPS:09d}", shared_tmp_path / "resume", **FSDP_EXPERTS)

    assert differences(resumed, saved) == []


@pytest.mark.timeout(300)
def test_a_zero1_sharded_checkpoint_at_e1_resumes_at_e2_exactly(world, shared_tmp_path):
    if world.size % 2:
        pytest.skip("expert_parallel=2 needs an even world")
    directory = shared_tmp_path / "ckpt"
    written = trainer_in(world, directory, STEPS, 100 + world.rank, strategy="zero1", checkpoint_format="sharded")
    written.fit()
    saved = gathered(written)
    resumed = resumed_from(world, directory / f"ckpt-{STEPS:09d}", shared_tmp_path / "resume",
                           expert_parallel=2, checkpoint_format="sharded")

    assert differences(resumed, saved) == []


@pytest.mark.timeout(300)
def test_a_full_checkpoint_resumed_at_another_e_starts_the_averages_anew(world, shared_tmp_path):
    """An EMA at E=2 averages each rank's expert shares; resumed at E=1 (every expert whole) its
    averages cannot be the rank's saved ones: they start anew from the loaded weights (the
    checkpoint's per-rank state was restored, and the first step refused the shapes, before)."""
    from hvdtrain.components.callbacks import EMA
    from hvdtrain.config.train import TrainConfig
    from hvdtrain.trainer import Trainer
    from tests.mpi.test_hf_moe import BATCH, SEED, moe_step

    if world.size % 2:
        pytest.skip("expert_parallel=2 needs an even world")

    def run(max_steps, seed, ema, **settings):
        model = make_model(FAMILY, seed)
        config = TrainConfig(epochs=1, batch_size=BATCH, scale_lr=False, warmup_epochs=0, max_steps=max_steps,
                             seed=SEED, log_every=1000, tensorboard=False,
                             checkpoint_dir=str(shared_tmp_path / "ckpt"), **settings)
        trainer = Trainer(model, torch.optim.AdamW(model.parameters(), lr=0.01), token_data(), None, config,
                          world=world, step_fn=moe_step, callbacks=[ema])
        trainer.fit()
        shapes = [tuple(p.shape) for p in trainer.strategy.owned_parameters()]
        trainer.close_mesh()
        return shapes

    run(STEPS, 100 + world.rank, EMA(decay=0.9), expert_parallel=2)
    resumed = EMA(decay=0.9)
    shapes = run(STEPS + 1, 200, resumed)

    assert resumed.updates == 1, "the averages started at the resumed step"
    assert [tuple(a.shape) for a in resumed.averages] == shapes
