"""Replicated data parallelism: every rank holds the whole model, its gradients and the optimizer
state; Horovod's ring all-reduce averages the gradients during backward (tensor fusion, overlap).
With train.reduction=adasum, Horovod's Adasum optimizer instead: each rank steps with its own
gradient during backward and the ranks' updates are combined by Adasum."""
from __future__ import annotations

import time
from typing import Any, Dict, Iterable, List, Tuple

import torch

import horovod.torch as hvd

from hvdtrain.distributed import collectives

from hvdtrain.distributed.world import World
from hvdtrain.strategies.reduction import combines_updates
from hvdtrain.strategies.base import Strategy, optimizer_state_tensors, storage_bytes
from hvdtrain.strategies.unused_parameters import GradientUse, start_agreement, unused_everywhere


def distributed_optimizer(
    optimizer: torch.optim.Optimizer,
    named_parameters: Iterable[Tuple[str, torch.nn.Parameter]],
    accumulation: int,
    fp16_allreduce: bool,
    reduction: str = "average",
) -> torch.optim.Optimizer:
    """Wrap ``optimizer`` so gradients are averaged across ranks as they become ready.

    Horovod hooks every gradient accumulator: each all-reduce starts while backward is still
    running (overlap) and small tensors are fused into one buffer (tensor fusion).
    The user's optimizer state is carried over: Horovod's wrapper starts with an empty one.

    Args:
        optimizer: the user's optimizer.
        named_parameters: the model's parameters by name, naming their all-reduces.
        accumulation: micro-batches per step (Horovod's backward_passes_per_step).
        fp16_allreduce: compress gradients to fp16 for the all-reduce.
        reduction: average; adasum: Horovod's Adasum optimizer instead (see combines_updates), whose all-reduces combine
            each parameter's update with Adasum, per tensor even when fused.
    """
    state = optimizer.state_dict()
    wrapped = hvd.DistributedOptimizer(
        optimizer,
        named_parameters=list(named_parameters),
        compression=hvd.Compression.fp16 if fp16_allreduce else hvd.Compression.none,
        backward_passes_per_step=accumulation,
        op=hvd.Adasum if reduction == "adasum" else hvd.Average,
    )
    if state["state"]:
        wrapped.load_state_dict(state)
    return wrapped


def pending_allreduces(optimizer) -> List[str]:
    """Names of the gradients whose all-reduce this rank started and that has not completed.

    Reads Horovod's DistributedOptimizer internals (``_handles``, ``_parameter_names``) from
    another thread: a racy read is retried, never trusted blindly.
    """
    names = getattr(optimizer, "_parameter_names", {})
    for _ in range(5):
        try:
            handles = list(getattr(optimizer, "_handles", {}).items())
            break
        except RuntimeError:  # the training thread changed the dict while we copied it
            time.sleep(0.01)
    else:
        return ["(unknown: the optimizer kept changing)"]
    pending = []
    for key, (handle, _) in handles:
        if handle is None or callable(handle) or hvd.poll(handle):
            continue
        params = key if isinstance(key, tuple) else (key,)
        pending.extend(names.get(p, "?") for p in params)
    return sorted(pending)


class DDPStrategy(Strategy):
    """Horovod's DistributedOptimizer: hooks on every gradient start its all-reduce as soon as
    backward produces it; ``synchronize`` waits; the step runs under ``skip_synchronize``.

    Under Adasum (more than one rank), the hooks first step the parameter with this rank's own
    gradient, then start the Adasum all-reduce of its update; ``synchronize`` waits for those, and
    the step applies the combined updates (Horovod's Adasum optimizer has no skip_synchronize).

    Horovod all-reduces zeros for a gradient this rank's backward did not produce; a parameter that
    no rank's backward reached gets its .grad back to None after the wait (unused_parameters), so
    the optimizer skips it as one process's does.

    Args:
        model: the model; its parameters are handled as the strategy says.
        optimizer: the user's optimizer over them.
        world: this rank's World (its data-parallel group).
        accumulation: micro-batches per optimizer step.
        fp16_allreduce: compress gradients to fp16 for their exchange.
        reduction: average or adasum (train.reduction).
    """

    name = "ddp"

    @classmethod
    def from_config(cls, config, model, optimizer, world, **context) -> "DDPStrategy":
        """Built from the settings: train.reduction besides the common ones.

        Args:
            config: the run's settings (TrainConfig).
            model: the model.
            optimizer: its optimizer.
            world: this rank's World.
            context: what set-up knows besides: mesh, plan, loss_fn, deferred.
        """
        return cls(model, optimizer, world, config.accumulation, config.fp16_allreduce, reduction=config.reduction)

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, world: World,
                 accumulation: int, fp16_allreduce: bool, reduction: str = "average") -> None:
        super().__init__(model, optimizer, world, accumulation, fp16_allreduce)
        self.reduction = reduction
        self.combines_updates = combines_updates(reduction, world.size)
        self.optimizer = distributed_optimizer(optimizer, model.named_parameters(), accumulation, fp16_allreduce,
                                               reduction)
        self._use = GradientUse([p for group in optimizer.param_groups for p in group["params"] if p.requires_grad])

    def broadcast_from_root(self) -> None:
        collectives.broadcast_model_and_optimizer(self.model, self.optimizer, root_rank=0)

    def synchronize(self) -> None:
        if self.combines_updates:
            # Horovod's Adasum synchronize() does nothing: wait here, so the wait is timed as communication.
            collectives.wait([handle for handle, _ in list(self.optimizer._handles.values())])
        else:
            # Started before the gradients' waits, so that Horovod can carry it alongside them.
            agreement = start_agreement(self._use.used_here(), name=f"ddp.used.{len(self._use.params)}",
                                        device=self.world.device)
            self.optimizer.synchronize()
            self._drop_unused_gradients(agreement)

    def _drop_unused_gradients(self, agreement) -> None:
        """The zeros Horovod reduced for a parameter no rank used become None again: not stepped."""
        for param, idle in zip(self._use.params, unused_everywhere(agreement)):
            if idle:
                param.grad = None

    def step(self) -> None:
        if self.combines_updates:
            self.optimizer.step()  # collects the Adasum-combined updates and applies them
            return
        with self.optimizer.skip_synchronize():
            self.optimizer.step()

    def zero_grad(self) -> None:
        self.optimizer.zero_grad()
        self._use.reset()  # after the step: synchronize() may run more than once before it

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
