"""Data parallelism over a mesh of model replicas that each span several ranks: tensor parallelism
(each layer split over the tensor group), pipeline parallelism (each stage a run of layers), or both.

Set-up, on every rank alike: rank 0's whole model and optimizer state are broadcast while every rank
still holds the whole model; the tensor plan splits the layers; the layers are cut into stages and
this rank frees what its stage does not hold; a new optimizer of the user's class steps this rank's
own parameters. A model built on the meta device is never whole: it is split and cut while it
holds no memory, then each rank gives only its slices and its stage their values, the same on every
rank from the seed (initialization.py), and nothing is broadcast. A step: forward and backward (the pipeline's schedule, or one pass), then one grouped
all-reduce of the gradients over the data-parallel group. Under zero1 a rank's parameters are dealt
out among the D ranks of its data group (whole tensors, largest first, as PyTorch's
ZeroRedundancyOptimizer does): each steps and keeps state for its share, then broadcasts it.
Checkpoints: gathered whole (the full format), or each rank's own part (the sharded format, read
back a tensor at a time at any layout: hvdtrain.checkpoint.sources.mesh); exports gather one tensor
at a time.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import nn

import horovod.torch as hvd

from hvdtrain.strategies import clipping
from hvdtrain.distributed import collectives
from hvdtrain.distributed.world import World
from hvdtrain.parallel import gathered_state as full_state
from hvdtrain.parallel.gathered_state import Placement
from hvdtrain.parallel.mesh import Mesh
from hvdtrain.parallel.model_plan import ModelPlan
from hvdtrain.strategies.base import Strategy, optimizer_state_tensors, storage_bytes, tensor_names
from hvdtrain.strategies.optimizers import check_elementwise, optimizer_like
from hvdtrain.strategies.sharding.shard_state import compact
from hvdtrain.strategies.unused_parameters import start_agreement, unused_everywhere

if TYPE_CHECKING:
    from hvdtrain.strategies.deferred_init import DeferredInit

# The data-parallel strategies a mesh's data groups can run: plain replicas, or ZeRO-1 over each group.
DATA_PARALLEL = ("ddp", "zero1")


def check_sliceable(optimizer: torch.optim.Optimizer) -> None:
    """A tensor-parallel rank steps slices of matrices: one process's result only for an optimizer
    whose update of an element depends on that element alone."""
    check_elementwise(optimizer, "tensor parallelism cannot step {name}", "it steps slices of each split matrix",
                      "Use one of them, or train.tensor_parallel=1 (pipeline stages hold whole parameters)")


def deal_out(sizes: Sequence[Tuple[str, int]], ranks: int) -> Dict[str, int]:
    """Each name to one of ``ranks`` owners: largest first (equal sizes by name), each to the least
    loaded so far (ties to the lower rank), so that every rank holds about 1 / ranks of the
    elements. The same on every rank of a data group, which holds the same names and shapes."""
    load = [0] * ranks
    owner: Dict[str, int] = {}
    for name, size in sorted(sizes, key=lambda item: (-item[1], item[0])):
        rank = min(range(ranks), key=lambda r: (load[r], r))
        owner[name] = rank
        load[rank] += size
    return owner


class ModelParallelStrategy(Strategy):
    """ddp, or zero1, over the data-parallel groups of a mesh whose model replicas span tensor x
    pipeline ranks.

    Args:
        model: the whole model (or built on the meta device: ``deferred``); split and cut here.
        optimizer: the user's optimizer over it; this rank steps a new one of its class over its own parameters.
        world: this rank's World (every rank of the mesh).
        accumulation: micro-batches per optimizer step.
        fp16_allreduce: compress gradients to fp16 for their exchange.
        mesh: this rank's place in the data x pipeline x tensor mesh, and its groups.
        plan: how to split the layers (its tensor_plan; None there: the model's own tp_plan) and cut the stages.
        loss_fn: ``loss_fn(outputs, targets)``: the pipeline's last stage's loss, without a step_fn.
        data_parallel: ddp or zero1 over each data-parallel group.
        micro_batches: micro-batches each batch is cut into for the pipeline.
        schedule: the pipeline's schedule: gpipe, 1f1b or zb-h1.
        deferred: the model was built on the meta device: each rank gives values only to its slices and
            stage (initialization.py), and nothing is broadcast.
        virtual_stages: model chunks per pipeline stage (v > 1: the interleaved 1f1b schedule).
    """

    name = "model_parallel"

    @property
    def label(self) -> str:
        return self._label

    @classmethod
    def from_config(cls, config, model, optimizer, world, **context) -> "ModelParallelStrategy":
        """Built from the settings: train.strategy over the data groups, micro_batches, pipeline_schedule.

        Args:
            config: the run's settings (TrainConfig).
            model: the model.
            optimizer: its optimizer.
            world: this rank's World.
            context: what set-up knows besides: mesh (required), plan, loss_fn, deferred.
        """
        return cls(model, optimizer, world, config.accumulation, config.fp16_allreduce, context["mesh"],
                   context.get("plan") or ModelPlan(), context.get("loss_fn"), data_parallel=config.strategy,
                   micro_batches=config.micro_batches, schedule=config.pipeline_schedule,
                   deferred=context.get("deferred"), virtual_stages=config.pipeline_virtual_stages)

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, world: World,
                 accumulation: int, fp16_allreduce: bool, mesh: Mesh, plan: ModelPlan,
                 loss_fn: Optional[Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = None,
                 data_parallel: str = "ddp", micro_batches: int = 1, schedule: str = "1f1b",
                 deferred: Optional["DeferredInit"] = None, virtual_stages: int = 1) -> None:
        super().__init__(model, optimizer, world, accumulation, fp16_allreduce)
        if data_parallel not in DATA_PARALLEL:
            raise ValueError(f"over a model-parallel mesh the data-parallel strategy is one of "
                             f"{', '.join(DATA_PARALLEL)}, got {data_parallel!r}")
        self.mesh, self.plan, self.loss_fn = mesh, plan, loss_fn
        shape = mesh.shape
        # What the memory report and its record say.
        self._label = f"{data_parallel} x tensor {shape.tensor} x pipeline {shape.pipeline}"
        if data_parallel == "zero1":  # the same optimizers as the flat ZeRO strategies
            check_elementwise(optimizer, "strategy=zero1 over a model-parallel mesh cannot step {name}",
                              "it steps each parameter on one rank of its data group", "Use strategy=ddp")
        tensor_plan, self.plan_note = plan.tensor_plan, ""
        if shape.tensor > 1:
            from hvdtrain.parallel.tensor.plan import check_plan, model_tensor_plan

            if tensor_plan is None:
                tensor_plan = model_tensor_plan(model)
                if tensor_plan is None:
                    raise ValueError(f"train.tensor_parallel={shape.tensor} needs a tensor plan: which layers split by "
                                     f"columns, by rows, by heads (Trainer(..., model_plan=ModelPlan(tensor_plan=...)); "
                                     f"a Hugging Face model's own tp_plan is used when it has one; the example "
                                     f"transformer's is hvdtrain.examples.textlm_parallel.tensor_plan)")
                self.plan_note = f"tensor plan: the model's own tp_plan ({len(tensor_plan)} entries)"
            else:
                self.plan_note = f"tensor plan: given ({len(tensor_plan)} entries)"
            chosen = check_plan(model, tensor_plan, shape.tensor)  # before any collective: refused on every rank alike
            check_sliceable(optimizer)
        # Where a Hugging Face model cuts into stages, probed while it is whole, before
        # any collective (refused by name on every rank alike).
        hf_plan = None
        if shape.pipeline > 1:
            from hvdtrain.parallel.pipeline.stage import probe_model
            hf_plan = probe_model(model, plan)
        # 1. While every rank holds the whole model: rank 0's state everywhere. A model built on the
        #    meta device gets the same values on every rank from the seed, after it is split (4.).
        if deferred is None:
            collectives.broadcast_model_and_optimizer(model, optimizer, root_rank=0)
        full_sd = model.state_dict()
        self._full_shapes = {name: (t.shape, t.dtype) for name, t in full_sd.items()}
        names_of = self._names_by_tensor(model)
        # The full optimizer's parameter order, by name: a full checkpoint's optimizer indices.
        self._optimizer_names = [[names_of[id(p)][0] for p in group["params"]] for group in optimizer.param_groups]
        self._optimizer_index = {name: i for i, name in enumerate(n for names in self._optimizer_names for n in names)}
        # 2. Tensor parallelism replaces layers in place; the state_dict names stay the full model's.
        replacements: List[Any] = []
        self._audit = None
        if shape.tensor > 1:
            from hvdtrain.parallel.tensor.audit import SplitAudit
            from hvdtrain.parallel.tensor.plan import parallelize, summed_parameters
            from hvdtrain.parallel.tensor.probe import ForwardProbe
            from hvdtrain.parallel.tensor.region import agreed_names, split_region_parameters, sum_split_region_gradients
            # Whole parameters that meet a split activation (xIELU's alpha_p after a colwise up_proj):
            # decided on the whole model; every rank sums the same ones (a model on the meta device:
            # none decided, the audit refuses them).
            region = agreed_names(None if deferred is not None else split_region_parameters(model, chosen, world.device),
                                  lambda names: collectives.allgather_object(names, name="tp.region.names"))
            self._audit = SplitAudit(mesh.tensor, summed_parameters(model, chosen) + region, world.device)
            probe = ForwardProbe(world.device)
            if deferred is None:  # a model built on the meta device has no values to run whole
                probe.before_split(model)
            parallelize(model, tensor_plan, mesh.tensor, replacements, observe=self._audit.observe_part)
            sum_split_region_gradients(model, region, mesh.tensor, observe=self._audit.observe_part)
            probe.after_split(model)
        # 3. Pipeline stages.
        self.pipeline = None
        if shape.pipeline > 1:
            from hvdtrain.parallel.pipeline.stage import build_stage
            self.pipeline = build_stage(model, plan, mesh, loss_fn, micro_batches, schedule, hf_plan, virtual_stages)
            held = {id(t) for t in self.pipeline.module.parameters()} | {id(b) for b in self.pipeline.module.buffers()}
        else:
            held = {id(t) for t in model.parameters()} | {id(b) for b in model.buffers()}
        self._held = held
        if deferred is not None:  # 4. Only this rank's slices and stage get memory and values.
            from hvdtrain.strategies.model_parallel.initialization import initialize_by_slice
            initialize_by_slice(deferred, model, held, replacements)
        self._stages_of = self._stages_by_name(model, held)
        live = dict(model.named_parameters(remove_duplicate=False))
        with torch.no_grad():
            for name, parameter in live.items():
                if id(parameter) not in held and parameter.numel():
                    parameter.data = torch.empty(0, dtype=parameter.dtype, device=parameter.device)
        # 5. This rank's parameters, in the user's groups; the optimizer steps its own share of them.
        self._local_names = [[n for n in names if id(live[n]) in held] for names in self._optimizer_names]
        self._live = live
        self._local = [live[n] for names in self._local_names for n in names]
        self._owner = deal_out([(n, live[n].numel()) for names in self._local_names for n in names],
                               shape.data if data_parallel == "zero1" else 1)
        # Under ddp every data rank steps all of its parameters (and data rank 0's state is written).
        stepping_as = mesh.coordinates.data if data_parallel == "zero1" else 0
        self._owned_names = [[n for n in names if self._owner[n] == stepping_as] for names in self._local_names]
        self.optimizer = optimizer_like(optimizer, [[live[n] for n in names] for names in self._owned_names])
        # Decided once: every rank of a data group holds the same names, so all decide alike.
        self._broadcasts = mesh.data.process_set is not None and len(set(self._owner.values())) > 1
        self._model_placements = self._placements_of(model)
        if self._audit is not None:  # the first step proves the split counts every contribution once
            self._audit.watch([(name, p) for name, p in model.named_parameters()
                               if id(p) in held and p.requires_grad and not hasattr(p, "tensor_shard")])

    # --- who holds what -------------------------------------------------------------------

    def holds(self, tensor: torch.Tensor) -> bool:
        """Whether this rank's stage holds ``tensor`` (a parameter or buffer of the model)."""
        return id(tensor) in self._held

    @property
    def full_shapes(self) -> Dict[str, torch.Size]:
        """Every state_dict name's shape in the whole model (this rank holds slices and stages)."""
        return {name: shape for name, (shape, _) in self._full_shapes.items()}

    @staticmethod
    def _names_by_tensor(model: nn.Module) -> Dict[int, List[str]]:
        names: Dict[int, List[str]] = {}
        for name, tensor in model.state_dict(keep_vars=True).items():
            names.setdefault(id(tensor), []).append(name)
        for name, parameter in model.named_parameters(remove_duplicate=False):
            names.setdefault(id(parameter), []).append(name)
        return names

    def _stages_by_name(self, model: nn.Module, held: set) -> Dict[str, int]:
        """For each full state_dict name, the first stage that holds it (the stage that writes it
        into a gathered checkpoint); every rank learns every stage's by one small all-gather."""
        mine = sorted(name for name, t in model.state_dict(keep_vars=True).items() if id(t) in held)
        stages: Dict[str, int] = {}
        every = collectives.allgather_object((self.mesh.stage, mine), name="model_parallel.held_names")
        for stage, names in every:
            for name in names:
                stages[name] = min(stage, stages.get(name, stage))
        missing = sorted(set(self._full_shapes) - set(stages))
        if missing:
            raise ValueError(f"the pipeline's layers leave out {', '.join(missing[:5])}: every parameter and "
                             f"buffer must be in exactly one layer of pipeline_layers(model) (tied ones in several)")
        return stages

    def _writes(self, name: str, split: bool, data: int = 0) -> bool:
        """Whether this rank writes ``name`` into a gathered checkpoint: the first data replica's copy
        (or, for optimizer state under zero1, the owner's: ``data``), its first stage, every tensor
        rank's slice of a split tensor and tensor rank 0's copy of a replicated one."""
        d, stage, t = self.mesh.coordinates
        return d == data and stage == self._stages_of[name] and (split or t == 0)

    def _placements_of(self, model: nn.Module) -> List[Placement]:
        current = model.state_dict(keep_vars=True)
        placements = []
        for name, (shape, dtype) in self._full_shapes.items():
            tensor = current[name]
            shard = getattr(tensor, "tensor_shard", None)
            local = tensor.data if id(tensor) in self._held else None
            placements.append(Placement(name, shape, dtype, local, shard,
                                        local is not None and self._writes(name, shard is not None)))
        return placements

    # --- the step ---------------------------------------------------------------------------

    @property
    def counts_samples(self) -> bool:
        """One rank reports for each model replica (its first stage's tensor rank 0): every rank of
        the replica holds the same loss (the last stage broadcasts it over the pipeline)."""
        return self.mesh.coordinates.stage == 0 and self.mesh.coordinates.tensor == 0

    def broadcast_from_root(self) -> None:
        """Done in set-up, before the model was cut (step 1 above): nothing left to send."""

    def forward_backward(self, step_fn, batch: Any, autocast, scale_loss, weight: Any) -> Tuple[torch.Tensor, Dict]:
        """One pass as Strategy.forward_backward's without a pipeline; with one, its schedule over the
        batch's micro-batches. Returns (loss, metrics).

        Args:
            step_fn: ``step_fn(model, batch) -> (loss, metrics)``; a pipeline runs it on its last stage.
            batch: this rank's batch.
            autocast: ``autocast()``: the forward's precision context.
            scale_loss: ``scale_loss(loss)``: the loss times fp16's loss scale (a pipeline's schedule does not
                take it).
            weight: the batch's share of the step (hvdtrain.components.token_mean), multiplying its loss
                (``float(weight)``, read after the forward).
        """
        if self.pipeline is None:
            return super().forward_backward(step_fn, batch, autocast, scale_loss, weight)
        loss, metrics = self.pipeline.train_batch(batch, autocast, weight, step_fn)
        if self._audit is not None:
            self._audit.observe_loss(loss)
        return loss, metrics

    def backward(self, loss: torch.Tensor) -> None:
        if self._audit is not None:
            self._audit.observe_loss(loss)
        loss.backward()

    def forward_only(self, step_fn, batch: Any) -> Tuple[torch.Tensor, Dict]:
        if self.pipeline is None:
            return step_fn(self.model, batch)
        return self.pipeline.evaluate_batch(batch, step_fn)

    def synchronize(self) -> None:
        if self._audit is not None:  # the first step only: refused on every rank before any update
            self._audit.check(None)
        # (The pipeline's schedule already summed the tied parameters' gradients over its two ends.)
        if self.mesh.data.process_set is None:
            return  # one data rank: a parameter without a gradient stays None and is skipped, as in one process
        gradients = self._gradients_some_data_rank_produced()
        if gradients:
            hvd.grouped_allreduce_(gradients, op=hvd.Average, name="model_parallel.gradients",
                                   process_set=self.mesh.data.process_set)

    def _gradients_some_data_rank_produced(self) -> List[torch.Tensor]:
        """The data group agrees on which parameters some rank's backward reached (one tiny
        all-reduce): those all-reduce, zeros from the ranks that did not use them (data-dependent
        routing), so every rank passes the same tensors to the grouped all-reduce; a parameter no
        rank used keeps .grad None and is not stepped, as one process skips it."""
        trained = [p for p in self._local if p.requires_grad]
        agreement = start_agreement([p.grad is not None for p in trained], name=f"model_parallel.used.{len(trained)}",
                                    device=self.world.device, process_set=self.mesh.data.process_set)
        gradients = []
        for param, idle in zip(trained, unused_everywhere(agreement)):
            if not idle:
                if param.grad is None:
                    param.grad = torch.zeros_like(param)
                gradients.append(param.grad)
        return gradients

    def clip_grad_norm_(self, max_norm: float) -> float:
        """The whole model's gradient norm, each element counted once (by the rank that would write
        it into a gathered checkpoint), all-reduced; every rank scales its own gradients."""
        owned = [(name, self._live[name].grad) for names in self._local_names for name in names
                 if self._live[name].grad is not None]
        counted = [grad for name, grad in owned
                   if self._writes(name, getattr(self._live[name], "tensor_shard", None) is not None)]
        return clipping.clip_sharded([grad for _, grad in owned], max_norm, "model_parallel.grad_norm", counted)

    def step(self) -> None:
        self.optimizer.step()
        if self._broadcasts:
            self._broadcast_from_owners()

    def _broadcast_from_owners(self) -> None:
        """zero1: every parameter from the data rank that stepped it to the others of its group."""
        group = self.mesh.data
        with torch.no_grad():
            handles = [hvd.broadcast_async_(self._live[name].data, root_rank=group.ranks[self._owner[name]],
                                            name=f"model_parallel.zero1.{name}", process_set=group.process_set)
                       for names in self._local_names for name in names]
            for handle in handles:
                hvd.synchronize(handle)

    def zero_grad(self) -> None:
        for parameter in self._local:
            parameter.grad = None

    # --- the full state ---------------------------------------------------------------------

    def state_dict(self) -> Dict[str, Any]:
        return {"model": self._gather_model(), "optimizer": self._gather_optimizer(self.world.device)}

    def _gather_model(self) -> Dict[str, torch.Tensor]:
        gathered = full_state.gather(self._model_placements, self.world.device, "model_parallel.model")
        return dict(zip((p.name for p in self._model_placements), gathered))

    def _optimizer_placements(self) -> Tuple[List[Placement], List[Tuple[int, str]], List[Tuple[int, str, Any]]]:
        """Placements of the full optimizer's state tensors, in its index order, and its other
        entries. A state tensor shaped like its parameter (Adam's moments) is cut like it; any
        other (a step count) is the same on every rank that holds the parameter. Ranks learn the
        state's keys from the ranks that hold each parameter by one small all-gather."""
        mine: Dict[str, Dict[str, Any]] = {}
        for names, group in zip(self._owned_names, self.optimizer.param_groups):
            for name, parameter in zip(names, group["params"]):
                mine[name] = self.optimizer.state.get(parameter, {})
        described = {name: {key: ("tensor", tuple(v.shape) == tuple(self._live[name].shape), tuple(v.shape), v.dtype)
                            if isinstance(v, torch.Tensor) else ("value", v) for key, v in state.items()}
                     for name, state in mine.items()}
        known: Dict[str, Dict[str, Any]] = {}
        for rank_described in collectives.allgather_object(described, name="model_parallel.optimizer_keys"):
            for name, keys in rank_described.items():
                if keys:
                    known.setdefault(name, keys)
        placements, order, plain = [], [], []
        for name, index in self._optimizer_index.items():
            for key, entry in sorted(known.get(name, {}).items()):
                if entry[0] == "value":
                    plain.append((index, key, entry[1]))
                    continue
                _, param_like, shape, dtype = entry
                shard = getattr(self._live[name], "tensor_shard", None) if param_like else None
                full_shape = self._full_shapes[name][0] if param_like else torch.Size(shape)
                local = mine.get(name, {}).get(key)
                writes = local is not None and self._writes(name, shard is not None, self._owner[name])
                placements.append(Placement(f"{index}.{key}", full_shape, dtype, local, shard, writes))
                order.append((index, key))
        return placements, order, plain

    def _gather_optimizer(self, device: torch.device) -> Dict[str, Any]:
        placements, order, plain = self._optimizer_placements()
        gathered = full_state.gather(placements, device, "model_parallel.optimizer")
        state: Dict[int, Dict[str, Any]] = {}
        for (index, key), tensor in zip(order, gathered):
            state.setdefault(index, {})[key] = tensor
        for index, key, value in plain:
            state.setdefault(index, {})[key] = value
        groups, index = [], 0
        for names, group in zip(self._optimizer_names, self.optimizer.param_groups):
            groups.append({**{k: v for k, v in group.items() if k != "params"},
                           "params": list(range(index, index + len(names)))})
            index += len(names)
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        model, optimizer = state["model"], state["optimizer"]
        self._check_state(sum(len(group["params"]) for group in optimizer["param_groups"]), list(model))
        self._load_whole(model.__getitem__, lambda index, name: optimizer["state"].get(index, {}),
                         optimizer["param_groups"])

    def read_part(self, source: Any) -> Optional[Dict[str, Any]]:
        """From a checkpoint of any layout (hvdtrain.checkpoint.sources.contract), one whole tensor at
        a time: this rank keeps its slices and its stage's tensors, putting each in place as it reads
        it (local, no collective: the checkpoint layer raises a failure on every rank, and no rank
        continues from a part loaded), so no rank holds its part twice; returns None. From weights
        only (a Hugging Face directory): its stage's tensors and its slices of the split ones, read
        (each slice alone) and returned, for load_part."""
        if source.param_groups() is None:
            return {"local": self._read_weights(source)}
        self._check_state(source.parameter_count(), source.model_keys)
        for name, (shape, dtype) in self._full_shapes.items():  # all of them, before any is put in place
            source.check_tensor(name, shape, dtype)
        self._load_whole(source.full_tensor, source.optimizer_state_of, source.param_groups())
        return None

    def load_part(self, part: Optional[Dict[str, Any]]) -> None:
        if part is None:  # read_part put it in place already
            return
        with torch.no_grad():  # each rank's own tensors, read by itself: nothing to send
            for names, value in tensor_names(self.model):
                if names[0] in part["local"]:
                    value.copy_(part["local"][names[0]])

    def _read_weights(self, source: Any) -> Dict[str, torch.Tensor]:
        local = {}
        for names, value in tensor_names(self.model):
            if not self.holds(value):
                continue
            shape, shard = self.full_shapes[names[0]], getattr(value, "tensor_shard", None)
            name = source.first_held(names)
            source.check_tensor(name, shape, self._full_shapes[names[0]][1], cast=True)
            tensor = source.full_tensor(name).reshape(shape) if shard is None else source.read_slice(name, shard)
            local[names[0]] = tensor.to(value.dtype)
        return local

    def _load_whole(self, whole: Callable[[str], torch.Tensor],
                    optimizer_state_of: Callable[[int, str], Dict[str, Any]], param_groups: List[Dict[str, Any]]) -> None:
        """The whole state, one whole tensor at a time (``whole(name)``; ``optimizer_state_of(index,
        name)``: the full optimizer's state of a parameter; ``param_groups``: the full optimizer's
        groups); this rank keeps its slices and its stage's tensors (no collective)."""
        with torch.no_grad():
            for placement in self._model_placements:
                if placement.local is not None:
                    tensor = whole(placement.name)
                    if tuple(tensor.shape) != tuple(placement.shape):
                        raise ValueError(f"the checkpoint's {placement.name} has shape {tuple(tensor.shape)}, this "
                                         f"model's {tuple(placement.shape)}: it is another model")
                    placement.local.copy_(placement.local_from_full(tensor.to(placement.local.device)))
        local_state: Dict[int, Dict[str, Any]] = {}
        position = 0
        for names in self._owned_names:
            for name in names:
                shard = getattr(self._live[name], "tensor_shard", None)
                full_shape = self._full_shapes[name][0]
                entry = {}
                for key, value in optimizer_state_of(self._optimizer_index[name], name).items():
                    if isinstance(value, torch.Tensor) and shard is not None and tuple(value.shape) == tuple(full_shape):
                        value = shard.take(value)
                    entry[key] = value.clone() if isinstance(value, torch.Tensor) else value
                if entry:
                    local_state[position] = entry
                position += 1
        groups, position = [], 0
        for names, saved_group in zip(self._owned_names, param_groups):
            groups.append({**{k: v for k, v in saved_group.items() if k != "params"},
                           "params": list(range(position, position + len(names)))})
            position += len(names)
        self.optimizer.load_state_dict({"state": local_state, "param_groups": groups})

    def _check_state(self, parameter_count: int, keys: Sequence[str]) -> None:
        """ValueError unless a checkpoint of ``parameter_count`` optimized parameters and the model
        state_dict names ``keys`` is of this model (before any tensor is read)."""
        if parameter_count != len(self._optimizer_index):
            raise ValueError(f"the checkpoint's optimizer has {parameter_count} parameters, this model's "
                             f"{len(self._optimizer_index)}: it is another model")
        if set(keys) != set(self._full_shapes):
            extra = sorted(set(keys) ^ set(self._full_shapes))[:5]
            raise ValueError(f"the checkpoint holds another model: the names differ ({', '.join(extra)})")

    # Sharded checkpoints (train.checkpoint_format=sharded): what this rank writes of the state, each
    # element by one rank (the rule of a gathered checkpoint, _writes); read back through a source
    # over every rank's file (hvdtrain.checkpoint.sources.mesh), at this layout or any other
    # (read_part; its capabilities' loads: EVERY_PART).

    def shard_state_dict(self) -> Dict[str, Any]:
        model = {p.name: compact(p.local) for p in self._model_placements if p.writes}
        model_shards = {p.name: p.shard.spec() for p in self._model_placements if p.writes and p.shard is not None}
        state: Dict[int, Dict[str, Any]] = {}
        shards: Dict[int, Dict[str, List[int]]] = {}
        for names, group in zip(self._owned_names, self.optimizer.param_groups):
            for name, parameter in zip(names, group["params"]):
                shard = getattr(self._live[name], "tensor_shard", None)
                for key, value in self.optimizer.state.get(parameter, {}).items():
                    split = (shard is not None and isinstance(value, torch.Tensor)
                             and tuple(value.shape) == tuple(parameter.shape))
                    if not self._writes(name, split, self._owner[name]):
                        continue
                    index = self._optimizer_index[name]
                    state.setdefault(index, {})[key] = compact(value) if isinstance(value, torch.Tensor) else value
                    if split:
                        shards.setdefault(index, {})[key] = shard.spec()
        groups = [{k: v for k, v in group.items() if k != "params"} for group in self.optimizer.param_groups]
        shape = self.mesh.shape
        return {"rank": self.world.rank, "world_size": self.world.size,
                "layout": {"kind": "mesh", "mesh": [shape.data, shape.pipeline, shape.tensor], "model_keys": list(self._full_shapes),
                           "tied": [names for names, _ in tensor_names(self.model) if len(names) > 1],
                           "optimizer_names": [list(names) for names in self._optimizer_names]},
                "model": model, "model_shards": model_shards,
                "optimizer": {"state": state, "shards": shards, "param_groups": groups}}

    def exported_model_state(self) -> Dict[str, torch.Tensor]:
        return self._gather_model()

    def full_tensors(self) -> Iterator[Tuple[str, torch.Tensor]]:
        """One whole tensor at a time (a split layer's slices come together, a stage's tensors reach
        every rank), each distinct tensor once under its first name: no rank holds the whole model."""
        first_names = {names[0] for names, _ in tensor_names(self.model)}
        placements = [p for p in self._model_placements if p.name in first_names]
        for placement, full in full_state.gather_each(placements, self.world.device, "model_parallel.export"):
            yield placement.name, full

    def memory_bytes(self) -> Dict[str, int]:
        return {
            "parameters": storage_bytes(self._local),
            "gradients": storage_bytes(p.grad for p in self._local),
            "optimizer_state": storage_bytes(optimizer_state_tensors(self.optimizer)),
        }
