"""Activation checkpointing: the chosen blocks keep only their inputs for backward (counted), and
the gradients are those of the plain model, bit for bit, dropout included."""
import copy

import pytest
import torch
from torch import nn

from hvdtrain.config.train import TrainConfig
from hvdtrain.examples.textlm import TinyTransformerLM, lm_loss
from hvdtrain.components.activation_checkpointing import checkpoint_activations, saved_activation_bytes

BATCH, SEQ, WIDTH, BLOCKS = 8, 16, 32, 4


def model(mode, dropout=0.0):
    torch.manual_seed(0)
    net = TinyTransformerLM(37, seq_len=SEQ, d_model=WIDTH, layers=BLOCKS, heads=4, dropout=dropout).double()
    return net, checkpoint_activations(net, mode, every=2)


def batch():
    ids = torch.randint(0, 37, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(1))
    return ids[:, :-1], ids[:, 1:]


def loss_and_saved_bytes(net):
    inputs, targets = batch()
    torch.manual_seed(2)  # the dropout masks
    return saved_activation_bytes(net, lambda: lm_loss(net(inputs), targets))


def test_the_chosen_blocks_keep_only_their_inputs():
    """Byte counts, exact on any CPU: checkpointing 2 of 4 identical blocks saves half of what
    checkpointing all 4 saves; all 4 keep less than a fifth of the plain model's activations."""
    saved, chosen = {}, {}
    for mode in ("none", "every_k", "full", "selective"):
        net, chosen[mode] = model(mode)
        _, saved[mode] = loss_and_saved_bytes(net)
    every_block = [f"blocks.{i}" for i in range(4)]
    assert chosen == {"none": [], "every_k": ["blocks.1", "blocks.3"], "full": every_block, "selective": every_block}
    assert saved["none"] - saved["every_k"] == saved["every_k"] - saved["full"] > 0
    assert saved["full"] < saved["none"] / 5, saved
    # selective keeps each block's matrix products and attention outputs: more than full, less than none.
    assert saved["full"] < saved["selective"] < saved["none"], saved


def test_selective_keeps_the_matrix_products_and_recomputes_the_rest():
    """Counted against the block's own ops: what selective keeps of a block (beyond its input) is
    exactly the outputs of its mm/addmm/bmm and attention, nothing else."""
    from hvdtrain.components.activation_checkpointing import KEPT_OPERATIONS

    net, _ = model("selective")
    outputs = []

    class Record(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func in KEPT_OPERATIONS:  # every tensor of the output (attention's logsumexp too)
                outputs.extend(t for t in (out if isinstance(out, tuple) else (out,)) if isinstance(t, torch.Tensor))
            return out

    inputs, targets = batch()
    x = torch.randn(BATCH, SEQ, WIDTH, dtype=torch.float64)
    plain, _ = model("none")
    with Record():
        plain.blocks[0](x)
    kept = sum(t.untyped_storage().nbytes() for t in {t.untyped_storage().data_ptr(): t for t in outputs}.values())
    _, counted = saved_activation_bytes(net, lambda: net.blocks[0](x).sum())
    assert kept > 0 and counted == kept + x.untyped_storage().nbytes()


def test_the_gradients_are_the_plain_models_bit_for_bit_with_dropout():
    gradients = {}
    for mode in ("none", "full", "every_k", "selective"):
        net, _ = model(mode, dropout=0.2)
        loss, _ = loss_and_saved_bytes(net)
        loss.backward()
        gradients[mode] = torch.cat([p.grad.reshape(-1) for p in net.parameters()])
    assert gradients["none"].abs().max() > 0
    assert all(torch.equal(gradients[mode], gradients["none"]) for mode in ("full", "every_k", "selective"))


def test_evaluation_and_a_copy_of_the_model_compute_with_their_own_parameters():
    plain, _ = model("none")
    net, _ = model("full")
    inputs, _ = batch()
    with torch.no_grad():
        assert torch.equal(net(inputs), plain(inputs))
        twin = copy.deepcopy(net)
        for parameter in twin.blocks.parameters():
            parameter.mul_(0.5)
        assert not torch.equal(twin(inputs), net(inputs))  # the copy's blocks run the copy's weights
        assert torch.equal(net(inputs), plain(inputs))
    assert checkpoint_activations(net, "full") == [f"blocks.{i}" for i in range(4)]  # again: wrapped once
    assert net.blocks[0].forward.forward.__self__ is net.blocks[0]


def test_what_cannot_be_checkpointed_is_refused_with_the_way_out():
    with pytest.raises(ValueError, match=r"BatchNorm \(0.1\) would count the batch in its running statistics twice"):
        checkpoint_activations(nn.Sequential(nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3))), "full")
    with pytest.raises(ValueError, match="this model has none: keep the repeated layers in an nn.ModuleList"):
        checkpoint_activations(nn.Linear(3, 3), "full")
    with pytest.raises(ValueError, match="activation_checkpointing must be one of none, full, every_k, selective, got 'some'"):
        TrainConfig(activation_checkpointing="some")
    with pytest.raises(ValueError, match="activation_checkpointing_every=3 applies to activation_checkpointing=every_k"):
        TrainConfig(activation_checkpointing="full", activation_checkpointing_every=3)
    assert TrainConfig(activation_checkpointing="every_k", activation_checkpointing_every=3).activation_checkpointing_every == 3


def test_a_hugging_face_model_recomputes_without_its_key_value_cache():
    """transformers keeps a key/value cache in the forward while config.use_cache is on: recomputed,
    a layer would append to it twice (selective checkpointing then meets other operations than its
    forward's). Checkpointing turns the cache off; the gradients are the plain model's, bit for bit."""
    transformers = pytest.importorskip("transformers")
    gradients = {}
    for mode in ("none", "full", "selective"):
        torch.manual_seed(0)
        config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, use_cache=True)
        net = transformers.LlamaForCausalLM(config).double()
        checkpoint_activations(net, mode)
        ids = torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(1))
        net(input_ids=ids).logits.sum().backward()
        gradients[mode] = torch.cat([p.grad.reshape(-1) for p in net.parameters()])
        assert net.config.use_cache == (mode == "none")
    assert torch.equal(gradients["full"], gradients["none"]) and torch.equal(gradients["selective"], gradients["none"])
