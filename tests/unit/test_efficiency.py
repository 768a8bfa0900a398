"""Tokens/s, TFLOPs/s per rank and MFU: the model FLOPs against hand counts and PaLM's formula, the
peak from the table or a matmul, and the figures in the log line and the epoch line."""
import io
import logging

import pytest
import torch
import torch.nn.functional as F

from hvdtrain.components.steps import supervised_step
from hvdtrain.examples.textlm import TinyTransformerLM, lm_loss
from hvdtrain.observability.efficiency import Efficiency, describe
from hvdtrain.observability.flops import (ModelFlops, count_model_flops, matmul_parameters, meta_copy,
                                          tokens_per_sample)
from hvdtrain.observability.peak import Peak, device_peak, measure_matmul, table_peak, training_dtype
from hvdtrain.observability.progress import Progress
from hvdtrain.observability.reporting import epoch_line


def mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def test_an_mlps_step_is_counted_by_hand_and_the_model_is_left_alone():
    model = mlp()
    before = [p.detach().clone() for p in model.parameters()]
    batch = (torch.randn(5, 8), torch.randint(0, 4, (5,)))
    flops = count_model_flops(meta_copy(model), supervised_step(F.cross_entropy), batch, samples=5)
    first, second = 2 * 8 * 16, 2 * 16 * 4  # per sample, forward
    # Backward: both weight gradients, and the input gradient of the second layer only (the
    # first layer's input is data).
    assert flops.per_sample == (first + second) + (first + second) + second
    assert flops.tokens_per_sample is None and flops.per_token is None
    assert all(p.grad is None for p in model.parameters()), "the count ran on the meta copy"
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_frozen_layers_take_no_weight_gradient():
    model = mlp()
    model[0].requires_grad_(False)
    batch = (torch.randn(5, 8), torch.randint(0, 4, (5,)))
    flops = count_model_flops(meta_copy(model), supervised_step(F.cross_entropy), batch, samples=5)
    # The second layer's weight gradient only: nothing before it needs an input gradient.
    assert flops.per_sample == (2 * 8 * 16 + 2 * 16 * 4) + 2 * 16 * 4


def test_the_example_transformer_is_palms_6n_plus_attention_per_token():
    layers, width, seq = 2, 64, 32
    model = TinyTransformerLM(50, seq_len=seq, d_model=width, layers=layers, heads=4)
    batch = (torch.randint(0, 50, (3, seq)), torch.randint(0, 50, (3, seq)))
    flops = count_model_flops(meta_copy(model), supervised_step(lm_loss), batch, samples=3)
    assert flops.tokens_per_sample == seq and "FlopCounterMode" in flops.method
    attention = 12 * layers * width * seq
    # The position table is a lookup, not a product; the tied output layer is one: N counts it once.
    assert matmul_parameters(model) == sum(p.numel() for p in model.parameters()) - seq * width
    # Exactly PaLM's 6N + 12LHS, N the weight matrices (biases and LayerNorms take no matrix product).
    matrices = sum(p.numel() for p in model.parameters() if p.dim() == 2) - seq * width
    assert flops.per_token == 6 * matrices + attention
    assert flops.per_token == pytest.approx(6 * matmul_parameters(model) + attention, rel=0.02)


def test_a_step_the_meta_device_cannot_run_falls_back_to_6n_for_tokens_and_is_refused_otherwise():
    def reads_a_value(model, batch):
        loss = lm_loss(model(batch[0]), batch[1])
        loss.item()
        return loss, {}

    model = TinyTransformerLM(50, seq_len=16, d_model=32, layers=1, heads=4)
    batch = (torch.randint(0, 50, (2, 16)), torch.randint(0, 50, (2, 16)))
    flops = count_model_flops(meta_copy(model), reads_a_value, batch, samples=2)
    assert flops.per_token == 6 * matmul_parameters(model) and flops.method.startswith("6N per token")
    with pytest.raises(ValueError, match="could not run on the meta device"):
        count_model_flops(meta_copy(mlp()), lambda m, b: (m(b[0]).sum().item(), {}),
                          (torch.randn(2, 8), torch.zeros(2)), samples=2)


def test_a_mixture_of_experts_counts_the_top_k_experts_a_token_visits():
    """A mixture of experts routes by the data, which the meta device cannot run: the fallback's N is
    what one token multiplies by, top-k of the routed experts and all the rest (MFU of the whole
    experts would be n/k times too high), and the start line's reason is one short sentence."""
    transformers = pytest.importorskip("transformers")
    from hvdtrain.parallel.experts import fused_experts

    def causal_lm_step(model, batch):  # the model's own loss, as a Hugging Face port's step
        out = model(input_ids=batch[0], labels=batch[1])
        return out.loss, {}

    config = transformers.Qwen3MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                         num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
                                         tie_word_embeddings=False)
    model = transformers.AutoModelForCausalLM.from_config(config)
    ids = torch.randint(0, 64, (2, 12))
    flops = count_model_flops(meta_copy(model), causal_lm_step, (ids, ids), samples=2)
    experts = sum(p.numel() for m in fused_experts(model).values() for p in m.parameters(recurse=False))
    assert experts == 2 * 8 * 3 * 32 * 16
    lookup = model.model.embed_tokens.weight.numel()  # untied: a lookup, no product
    active = sum(p.numel() for p in model.parameters()) - lookup - experts + experts * 2 // 8
    assert flops.method.startswith("6N per token") and flops.per_token == 6 * active
    assert "routes by the data" in flops.method
    assert len(flops.method) < 200, flops.method


def test_a_mixture_of_experts_takes_the_formula_even_where_the_meta_device_runs_it(monkeypatch):
    """Under torch 2.7 transformers' Qwen3-MoE ran on the meta device, and FlopCounterMode counted what its
    experts' implementation did without values: 0.68 of the top-k formula, with no error (the torch matrix
    found it). A meta run that succeeds must not decide an MoE's model FLOPs."""
    from hvdtrain.examples.moe import TinyMoELM, moe_lm_step
    from hvdtrain.observability import flops as flops_module

    monkeypatch.setattr(flops_module, "count_step", lambda *args: 1234.0)  # a meta run that "worked"
    model = TinyMoELM(40, seq_len=8, d_model=16, layers=2, heads=2, num_experts=4, top_k=2)
    ids = torch.randint(0, 40, (2, 8))
    counted = count_model_flops(meta_copy(model), moe_lm_step, (ids, ids), samples=2)
    assert counted.per_token == 6 * matmul_parameters(model)
    assert counted.method.startswith("6N per token over the experts a token visits")
    dense = TinyTransformerLM(40, seq_len=8, d_model=16, layers=2, heads=2)  # no experts: the meta count stands
    assert count_model_flops(meta_copy(dense), supervised_step(lm_loss), (ids, ids), samples=2).per_sample == 1234.0 / 2


def test_a_mixture_of_experts_of_your_own_counts_the_top_k_its_layers_name():
    """hvdtrain's own MoE has no config: the top-k comes from the layer holding the experts (it used to
    count every expert: 4 experts of top-2 made MFU up to twice too high)."""
    from hvdtrain.examples.moe import MoEFeedForward, TinyMoELM, moe_lm_step
    from hvdtrain.parallel.experts import fused_experts

    model = TinyMoELM(40, seq_len=8, d_model=16, layers=2, heads=2, num_experts=4, top_k=2)
    ids = torch.randint(0, 40, (2, 8))
    routed = count_model_flops(meta_copy(model), moe_lm_step, (ids, ids), samples=2)
    assert routed.method.startswith("6N per token")  # the meta device cannot route by the data
    for layer in model.modules():
        if isinstance(layer, MoEFeedForward):
            layer.top_k = None  # named nowhere: every expert counts
    whole = count_model_flops(meta_copy(model), moe_lm_step, (ids, ids), samples=2)
    experts = sum(p.numel() for m in fused_experts(model).values() for p in m.parameters(recurse=False))
    assert experts == 2 * 4 * 3 * 16 * 32
    assert whole.per_token - routed.per_token == 6 * (experts - experts * 2 // 4)


def test_token_models_are_told_by_integer_ids_into_an_embedding():
    lm = TinyTransformerLM(50, seq_len=16, d_model=32, layers=1, heads=4)
    ids = torch.randint(0, 50, (2, 16))
    assert tokens_per_sample(lm, (ids, ids)) == 16
    assert tokens_per_sample(lm, {"input_ids": ids, "labels": ids}) == 16
    assert tokens_per_sample(lm, (ids.float(), ids)) is None
    assert tokens_per_sample(mlp(), (ids, ids)) is None, "integer features without an embedding"


def test_the_peak_table_names_dense_figures_by_device_and_dtype():
    assert table_peak("NVIDIA A100-SXM4-80GB", "bfloat16") == 312.0
    assert table_peak("NVIDIA H100 80GB HBM3", "bfloat16") == 989.0
    assert table_peak("NVIDIA H100 PCIe", "bfloat16") == 756.0
    assert table_peak("NVIDIA A100-PCIE-40GB", "float32") == 19.5
    assert table_peak("Tesla V100-SXM2-32GB", "bfloat16") is None  # no bf16 tensor cores: measured
    assert table_peak("Some Future GPU", "bfloat16") is None
    assert training_dtype("bf16", torch.device("cpu")) == (torch.bfloat16, "bfloat16")
    assert training_dtype("fp32", torch.device("cpu")) == (torch.float32, "float32")


def test_the_measured_matmul_is_its_flops_over_the_fastest_repeat():
    ticks = iter([0.0, 0.5, 0.5, 0.75, 0.75, 1.5])  # repeats of 0.5 s, 0.25 s, 0.75 s
    rate = measure_matmul(torch.device("cpu"), torch.float32, repeats=3, size=8, clock=lambda: next(ticks))
    assert rate == 2 * 8 ** 3 / 0.25
    peak = device_peak(torch.device("cpu"), "fp32")
    assert peak.flops_per_sec > 0 and peak.source == "measured float32 matmul"
    assert device_peak(torch.device("cpu"), "fp32") == peak, "measured once per process"
    assert device_peak(torch.device("cpu"), "bf16").source == "measured bfloat16 matmul"
    assert peak.describe().endswith("TFLOPs/s per rank, measured float32 matmul")


def test_the_figures_of_a_rate_share_the_models_flops_over_every_rank():
    efficiency = Efficiency(mlp(), supervised_step(F.cross_entropy), Peak(2e12, "test"))
    assert efficiency.figures(100.0, 4) == {}, "nothing before the count"
    efficiency.flops = ModelFlops(per_sample=8e9, tokens_per_sample=64, method="test")
    figures = efficiency.figures(100.0, world_size=4)
    assert figures["tokens_per_sec"] == 6400.0
    assert figures["tflops_per_rank"] == pytest.approx(100 * 8e9 / 4 / 1e12)
    assert figures["mfu"] == pytest.approx(0.1)
    assert describe(figures) == "6400 tokens/s, 0.2 TFLOPs/s per rank, MFU 10.0%"


def test_the_first_batch_counts_once_and_says_so():
    efficiency = Efficiency(mlp(), supervised_step(F.cross_entropy), Peak(1e12, "measured float32 matmul"))
    line = efficiency.count((torch.randn(4, 8), torch.randint(0, 4, (4,))), samples=4)
    assert line.startswith("model FLOPs of a training step: 8.96e-07 GFLOPs per sample (FlopCounterMode")
    assert efficiency.counted and efficiency.shadow is None
    assert "tokens_per_sec" not in efficiency.figures(10.0, 1)


def test_the_log_line_and_the_epoch_line_carry_the_figures():
    stream = io.StringIO()
    logger = logging.getLogger("test.efficiency.log")
    logger.handlers[:] = [logging.StreamHandler(stream)]
    logger.setLevel(logging.INFO)
    logger.propagate = False
    progress = Progress("log", total=10, initial=0, logger=logger)
    figures = {"tokens_per_sec": 4096.0, "tflops_per_rank": 0.0123, "mfu": 0.153}
    progress.report(epoch=1, step=5, loss=1.0, lr=0.1, samples_per_sec=64.0, comm_fraction=0.1, efficiency=figures)
    progress.close()
    assert stream.getvalue().startswith("epoch 1 step 5/10 loss 1.0000 lr 0.1 64 samples/s, 4096 tokens/s, "
                                        "0.0123 TFLOPs/s per rank, MFU 15.3%, 10% waiting for gradients")
    record = {"epoch": 1, "epochs_done": 1.5, "step": 5, "train_loss": 1.0, "samples_per_sec": 64.0, **figures}
    assert epoch_line(record, 2) == ("epoch 1 stopped (1.5/2 epochs) step 5 train_loss 1.0000 64 samples/s, 4096 tokens/s, "
                                     "0.0123 TFLOPs/s per rank, MFU 15.3%")


def test_measuring_the_peak_leaves_the_training_random_streams_alone():
    # The first Trainer of a process measures, the next reuse it: had the measurement drawn from
    # torch's global generator, a run's dropout, data order and checkpointed RNG state would depend
    # on whether another Trainer ran before it (tests/mpi/test_async_checkpoint.py caught it).
    import torch

    from hvdtrain.observability.peak import measure_matmul

    torch.manual_seed(1)
    before = torch.get_rng_state()
    measure_matmul(torch.device("cpu"), torch.float32, repeats=1, size=8)
    assert torch.equal(torch.get_rng_state(), before)
