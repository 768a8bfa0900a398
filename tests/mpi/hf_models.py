"""Hugging Face models at toy size for the tests that train, export or load one (they skip where
transformers is not installed): Llama's layout, grouped-query attention (2 key/value heads for 4),
tied embeddings; Qwen3's (per-head q/k norms, its own head); and a Trainer over random token windows
for them."""
import pytest
import torch
from torch.utils.data import TensorDataset

from hvdtrain.config.train import TrainConfig
from hvdtrain.trainer import Trainer

transformers = pytest.importorskip("transformers")

VOCAB, SEQ = 64, 8


def tiny_config(family="llama", layers=2):
    sizes = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ)
    if family == "qwen3":
        return transformers.Qwen3Config(**sizes, head_dim=8, tie_word_embeddings=False)
    return transformers.LlamaConfig(**sizes, tie_word_embeddings=True)


def tiny_model(family="llama", seed=0, layers=2, dtype=torch.float32):
    """The toy model of ``family`` (llama or qwen3), from ``seed``."""
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(tiny_config(family, layers)).to(dtype)


def tiny_llama(seed=0, layers=2, dtype=torch.float32):
    return tiny_model("llama", seed, layers, dtype)


def causal_lm_step(model, batch):
    inputs, targets = batch
    logits = model(input_ids=inputs).logits
    return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1)), {}


def trainer_for(world, strategy, model, max_steps, run_dir=None):
    ids = torch.randint(0, VOCAB, (64, SEQ + 1), generator=torch.Generator().manual_seed(1))
    config = TrainConfig(epochs=1, batch_size=4, lr=0.01, warmup_epochs=0, max_steps=max_steps, seed=3,
                         strategy=strategy, log_every=1000, tensorboard=False, run_dir=run_dir,
                         run_name="run" if run_dir else None)
    return Trainer(model, torch.optim.AdamW(model.parameters(), lr=config.lr), TensorDataset(ids[:, :-1], ids[:, 1:]),
                   None, config, world=world, step_fn=causal_lm_step)
