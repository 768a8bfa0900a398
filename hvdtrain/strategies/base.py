"""The strategy seam: how parameters, gradients and optimizer state are held across ranks.

The loop is the same for every strategy; a strategy owns what differs: how the optimizer is
wrapped, how gradients are synchronized, how a step is applied, how the full state is gathered for
a checkpoint and spread again on resume, and what each rank holds. Every method that communicates
is a collective: every rank calls it, in the same order.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar, Dict, Iterator, List, Tuple

import torch

from hvdtrain.common.capabilities import DECLARED, Capabilities
from hvdtrain.strategies import clipping
from hvdtrain.distributed.world import World


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors``: views of one buffer count once."""
    seen: Dict[int, int] = {}
    for tensor in tensors:
        if tensor is None:
            continue
        storage = tensor.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def tensor_names(model: torch.nn.Module) -> List[Tuple[List[str], torch.Tensor]]:
    """Every distinct parameter and buffer of ``model`` (the object itself) with all its state_dict
    names, in state_dict order: a tied weight has several."""
    found: Dict[int, Tuple[List[str], torch.Tensor]] = {}
    for name, value in model.state_dict(keep_vars=True).items():
        found.setdefault(id(value), ([], value))[0].append(name)
    return list(found.values())


def distinct_state(model: torch.nn.Module) -> Iterator[Tuple[str, torch.Tensor]]:
    """(first state_dict name, the parameter or buffer itself) of every distinct one in ``model``."""
    return ((names[0], value) for names, value in tensor_names(model))


def optimizer_state_tensors(optimizer: torch.optim.Optimizer) -> List[torch.Tensor]:
    return [value for state in optimizer.state.values() for value in state.values()
            if isinstance(value, torch.Tensor)]


class Strategy(ABC):
    """One way of spreading a model's training over the ranks. ``optimizer`` is then the torch
    optimizer whose ``param_groups`` carry the live learning rate: the Trainer's scheduler drives it.

    Args:
        model: the user's model, already on the device.
        optimizer: the user's optimizer over that model's parameters, at one worker's learning rate.
        world: this rank's World (its data-parallel group).
        accumulation: micro-batches per optimizer step.
        fp16_allreduce: compress gradients to fp16 for their exchange.
    """

    name: ClassVar[str]
    # What this strategy can do (hvdtrain.common.capabilities, the one table of them): a registered
    # strategy gets its record from there; a strategy of one's own may declare its own record.
    capabilities: ClassVar[Capabilities] = Capabilities()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "name" in cls.__dict__ and "capabilities" not in cls.__dict__ and cls.name in DECLARED:
            cls.capabilities = DECLARED[cls.name]

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, world: World,
                 accumulation: int, fp16_allreduce: bool) -> None:
        self.model = model
        self.world = world
        self.accumulation = accumulation
        self.fp16_allreduce = fp16_allreduce
        self.optimizer: torch.optim.Optimizer = optimizer

    @property
    def label(self) -> str:
        """How logs name this strategy (the model-parallel layout adds its mesh)."""
        return self.name

    @classmethod
    def from_config(cls, config: Any, model: torch.nn.Module, optimizer: torch.optim.Optimizer, world: World,
                    **context: Any) -> "Strategy":
        """Built from the settings: each strategy reads its own.

        Args:
            config: the run's settings (TrainConfig).
            model: the model.
            optimizer: its optimizer.
            world: this rank's World.
            context: what set-up knows besides: mesh, plan, loss_fn, deferred.
        """
        return cls(model, optimizer, world, config.accumulation, config.fp16_allreduce)

    def follow_world(self, world: World) -> None:
        """Horovod elastic re-formed the world (only strategies that support elastic see this)."""
        self.world = world

    @abstractmethod
    def broadcast_from_root(self) -> None:
        """Every rank starts from rank 0's parameters, buffers and optimizer state."""

    def forward_backward(self, step_fn, batch: Any, autocast, scale_loss, weight: Any) -> Tuple[torch.Tensor, Dict]:
        """One micro-batch: its forward, then backward of the scaled loss times its weight; returns
        (loss, metrics), the loss unweighted. A pipeline runs its schedule over the batch's
        micro-batches here instead.

        Args:
            step_fn: ``step_fn(model, batch) -> (loss, metrics)``, the forward.
            batch: this rank's micro-batch.
            autocast: ``autocast()``: the forward's precision context.
            scale_loss: ``scale_loss(loss)``: the loss times fp16's loss scale (unchanged otherwise).
            weight: the micro-batch's share of the step (hvdtrain.components.token_mean): 1 / accumulation,
                or its scored items x the replicas / the global batch's items, read (``float``) after the
                forward, which the global count's all-reduce runs behind.
        """
        with autocast():
            loss, metrics = step_fn(self.model, batch)
        weight = float(weight)
        scaled = scale_loss(loss)
        self.backward(scaled * weight if weight != 1 else scaled)
        return loss, metrics

    def forward_only(self, step_fn, batch: Any) -> Tuple[torch.Tensor, Dict]:
        """Evaluation of one batch (no gradient): (loss, metrics)."""
        return step_fn(self.model, batch)

    # Whether this rank's losses and samples count in the reported means: a model replica spread
    # over several ranks reports through one of them (they all hold the same loss).
    counts_samples: bool = True

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of one micro-batch's loss (already divided by the accumulation count);
        the strategy's hooks start the gradients' communication as they become ready."""
        loss.backward()

    @abstractmethod
    def synchronize(self) -> None:
        """Wait until this step's gradients are reduced (the step's exposed communication)."""

    @abstractmethod
    def step(self) -> None:
        """Apply the update with the synchronized gradients; every rank's model ends equal."""

    @abstractmethod
    def zero_grad(self) -> None:
        """Clear the gradients for the next step."""

    # Between synchronize and step, the loop may unscale (fp16) and clip the averaged gradients.

    def owned_gradients(self) -> List[torch.Tensor]:
        """This rank's averaged gradients after synchronize(): every parameter's whole gradient,
        or, when its capabilities' ``shards_gradients``, this rank's slices of them."""
        return [p.grad for p in self.model.parameters() if p.grad is not None]

    def clip_grad_norm_(self, max_norm: float) -> float:
        """Scale the averaged gradients so that the whole model's gradient norm is at most
        ``max_norm``; returns the norm before clipping, the same on every rank (a collective
        when the gradients are sharded)."""
        if self.capabilities.shards_gradients:
            return clipping.clip_sharded(self.owned_gradients(), max_norm, name=f"{self.name}.grad_norm")
        return clipping.clip_replicated(self.owned_gradients(), max_norm)

    def owned_parameters(self) -> List[torch.Tensor]:
        """The parameters this rank holds and the optimizer steps, current after step(): the whole
        model's here (ddp, ps: the same on every rank; tensor and pipeline parallel: this rank's slices
        and stage). Sharded strategies: this rank's slices of the flat buckets. For what keeps a copy
        of the weights per rank (the EMA callback); local, no collective."""
        return list(self.model.parameters())

    def owned_parameters_changed(self) -> None:
        """After owned_parameters() were written in place (every rank its own): make the model the
        forward uses agree with them (zero1/zero2 gather the slices: a collective; every rank calls it)."""

    @abstractmethod
    def state_dict(self) -> Dict[str, Any]:
        """{"model": the full model state_dict, "optimizer": the full optimizer state_dict in
        the plain torch optimizer's format}: what one process training alone would hold, so
        a checkpoint written under any strategy loads under any other. Every rank calls it."""

    @abstractmethod
    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Load a full {"model", "optimizer"} state (every rank holds all of it)."""

    # Loading from a source of tensors (hvdtrain.checkpoint.sources.contract: a full checkpoint, a
    # sharded or mesh checkpoint of any layout, a Hugging Face weights directory), which every
    # strategy reads through the same questions. Reading is local and may fail on one rank alone;
    # putting in place may be a collective. So the checkpoint layer has every rank read
    # (read_part), agrees on every rank's outcome, and only then has every rank load_part.

    def load_from(self, source: Any) -> None:
        """Take this strategy's state from ``source``: what this rank keeps of it, read, then put in
        place (every rank calls it: the loading may be a collective)."""
        self.load_part(self.read_part(source))

    def read_part(self, source: Any) -> Any:
        """What this rank keeps of ``source``, read but not yet in place (local, no collective). Here
        the whole state, which every rank holds; from a source without optimizer state (weights only)
        every tensor of the model under each of its names, the optimizer's own state kept. Every
        tensor's shape and dtype is checked first (weights only: another floating-point dtype is
        converted), so a checkpoint of another model is refused before anything is read."""
        weights_only = source.param_groups() is None
        for names, value in tensor_names(self.model):
            source.check_tensor(source.first_held(names), value.shape, value.dtype, cast=weights_only)
        if weights_only:
            model: Dict[str, torch.Tensor] = {}
            for names, value in tensor_names(self.model):
                name = source.first_held(names)
                tensor = source.full_tensor(name).reshape(value.shape).to(value.dtype)
                model.update((alias, tensor) for alias in names)
            return {"model": model, "optimizer": None}
        return source.full_state()

    def load_part(self, part: Any) -> None:
        """Put what read_part read in place (every rank calls it, once every rank's read succeeded:
        a strategy's load may be a collective)."""
        if part["optimizer"] is None:
            part = {"model": part["model"], "optimizer": self.state_dict()["optimizer"]}
        self.load_state_dict(part)

    # Sharded checkpoints (train.checkpoint_format=sharded): each rank's own part, no collective.
    # Only strategies that shard the state have them (hvdtrain.strategies.sharding.shard_state);
    # a sharded checkpoint of another layout, or a mesh's, is read through load_from.

    def shard_state_dict(self) -> Dict[str, Any]:
        """This rank's own slices of the parameters and optimizer state, its buffers, and the layout
        that hvdtrain.strategies.sharding.shard_state.consolidate needs to rebuild the full state without
        the model's class. Local: no collective, nothing gathered."""
        raise NotImplementedError(self._no_shards())

    def check_shard_state_dict(self, state: Dict[str, Any]) -> None:
        """ValueError unless ``state`` is this rank's part for this model, optimizer and world (local)."""
        raise NotImplementedError(self._no_shards())

    def load_shard_state_dict(self, state: Dict[str, Any]) -> None:
        """Load this rank's part; every rank calls it, once every rank's part passed the check
        (a strategy whose ranks hold the full parameters all-gathers them: a collective)."""
        raise NotImplementedError(self._no_shards())

    def _no_shards(self) -> str:
        return (f"strategy {self.name} keeps the whole state on every rank: it has no sharded checkpoint "
                "(use checkpoint_format=full, or a strategy that shards: zero1, zero2, fsdp)")

    @abstractmethod
    def memory_bytes(self) -> Dict[str, int]:
        """Bytes this rank holds in parameters, gradients and optimizer state, counted from
        the tensors' storages: {"parameters": ..., "gradients": ..., "optimizer_state": ...}."""

    def whole_model(self) -> None:
        """After training: make ``model`` a plain, whole module on every rank (a collective), so
        that one rank alone can use it (sample from it, export it). Nothing to do unless the
        strategy shards the parameters."""

    def exported_model_state(self) -> Dict[str, torch.Tensor]:
        """The whole model's state_dict for export, on every rank (a collective): ``whole_model()``,
        then the model's own state_dict."""
        self.whole_model()
        return self.model.state_dict()

    def full_tensors(self) -> Iterator[Tuple[str, torch.Tensor]]:
        """The model's state, whole, one tensor at a time: every distinct tensor once, under its first
        state_dict name (a tied weight once). A collective: every rank iterates to the end, and a
        tensor is valid only until the next one is asked for (copy what you keep). Here the model is
        whole on every rank (ddp, zero1, zero2, ps): its own tensors, nothing gathered."""
        return ((name, value.detach()) for name, value in distinct_state(self.model))

    def pending_communication(self) -> List[str]:
        """Names of the collectives this rank started and that have not completed (for the
        stall watchdog, read from another thread)."""
        return []
