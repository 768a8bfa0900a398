"""Sequence parallelism (Ulysses) takes one process's steps: each rank of a sequence group holds
1/S of every sequence, attention runs on whole sequences of 1/S of the heads between two
all-to-alls, and the gradients are reduced by the data-parallel strategy over every rank.

Hugging Face decoders through transformers' attention interface: Llama (grouped-query attention,
2 key/value heads: divided at S=2, replicated onto the ranks at S=4), Qwen3 (per-head q/k norms) and
SmolLM3 (layers without rotary embeddings between rotary ones; named by no other test), under ddp
and fsdp, at S=2 (2 ranks), S=4 and S=2 x D=2 (4 ranks); hvdtrain's example transformer (learned
positions from token_offset()); a tokenized batch with padding and ignored labels, the model's own
loss, averaged over every counted token as one process does; and the refusals: heads that do not
split, and a model that mixes tokens outside attention (found by set-up's probe, before a step).

Float64 throughout (hvdtrain.verify.exact). Why 1e-10 holds on any x86-64 CPU: the all-to-alls move
values without arithmetic; each rank's attention over whole sequences computes what one process's
does for those heads; the partial gradients of the group's ranks are summed by the strategy's
all-reduce: only the order of float64 additions differs (relative 1e-16 per operation, a few hundred
per step, 3 steps), while a token at the wrong position, a lost head or a loss counted per part
moves values by more than 1e-4 (checked by how far training moved them).
"""
import copy

import pytest
import torch
from torch.utils.data import TensorDataset

from hvdtrain.common.errors import LayoutError
from hvdtrain.config.train import TrainConfig
from hvdtrain.data.sharding import ShardedSampler
from hvdtrain.distributed import collectives
from hvdtrain.examples.textlm import TinyTransformerLM, lm_loss
from hvdtrain.examples.textlm_parallel import tensor_plan
from hvdtrain.parallel.model_plan import ModelPlan
from hvdtrain.trainer import Trainer
from hvdtrain.verify.exact import float64_throughout
from tests.mpi import helpers
from tests.mpi.helpers import record_step_losses

transformers = pytest.importorskip("transformers")

pytestmark = [
    pytest.mark.mpi,
    pytest.mark.process_sets,
    pytest.mark.np4(reason="S=4 and S=2 x D=2 fit only at 4 ranks"),
]

VOCAB, SEQ, BATCH, STEPS, SEED = 64, 16, 4, 3, 7
SHAPE = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=8,
             num_key_value_heads=2, max_position_embeddings=SEQ)
FAMILIES = {
    "llama": lambda: transformers.LlamaConfig(**SHAPE, tie_word_embeddings=True),
    "qwen3": lambda: transformers.Qwen3Config(**SHAPE, head_dim=8, tie_word_embeddings=False),
    # Layer 1 of 2 without rotary embeddings (no_rope_layer_interval=2): positions matter only where used.
    "smollm3": lambda: transformers.SmolLM3Config(**SHAPE, no_rope_layer_interval=2, pad_token_id=0, bos_token_id=1,
                                                 eos_token_id=2, tie_word_embeddings=False),
}


def hf_model(family, seed):
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(FAMILIES[family]()).double()


def example_model(seed):
    torch.manual_seed(seed)
    return TinyTransformerLM(VOCAB, seq_len=SEQ, d_model=32, layers=2, heads=4).double()


def causal_lm_step(model, batch):
    inputs, targets = batch
    logits = model(input_ids=inputs).logits
    return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1)), {}


def example_step(model, batch):
    inputs, targets = batch
    return lm_loss(model(inputs), targets), {}


def groups_of(world, sequence):
    if world.size % sequence:  # the same decision on every rank
        pytest.skip(f"sequence_parallel={sequence} does not divide {world.size} ranks")
    return world.size // sequence


def train(world, make, step_fn, data, sequence, strategy, collate_fn=None, tensor=1):
    """(initial gathered model, final gathered model, each step's loss averaged over the world). Under
    tensor parallelism a Hugging Face model's own tp_plan splits it; the example's is textlm_parallel's."""
    model = make(100 + world.rank)  # different on every rank: set-up must broadcast rank 0's
    config = TrainConfig(epochs=1, batch_size=BATCH, lr=0.01, scale_lr=False, warmup_epochs=0, max_steps=STEPS,
                         seed=SEED, log_every=1000, tensorboard=False, strategy=strategy, sequence_parallel=sequence,
                         tensor_parallel=tensor)
    plan = ModelPlan(tensor_plan=tensor_plan(model)) if tensor > 1 and isinstance(model, TinyTransformerLM) else None
    trainer = Trainer(model, torch.optim.AdamW(model.parameters(), lr=0.01), data, None, config, world=world,
                      step_fn=step_fn, collate_fn=collate_fn, model_plan=plan)
    initial = copy.deepcopy(trainer.strategy.state_dict()["model"])
    losses = record_step_losses(trainer)
    trainer.fit()
    final = trainer.strategy.state_dict()["model"]
    trainer.close_mesh()
    step_losses = collectives.allreduce_sum(torch.stack(losses), name=f"sp.{sequence}.{strategy}.{tensor}.losses") / world.size
    return initial, final, step_losses


def one_process(make, initial, batches, loss_of):
    """The reference: each step's global batch in the sampler's order; ``loss_of(model, indices)``,
    the mean of the data-parallel groups' batch losses (as ddp averages them)."""
    model = make(0)
    model.load_state_dict(initial)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    losses = []
    for indices in batches:
        optimizer.zero_grad()
        loss = loss_of(model, indices)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return model.state_dict(), losses


def step_batches(samples, groups):
    sampler = ShardedSampler(samples, rank=0, world_size=1, seed=SEED)
    sampler.set_epoch(0)
    order = list(sampler)
    size = BATCH * groups
    return [order[step * size:(step + 1) * size] for step in range(STEPS)]


def check(expected, expected_losses, initial, final, step_losses):
    worst = max((final[name] - expected[name]).abs().max().item() for name in expected)
    moved = min((expected[name] - initial[name]).abs().max().item() for name in expected if name.endswith("weight"))
    loss_error = (step_losses - torch.tensor(expected_losses, dtype=torch.float64)).abs().max().item()
    assert moved > 1e-4, "training did not move every weight: the test proves nothing"
    assert loss_error < 1e-10, f"per-step loss against one process: {step_losses.tolist()} vs {expected_losses}"
    assert worst < 1e-10, f"max |gathered - one process| = {worst}"


def pair_loss(step_fn, data):
    def loss_of(model, indices):
        return step_fn(model, (data.tensors[0][indices], data.tensors[1][indices]))[0]
    return loss_of


@pytest.mark.timeout(240)
@pytest.mark.parametrize("sequence,strategy", [(2, "ddp"), (2, "fsdp"), (4, "ddp")])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_hugging_face_decoders_take_one_process_steps(world, family, sequence, strategy):
    groups = groups_of(world, sequence)
    data = helpers.token_data(VOCAB, SEQ)
    make = lambda seed: hf_model(family, seed)  # noqa: E731
    with float64_throughout():
        initial, final, step_losses = train(world, make, causal_lm_step, data, sequence, strategy)
        # D groups: ddp's mean of the groups' batch means; each group's batch is consecutive in the global one.
        loss_of = lambda model, indices: torch.stack([  # noqa: E731
            pair_loss(causal_lm_step, data)(model, part) for part in torch.tensor(indices).chunk(groups)]).mean()
        expected, expected_losses = one_process(make, initial, step_batches(len(data), groups), loss_of)
    check(expected, expected_losses, initial, final, step_losses)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("sequence", [2, 4])
def test_the_example_transformer_takes_one_process_steps(world, sequence):
    groups = groups_of(world, sequence)
    data = helpers.token_data(VOCAB, SEQ)
    with float64_throughout():
        initial, final, step_losses = train(world, example_model, example_step, data, sequence, "ddp")
        loss_of = lambda model, indices: torch.stack([  # noqa: E731
            pair_loss(example_step, data)(model, part) for part in torch.tensor(indices).chunk(groups)]).mean()
        expected, expected_losses = one_process(example_model, initial, step_batches(len(data), groups), loss_of)
    check(expected, expected_losses, initial, final, step_losses)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("model", ["llama", "qwen3", "example"])
def test_sequence_groups_inside_tensor_parallelism_take_one_process_steps(world, model):
    """T=2 x S=2: each tensor group's two ranks hold the same tokens and half the heads (Llama: 4 of 8
    query heads, 1 of 2 key/value heads, replicated onto the sequence group's two ranks), and the
    sequence group's two ranks split those heads again around attention; the mesh's data group
    (both sequence ranks of a tensor index) sums their partial gradients."""
    if world.size % 4:
        pytest.skip("tensor_parallel=2 x sequence_parallel=2 needs a multiple of 4 ranks")
    groups = world.size // 4
    data = helpers.token_data(VOCAB, SEQ)
    make = example_model if model == "example" else (lambda seed: hf_model(model, seed))  # noqa: E731
    step_fn = example_step if model == "example" else causal_lm_step
    with float64_throughout():
        initial, final, step_losses = train(world, make, step_fn, data, 2, "ddp", tensor=2)
        loss_of = lambda model, indices: torch.stack([  # noqa: E731
            pair_loss(step_fn, data)(model, part) for part in torch.tensor(indices).chunk(groups)]).mean()
        expected, expected_losses = one_process(make, initial, step_batches(len(data), groups), loss_of)
    check(expected, expected_losses, initial, final, step_losses)


def padded_tokens(samples=64):
    """Tokenized samples as a data collator gives them: trailing padding (1 to 7 tokens) masked out and
    its labels ignored, so each sequence counts another number of targets."""
    generator = torch.Generator().manual_seed(5)
    ids = torch.randint(0, VOCAB, (samples, SEQ), generator=generator)
    kept = SEQ - torch.randint(1, 8, (samples,), generator=generator)
    mask = (torch.arange(SEQ) < kept[:, None]).long()
    labels = ids.masked_fill(mask == 0, -100)
    return [{"input_ids": ids[i], "attention_mask": mask[i], "labels": labels[i]} for i in range(samples)]


@pytest.mark.timeout(240)
def test_a_padded_batch_with_the_models_own_loss_counts_every_target_once(world):
    """The default step (``model(**batch).loss``): its mean over the group's counted targets, not of the parts' means."""
    if world.size == 1:
        pytest.skip("one rank has no sequence group")
    samples = padded_tokens()
    make = lambda seed: hf_model("llama", seed)  # noqa: E731
    stacked = {key: torch.stack([s[key] for s in samples]) for key in samples[0]}
    with float64_throughout():
        model = make(100 + world.rank)
        config = TrainConfig(epochs=1, batch_size=BATCH, lr=0.01, scale_lr=False, warmup_epochs=0, max_steps=STEPS,
                             seed=SEED, log_every=1000, tensorboard=False, sequence_parallel=world.size)
        trainer = Trainer(model, torch.optim.AdamW(model.parameters(), lr=0.01), samples, None, config, world=world)
        initial = copy.deepcopy(trainer.strategy.state_dict()["model"])
        losses = record_step_losses(trainer)
        trainer.fit()
        final = trainer.strategy.state_dict()["model"]
        trainer.close_mesh()
        step_losses = collectives.allreduce_sum(torch.stack(losses), name="sp.padded.losses") / world.size
        loss_of = lambda model, indices: model(**{k: v[indices] for k, v in stacked.items()}).loss  # noqa: E731
        expected, expected_losses = one_process(make, initial, step_batches(len(samples), 1), loss_of)
    check(expected, expected_losses, initial, final, step_losses)


def refusal(world, model, step_fn=causal_lm_step):
    """The error set-up raised on this rank (None if it trained), agreed over the world before asserting."""
    config = TrainConfig(epochs=1, batch_size=BATCH, lr=0.01, warmup_epochs=0, max_steps=1, seed=SEED, log_every=1000,
                         tensorboard=False, sequence_parallel=world.size)
    error = None
    try:
        trainer = Trainer(model, torch.optim.AdamW(model.parameters(), lr=0.01), helpers.token_data(VOCAB, SEQ), None,
                          config, world=world, step_fn=step_fn)
        trainer.close_mesh()
    except LayoutError as raised:
        error = str(raised)
    collectives.allgather_object(error, name="sp.refusal")
    return error


@pytest.mark.timeout(120)
def test_heads_that_do_not_split_are_refused_by_name(world):
    if world.size == 1:
        pytest.skip("one rank has no sequence group")
    torch.manual_seed(0)
    heads = world.size + 1  # a multiple of no S > 1 that divides the world
    model = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(
        **{**SHAPE, "hidden_size": 8 * heads, "num_attention_heads": heads, "num_key_value_heads": 1, "head_dim": 8}))
    error = refusal(world, model)
    assert error is not None and f"{heads} query heads, not a multiple of {world.size}" in error


@pytest.mark.timeout(120)
def test_a_model_that_mixes_tokens_outside_attention_is_refused_before_a_step(world):
    """A token shift in an MLP (as convolutional or RWKV-style layers do) sees only this rank's part:
    the probe finds the split model's loss off and refuses, where training would have differed."""
    if world.size == 1:
        pytest.skip("one rank has no sequence group")
    model = hf_model("llama", 0)
    mlp = model.model.layers[0].mlp
    own = mlp.forward
    mlp.forward = lambda x: own(torch.roll(x, 1, dims=1))
    with float64_throughout():
        error = refusal(world, model)
    assert error is not None and "would train another model than one process" in error, error
    assert "mixes tokens outside its attention" in error


@pytest.mark.timeout(120)
def test_a_split_that_differs_on_one_rank_is_refused_alike_on_every_rank(world):
    """The last rank's split logits moved by a constant (softmax's loss unchanged: only that rank sees
    it, as only the later ranks see a causal convolution's missing context): every rank raises the
    same error, naming that rank and its figures, where the others said only that another rank differs."""
    from hvdtrain.parallel.sequence.probe import TOKENS_PER_RANK

    if world.size == 1:
        pytest.skip("one rank has no sequence group")
    model = hf_model("llama", 0)
    head, last = model.lm_head, world.size - 1
    own = head.forward
    # Only the split probe's forward has TOKENS_PER_RANK positions on a rank (the whole probe has S x that).
    head.forward = lambda x: own(x) + (1.0 if world.rank == last and x.shape[1] == TOKENS_PER_RANK else 0.0)
    with float64_throughout():
        error = refusal(world, model)
    every = collectives.allgather_object(error, name="sp.one_rank_refusal")
    assert error is not None and len(set(every)) == 1, every
    assert f"rank {last} of {world.size}: on a probe of {TOKENS_PER_RANK * world.size} tokens" in error, error
    assert "the logits are" in error and "another rank's split model differs" not in error


@pytest.mark.timeout(240)
def test_activation_bytes_per_rank_are_the_sequences_share(world):
    """What autograd keeps for backward in one step, counted per rank (each storage once, parameters
    excluded: hvdtrain.bench.sequence.worker): 1/S of one rank's whole-sequence step, plus, per layer,
    the attention's output in the tokens' layout (B x T/S x width floats), which one process keeps as
    the same storage as attention's own saved output, and sequence parallelism cannot (that one is
    laid out by heads). Exact byte counts: the same on any machine."""
    if world.size == 1:
        pytest.skip("one rank has no sequence group")
    from hvdtrain.bench.sequence.worker import SavedActivations
    length, width, layers = 256, 64, 2
    counted = {}
    for sequence in (1, world.size):
        torch.manual_seed(0)
        model = TinyTransformerLM(VOCAB, seq_len=length, d_model=width, layers=layers, heads=8)
        ids = torch.randint(0, VOCAB, (8, length + 1), generator=torch.Generator().manual_seed(1))
        config = TrainConfig(epochs=1, batch_size=1, max_steps=1, lr=1e-3, warmup_epochs=0, progress="off",
                             tensorboard=False, sequence_parallel=sequence)
        trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=1e-3), TensorDataset(ids[:, :-1], ids[:, 1:]),
                          None, config, world=world, loss_fn=lm_loss)
        saved = SavedActivations(trainer.model)
        with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda tensor: tensor):
            trainer.fit()
        trainer.close_mesh()
        counted[sequence] = saved.bytes
    every = helpers.agreed([counted[1], counted[world.size]], name="sp.activations")
    formula = counted[1] / world.size + layers * (length // world.size) * width * 4
    for whole, split in every.tolist():
        assert whole == counted[1]  # every rank keeps the same for a whole sequence
        assert abs(split - formula) <= 0.01 * formula, f"{split:.0f} bytes against {formula:.0f} (1/S: {whole / world.size:.0f})"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["hf", "example"])
def test_a_forward_of_your_own_on_whole_sequences_is_one_processes(world, kind):
    """Outside the Trainer's step (an evaluation of your own, generation) the model attends whole
    sequences as one process does: no exchange, no rank's part taken for the whole."""
    if world.size == 1:
        pytest.skip("one rank has no sequence group")
    make = (lambda seed: hf_model("llama", seed)) if kind == "hf" else example_model  # noqa: E731
    with float64_throughout():
        model = make(0)
        config = TrainConfig(epochs=1, batch_size=BATCH, lr=0.01, warmup_epochs=0, max_steps=1, seed=SEED,
                             log_every=1000, tensorboard=False, sequence_parallel=world.size)
        trainer = Trainer(model, torch.optim.AdamW(model.parameters(), lr=0.01), helpers.token_data(VOCAB, SEQ), None,
                          config, world=world, step_fn=causal_lm_step if kind == "hf" else example_step)
        trainer.fit()
        whole = make(1)
        whole.load_state_dict(trainer.strategy.state_dict()["model"])
        ids = helpers.token_data(VOCAB, SEQ).tensors[0][:2]
        with torch.no_grad():
            mine = trainer.model(input_ids=ids).logits if kind == "hf" else trainer.model(ids)
            expected = whole(input_ids=ids).logits if kind == "hf" else whole(ids)
        trainer.close_mesh()
    worst = helpers.agreed([(mine - expected).abs().max().item()], name="sp.own.forward")
    assert worst.max().item() < 1e-12, worst.tolist()


@pytest.mark.timeout(60)
def test_your_own_loop_is_refused_by_name(world):
    """The Session's loop runs the forward itself, on whole batches: sequence parallelism cannot cut them."""
    if world.size == 1:
        pytest.skip("one rank has no sequence group")
    import hvdtrain
    config = TrainConfig(epochs=1, batch_size=BATCH, sequence_parallel=world.size, tensorboard=False)
    model = example_model(0)
    with pytest.raises(ValueError, match="use hvdtrain.Trainer"):
        hvdtrain.setup(model, torch.optim.SGD(model.parameters(), lr=0.1), helpers.token_data(VOCAB, SEQ),
                       config=config, world=world)


def packed_rows():
    """Rows of 16 tokens packing documents of 2 to 9 tokens (positions restarting at each, -100 at each
    document's first label), so that boundaries fall in every rank's part of the rows."""
    from hvdtrain.data.packing import packed

    generator = torch.Generator().manual_seed(9)
    lengths = torch.randint(2, 10, (120,), generator=generator).tolist()
    documents = [torch.randint(0, VOCAB, (length,), generator=generator) for length in lengths]
    return list(packed(documents, row_length=SEQ))


@pytest.mark.timeout(240)
@pytest.mark.parametrize("sequence", [2, 4])
def test_packed_rows_keep_their_documents_apart_across_the_split(world, sequence):
    """Packed rows (hvdtrain.packed, packed_lm_step): each rank holds part of every row, documents cross
    the parts, and attention stays within each document over the whole row, as one process computes it
    (transformers finds the documents in the whole rows' positions, not in a rank's part of them). The
    loss is the token mean over the global batch: the reported train_loss is one process's."""
    from hvdtrain.data.packing import causal_items, packed_lm_step

    groups = groups_of(world, sequence)
    rows = packed_rows()
    stacked = {key: torch.stack([row[key] for row in rows]) for key in rows[0]}
    starts = [(stacked["position_ids"][:, part * SEQ // sequence:(part + 1) * SEQ // sequence] == 0).any()
              for part in range(sequence)]
    assert all(starts), "a document starts in every rank's part of the rows"
    with float64_throughout():
        model = hf_model("llama", 100 + world.rank)
        config = TrainConfig(epochs=1, batch_size=BATCH, lr=0.01, scale_lr=False, max_steps=STEPS, seed=SEED,
                             log_every=1000, tensorboard=False, sequence_parallel=sequence)
        trainer = Trainer(model, torch.optim.AdamW(model.parameters(), lr=0.01), rows, None, config, world=world,
                          step_fn=packed_lm_step)
        initial = copy.deepcopy(trainer.strategy.state_dict()["model"])
        reported = trainer.fit()[-1]["train_loss"]
        final = trainer.strategy.state_dict()["model"]
        trainer.close_mesh()
        batches = step_batches(len(rows), groups)
        loss_of = lambda model, indices: packed_lm_step(model, {k: v[indices] for k, v in stacked.items()})[0]  # noqa: E731
        expected, expected_losses = one_process(lambda seed: hf_model("llama", seed), initial, batches, loss_of)
    counts = [causal_items(stacked["labels"][indices]) for indices in batches]
    token_mean = sum(loss * count for loss, count in zip(expected_losses, counts)) / sum(counts)
    worst = max((final[name] - expected[name]).abs().max().item() for name in expected)
    moved = min((expected[name] - initial[name]).abs().max().item() for name in expected if name.endswith("weight"))
    assert moved > 1e-4, "training did not move every weight: the test proves nothing"
    assert worst < 1e-10, f"max |gathered - one process| = {worst}"
    assert abs(reported - token_mean) < 1e-10, f"train_loss {reported} against one process's {token_mean}"
