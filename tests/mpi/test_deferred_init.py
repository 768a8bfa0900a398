"""A model built on the meta device, given its values by the Trainer: equal, bitwise, to the model
built whole from the same seed under every data-parallel strategy, then trained alike; under fsdp no
rank ever holds it whole. Tensors nothing initializes, and initializations fsdp cannot run unit by
unit, are refused by name on every rank."""
import contextlib

import pytest
import torch
from torch import nn

from hvdtrain.config.train import TrainConfig
from hvdtrain.distributed import collectives
from hvdtrain.strategies.deferred_init import meta_parameters
from hvdtrain.trainer import Trainer
from hvdtrain.strategies.sharding import storage
from tests.mpi.helpers import synthetic_classification

# The launches of scripts/run_tests.sh this file runs in besides the one at $NP ranks under MPI,
# each with what it shows there (the markers: setup.cfg).
pytestmark = [
    pytest.mark.mpi,
    pytest.mark.np1(reason="one rank holds every weight whole"),
    pytest.mark.np4(reason="fsdp's shards of the meta-device model change with the world size; T=2 x P=2 fits at 4"),
]

SEED, FEATURES, CLASSES = 11, 12, 4


class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.linear = nn.Linear(width, width)

    def forward(self, x):
        return x + torch.tanh(self.linear(self.norm(x)))


class Net(nn.Module):
    """Blocks in a ModuleList (fsdp's units) between an input layer and a head (fsdp's root)."""

    def __init__(self, width=24, blocks=3):
        super().__init__()
        self.embed = nn.Linear(FEATURES, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(blocks))
        self.head = nn.Linear(width, CLASSES)

    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def trainer(world, model, strategy, steps=3, checkpoint_dir=None, **kwargs):
    config = TrainConfig(epochs=1, batch_size=8, lr=0.05, warmup_epochs=0, max_steps=steps, seed=SEED,
                         strategy=strategy, log_every=1000, tensorboard=False, checkpoint_dir=checkpoint_dir)
    dtype = next(model.parameters()).dtype  # the data in the model's precision
    return Trainer(model, torch.optim.AdamW(model.parameters(), lr=config.lr),
                   synthetic_classification(dtype=dtype), None, config, world=world, **kwargs)


def gathered(trainer):
    """The model's whole state on every rank (a collective under the sharded strategies)."""
    return {name: value.clone() for name, value in trainer.strategy.state_dict()["model"].items()}


def differences(state, expected):
    assert state.keys() == expected.keys()
    return [name for name in expected if not torch.equal(state[name], expected[name])]


def assert_trained_alike(world, trained, expected):
    """Two runs of the same steps from the same values, in float64: equal bitwise up to 2 ranks
    (a + b = b + a); beyond, Horovod's fusion groups the gradients as they come ready, which may
    differ between two runs, and Gloo's all-reduce then sums 4 terms in another order: a float64
    rounding (1e-16 relative) per step. AdamW's step divides the first moment by the root of the
    second, so a relative change of a gradient moves the step by about as much (more only where a
    gradient is near AdamW's eps, 1e-8, and then by lr x 1e-16 x |g| / 1e-8); over a few steps that
    stays below 1e-13, so 1e-10 holds on any CPU and a wrong tensor still differs by > 1e-3. (In
    float32 the same reasoning gives ~1e-7 per step, which Adam's sign-like first steps can amplify
    past any bound worth asserting: 1.25e-6 was seen.)"""
    if world.size <= 2:
        assert differences(trained, expected) == []
    else:
        worst = max((trained[name] - expected[name]).abs().max().item() for name in expected)
        assert worst < 1e-10, f"max difference between the two runs: {worst}"


class float64_by_default:
    """Modules built inside are float64 from their first draw (a meta-built model's replayed
    initialization too): training them can be compared tightly at any world size."""

    def __enter__(self):
        self.before = torch.get_default_dtype()
        torch.set_default_dtype(torch.float64)

    def __exit__(self, *exc):
        torch.set_default_dtype(self.before)


@pytest.mark.parametrize("strategy", ["ddp", "zero1", "zero2", "fsdp"])
def test_a_model_built_on_meta_starts_and_trains_as_the_model_built_whole(world, strategy):
    torch.manual_seed(SEED)
    with float64_by_default():
        whole_model = Net()
    expected_start = {name: value.clone() for name, value in whole_model.state_dict().items()}
    with torch.device("meta"), float64_by_default():
        meta_model = Net()
    from_meta, whole = trainer(world, meta_model, strategy), trainer(world, whole_model, strategy)
    start = gathered(from_meta)
    from_meta.fit()
    whole.fit()
    trained, expected_trained = gathered(from_meta), gathered(whole)

    # The same random numbers in the same order as the constructors drew them, every rank alike:
    # equal bitwise. Three steps of the same strategy on the same data then stay alike.
    assert differences(start, expected_start) == []
    assert_trained_alike(world, trained, expected_trained)
    assert differences(trained, expected_start) != []  # it did train


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_model_built_on_meta_resumes_from_its_checkpoint_as_the_run_that_went_on(world, tmp_path, strategy):
    """Two steps, a full checkpoint, then a second model built on the meta device resumes: it starts
    from the checkpoint's values (not from train.seed's initialization) and its five steps are the
    run's that never stopped."""
    base = collectives.allgather_object(str(tmp_path), name=f"deferred.resume.{strategy}.dir")[0]

    def run(directory, steps):
        with torch.device("meta"), float64_by_default():
            model = Net()
        built = trainer(world, model, strategy, steps=steps, checkpoint_dir=f"{base}/{directory}")
        start = gathered(built)
        built.fit()
        return start, gathered(built), built.global_step

    initial, went_on, _ = run("whole", 5)
    _, stopped, _ = run("stopped", 2)
    resumed_start, resumed, resumed_steps = run("stopped", 5)

    assert differences(resumed_start, stopped) == [] and differences(stopped, initial) != []
    assert resumed_steps == 5
    assert_trained_alike(world, resumed, went_on)


def hugging_face_model(family):
    """A toy-size model of each family, with its own quirks: Llama's and Qwen2's grouped-query
    attention and rotary buffers, GPT-2's Conv1D projections (initialized inline in __init__) and
    its projection scaling from the parent module, all with tied embeddings."""
    from tests.mpi.hf_models import SEQ, VOCAB, transformers

    sizes = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=SEQ, tie_word_embeddings=True)
    if family == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**sizes))
    if family == "qwen2":
        return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**sizes))
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2,
                                                                  n_head=4, bos_token_id=0, eos_token_id=0))


@pytest.mark.parametrize("family", ["llama", "qwen2", "gpt2"])
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_hugging_face_model_built_on_meta_equals_it_built_whole(world, strategy, family):
    from tests.mpi.hf_models import trainer_for

    torch.manual_seed(3)  # trainer_for's train.seed
    whole = hugging_face_model(family)
    with torch.device("meta"):
        meta_model = hugging_face_model(family)
    built = trainer_for(world, strategy, meta_model, max_steps=1)
    start = gathered(built)
    held = built.parts.initialization.peak_bytes
    whole_bytes = sum(p.numel() * p.element_size() for p in whole.parameters())

    # The constructors' draws and each Hugging Face model's own post_init pass, in the order building
    # the model whole ran them (rotary buffers included): equal bitwise.
    assert differences(start, whole.state_dict()) == []
    output, input = meta_model.get_output_embeddings(), meta_model.get_input_embeddings()
    assert output.weight is input.weight  # still tied
    if strategy == "fsdp":  # the root (tied embedding, final norm) and one decoder layer at a time
        assert held < whole_bytes


def test_under_fsdp_no_rank_holds_the_whole_model_while_initializing(world):
    with torch.device("meta"):
        model = Net(width=64, blocks=6)
    built = trainer(world, model, "fsdp", steps=1)
    strategy = built.strategy
    whole_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    freed = all(not storage.is_allocated(bucket.flat_param) for bucket in strategy.buckets)
    peaks = collectives.allgather_object(built.parts.initialization.peak_bytes, name="test.deferred.peak")

    # The root (input layer and head) whole the whole time, one block's buffer at a time besides:
    # what every forward holds. Six blocks of 64 x 64: the model is several times that.
    assert peaks == [strategy.root.full_bytes + max(unit.full_bytes for unit in strategy.units)] * world.size
    assert peaks[0] < whole_bytes / 3
    assert freed


class Scaled(Net):
    """A parameter of its own and no reset_parameters: nothing in torch initializes it."""

    def __init__(self):
        super().__init__()
        self.gain = nn.Parameter(torch.ones(CLASSES))

    def forward(self, x):
        return super().forward(x) * self.gain


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_tensor_nothing_initializes_is_named_and_init_fn_fills_it(world, strategy):
    with torch.device("meta"):
        model = Scaled()
    with pytest.raises(ValueError, match=r"gain built on the meta device and nothing initialized it.*init_fn"):
        trainer(world, model, strategy)

    def ones_for_gain(module):
        if isinstance(module, Scaled):
            nn.init.ones_(module.gain)

    with torch.device("meta"):
        model = Scaled()
    state = gathered(trainer(world, model, strategy, init_fn=ones_for_gain))
    torch.manual_seed(SEED)
    expected = Scaled().state_dict()
    assert differences(state, expected) == []


class ComputedBuffer(Net):
    def __init__(self):
        super().__init__()
        self.register_buffer("scale", torch.linspace(0.5, 1.5, CLASSES))

    def forward(self, x):
        return super().forward(x) * self.scale


def test_a_buffer_computed_in_init_needs_meta_parameters(world):
    with torch.device("meta"):
        lost = ComputedBuffer()
    with pytest.raises(ValueError, match=r"scale built on the meta device.*hvdtrain.meta_parameters"):
        trainer(world, lost, "fsdp")
    with meta_parameters():
        kept = ComputedBuffer()
    assert kept.head.weight.is_meta and not kept.scale.is_meta
    state = gathered(trainer(world, kept, "fsdp"))
    torch.manual_seed(SEED)
    assert differences(state, ComputedBuffer().state_dict()) == []


class ResetsItsBlocks(Net):
    """Initializes every block's weights from above once they are built, as torch's nn.Transformer does."""

    def __init__(self):
        super().__init__()
        self.reset_parameters()

    def reset_parameters(self):
        for block in self.blocks:
            nn.init.xavier_uniform_(block.linear.weight)


class NormalizesItsBlocks(Net):
    """Scales a weight by its own norm: under fsdp a rank holds its slice, not the whole weight."""

    def __init__(self):
        super().__init__()
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self):
        for block in self.blocks:
            block.linear.weight.div_(block.linear.weight.norm())


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_an_initialization_from_above_the_units_equals_the_model_built_whole(world, strategy):
    with torch.device("meta"):
        model = ResetsItsBlocks()
    built = trainer(world, model, strategy)
    state = gathered(built)
    torch.manual_seed(SEED)
    expected = ResetsItsBlocks()

    assert differences(state, expected.state_dict()) == []
    if strategy == "fsdp":  # the root and the one block each operation touched, never two blocks
        strategy_ = built.strategy
        assert built.parts.initialization.peak_bytes == strategy_.root.full_bytes + strategy_.largest_unit_bytes()


def test_fsdp_refuses_an_initialization_that_reads_across_a_sharded_weight_and_ddp_runs_it(world):
    if world.size == 1:
        pytest.skip("one rank holds every weight whole")
    with torch.device("meta"):
        model = NormalizesItsBlocks()
    with pytest.raises(ValueError, match=r"blocks\.0\.linear\.weight.*nothing initialized"):
        trainer(world, model, "fsdp")
    with torch.device("meta"):
        model = NormalizesItsBlocks()
    state = gathered(trainer(world, model, "ddp"))
    torch.manual_seed(SEED)
    assert differences(state, NormalizesItsBlocks().state_dict()) == []


def test_a_model_partly_on_meta_is_refused(world):
    with torch.device("meta"):
        model = Net()
    model.head = nn.Linear(24, CLASSES)
    with pytest.raises(ValueError, match=r"some of the model's parameters are on the meta device \(embed.weight\) "
                                         r"and some are not \(head.weight\)"):
        trainer(world, model, "ddp")


def textlm_case():
    from hvdtrain.examples.textlm import TinyTransformerLM, lm_loss
    from hvdtrain.examples.textlm_parallel import pipeline_layers, tensor_plan
    from hvdtrain.parallel.model_plan import ModelPlan

    build = lambda: TinyTransformerLM(11, seq_len=8, d_model=16, layers=2, heads=4)
    return build, {"loss_fn": lm_loss}, lambda model: ModelPlan(tensor_plan=tensor_plan(model),
                                                                 pipeline_layers=pipeline_layers)


def hf_case(family):
    transformers = pytest.importorskip("transformers")
    from tests.mpi.test_hf_equivalence import FAMILIES
    from tests.mpi.test_hf_equivalence import logits_loss

    return (lambda: transformers.AutoModelForCausalLM.from_config(FAMILIES[family]()), {"loss_fn": logits_loss},
            lambda model: None)


# (tensor, pipeline): each where it divides the world.
MODEL_PARALLEL_LAYOUTS = [(2, 1), (1, 2), (2, 2)]


@pytest.mark.process_sets
@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", ["textlm", "llama", "qwen3"])
@pytest.mark.parametrize("layout", MODEL_PARALLEL_LAYOUTS, ids=lambda layout: "T{}-P{}".format(*layout))
def test_model_parallelism_initializes_only_its_slices_of_a_model_built_on_meta(world, case, layout):
    """Split first, then each rank's slices and stage initialized (the same draws as the model built
    whole, in the same order); gathered back, the model built whole, bitwise. No rank held more
    than its part and one layer's whole tensors at a time: well under the model."""
    from tests.mpi.test_hf_equivalence import token_data as token_windows
    from tests.mpi.test_model_parallel import token_data

    tensor, pipeline = layout
    if world.size % (tensor * pipeline):
        pytest.skip(f"T={tensor} x P={pipeline} does not divide {world.size} ranks")
    build, loss, plan = textlm_case() if case == "textlm" else hf_case(case)
    torch.manual_seed(SEED)
    whole = build()
    expected = whole.state_dict()
    whole_bytes = sum(t.numel() * t.element_size() for t in {id(t): t for t in expected.values()}.values())
    with torch.device("meta"):
        model = build()
    data = token_data() if case == "textlm" else token_windows()
    config = TrainConfig(epochs=1, batch_size=4, warmup_epochs=0, max_steps=1, seed=SEED, log_every=1000,
                         tensor_parallel=tensor, pipeline_parallel=pipeline, micro_batches=2, tensorboard=False)
    built = Trainer(model, torch.optim.AdamW(model.parameters(), lr=0.01), data, None, config, world=world,
                    model_plan=plan(model), **loss)
    state = gathered(built)
    peaks = collectives.allgather_object(built.parts.initialization.peak_bytes, name=f"deferred.mp.{case}.{layout}")
    built.close_mesh()

    assert differences(state, expected) == []
    assert built.parts.initialization.granularity == "by tensor slice and pipeline stage"
    assert max(peaks) < 0.8 * whole_bytes, f"a rank held {max(peaks)} of the model's {whole_bytes} bytes at once"


def tiny_codegen(device=None):
    """CodeGen at toy size, float64, from_config's way: its sinusoidal position table is a
    non-persistent buffer computed in __init__ (and again by its _init_weights) under the default
    dtype the model is built in; from the same seed each time."""
    from tests.mpi.hf_models import SEQ, VOCAB, transformers

    config = transformers.CodeGenConfig(vocab_size=VOCAB, n_positions=SEQ, n_ctx=SEQ, n_embd=32, n_layer=2, n_head=4,
                                        rotary_dim=4, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(SEED)
    with torch.device(device) if device else contextlib.nullcontext():
        return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float64)


def test_a_buffer_computed_from_the_config_is_replayed_in_the_dtype_the_model_was_built_in(world):
    """The Trainer initializes under float32 by default while the model was built under float64: a
    table computed as ``arange(n) / d`` took float32 then, 3e-8 off the whole model's, and trained
    4e-7 away from one process. Built on meta, every parameter and buffer (non-persistent ones too)
    equals the model built whole bitwise, and fsdp trains to one process's steps."""
    from hvdtrain.verify import reference
    from hvdtrain.verify.exact import float64_throughout
    from tests.mpi.hf_models import SEQ, VOCAB

    whole, meta_model = tiny_codegen(), tiny_codegen("meta")
    data, steps = reference.token_data(VOCAB, SEQ), 3
    config = TrainConfig(epochs=1, batch_size=reference.BATCH, lr=reference.RATES["adamw"], scale_lr=False,
                         warmup_epochs=0, max_steps=steps, seed=SEED, strategy="fsdp", log_every=1000,
                         tensorboard=False)
    with float64_throughout():
        built = Trainer(meta_model, reference.make_optimizer("adamw", meta_model.parameters()), data, None, config,
                        world=world, loss_fn=reference.logits_loss)
        start = gathered(built)
        buffers = {name: value.clone() for name, value in meta_model.named_buffers()}
        built.fit()
        final = gathered(built)
        expected, _ = reference.one_process(whole, start, data, SEED, reference.BATCH * world.size, steps, "adamw")

    assert differences(start, tiny_codegen().state_dict()) == []
    assert buffers.keys() == dict(whole.named_buffers()).keys() and buffers  # the non-persistent table among them
    assert differences(buffers, dict(tiny_codegen().named_buffers())) == []
    worst = max((final[name] - expected[name]).abs().max().item() for name in expected)
    assert worst < 1e-10, f"fsdp from meta vs one process: {worst}"
