"""Models and data shared by the MPI tests: small, deterministic, float64."""
import torch
from torch import nn
from torch.utils.data import TensorDataset


def synthetic_classification(samples: int = 192, features: int = 12, classes: int = 4,
                             dtype: torch.dtype = torch.float64) -> TensorDataset:
    """A fixed, learnable data set: the same on every rank and every run."""
    generator = torch.Generator().manual_seed(2024)
    inputs = torch.randn(samples, features, generator=generator, dtype=dtype)
    weights = torch.randn(features, classes, generator=generator, dtype=dtype)
    labels = (inputs @ weights).argmax(dim=1)
    return TensorDataset(inputs, labels)


def small_mlp(seed: int, features: int = 12, classes: int = 4,
              dtype: torch.dtype = torch.float64) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(features, 16), nn.Tanh(), nn.Linear(16, classes)).to(dtype)


def flat_parameters(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def record_step_losses(trainer, metrics_seen=None) -> list:
    """The list each optimizer step's loss (this rank's, float64) is appended to while the trainer runs;
    each step's metrics dict to ``metrics_seen`` too, when given."""
    losses = []
    train_batch = trainer.strategy.forward_backward

    def recording(*args, **kwargs):
        loss, metrics = train_batch(*args, **kwargs)
        losses.append(loss.detach().double().reshape(()))
        if metrics_seen is not None:
            metrics_seen.append(dict(metrics))
        return loss, metrics

    trainer.strategy.forward_backward = recording
    return losses


def agreed(values, name: str) -> torch.Tensor:
    """Every rank's row of values (a collective: call it before asserting)."""
    from hvdtrain.distributed import collectives

    return collectives.allgather_rows(torch.as_tensor(values, dtype=torch.float64).reshape(1, -1), name=name)


def token_data(vocab: int, seq: int, samples: int = 64, seed: int = 3) -> TensorDataset:
    """Random token sequences as (inputs, next-token targets), the same on every rank."""
    ids = torch.randint(0, vocab, (samples, seq + 1), generator=torch.Generator().manual_seed(seed))
    return TensorDataset(ids[:, :-1], ids[:, 1:])


def causal_lm_step(model, batch):
    """A Hugging Face causal LM's next-token loss on (inputs, targets) token batches."""
    inputs, targets = batch
    logits = model(input_ids=inputs, use_cache=False).logits
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)), {}


def one_process_adamw(model: nn.Module, data: TensorDataset, global_batch: int, steps: int, lr: float,
                      seed: int, step_fn=causal_lm_step):
    """The steps one process takes, without Horovod, on the global batches in the sampler's order
    (seed ``seed``), with AdamW: (final state, each step's loss)."""
    from hvdtrain.data.sharding import ShardedSampler

    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    sampler = ShardedSampler(len(data), rank=0, world_size=1, seed=seed)
    sampler.set_epoch(0)
    order = list(sampler)
    losses = []
    for step in range(steps):
        batch = order[step * global_batch:(step + 1) * global_batch]
        optimizer.zero_grad()
        loss, _ = step_fn(model, (data.tensors[0][batch], data.tensors[1][batch]))
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return model.state_dict(), losses


def outcome(action, name: str) -> list:
    """Every rank's CheckpointError message (or None) from ``action()``, gathered: the assertions come
    after the collective."""
    from hvdtrain.checkpoint import CheckpointError
    from hvdtrain.distributed import collectives
    try:
        action()
        message = None
    except CheckpointError as error:
        message = str(error)
    return collectives.allgather_object(message, name=name)


def checkpoint_names(directory) -> list:
    """The checkpoints in ``directory`` (and those set aside), without the full ones' checksum files."""
    from pathlib import Path
    return sorted(path.name for path in Path(directory).iterdir()
                  if path.name.startswith("ckpt-") and not path.name.endswith(".checksum"))
