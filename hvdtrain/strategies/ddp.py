"""Replicated data parallelism: every rank holds the whole model, its gradients and the optimizer
state; Horovod's ring all-reduce averages the gradients during backward (tensor fusion, overlap).
With train.reduction=adasum, Horovod's Adasum optimizer instead: each rank steps with its own
gradient during backward and the ranks' updates are combined by Adasum."""
from __future__ import annotations

from typing import Any, Dict, List

import torch

from hvdtrain.distributed import startup as dist
from hvdtrain.training.lr import combines_updates, distributed_optimizer
from hvdtrain.strategies.base import Strategy, optimizer_state_tensors, storage_bytes
from hvdtrain.fault_tolerance.watchdog import pending_allreduces


class DDPStrategy(Strategy):
    """Horovod's DistributedOptimizer: hooks on every gradient start its all-reduce as soon as
    backward produces it; ``synchronize`` waits; the step runs under ``skip_synchronize``.

    Under Adasum (more than one rank), the hooks first step the parameter with this rank's own
    gradient, then start the Adasum all-reduce of its update; ``synchronize`` waits for those, and
    the step applies the combined updates (Horovod's Adasum optimizer has no skip_synchronize)."""

    name = "ddp"

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, world: dist.World,
                 accumulation: int, fp16_allreduce: bool, reduction: str = "average") -> None:
        super().__init__(model, optimizer, world, accumulation, fp16_allreduce)
        self.reduction = reduction
        self.combines_updates = combines_updates(reduction, world.size)
        self.optimizer = distributed_optimizer(optimizer, model.named_parameters(), accumulation, fp16_allreduce,
                                               reduction)

    def broadcast_from_root(self) -> None:
        dist.broadcast_model_and_optimizer(self.model, self.optimizer, root_rank=0)

    def synchronize(self) -> None:
        if self.combines_updates:
            # Horovod's Adasum synchronize() does nothing: wait here, so the wait is timed as communication.
            dist.wait([handle for handle, _ in list(self.optimizer._handles.values())])
        else:
            self.optimizer.synchronize()

    def step(self) -> None:
        if self.combines_updates:
            self.optimizer.step()  # collects the Adasum-combined updates and applies them
            return
        with self.optimizer.skip_synchronize():
            self.optimizer.step()

    def zero_grad(self) -> None:
        self.optimizer.zero_grad()

    def state_dict(self) -> Dict[str, Any]:
        # The plain module and the plain optimizer's format: Horovod wraps only the optimizer.
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])

    def memory_bytes(self) -> Dict[str, int]:
        parameters = list(self.model.parameters())
        return {
            "parameters": storage_bytes(parameters),
            "gradients": storage_bytes(p.grad for p in parameters),
            "optimizer_state": storage_bytes(optimizer_state_tensors(self.optimizer)),
        }

    def pending_communication(self) -> List[str]:
        return pending_allreduces(self.optimizer)
