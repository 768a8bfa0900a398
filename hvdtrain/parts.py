"""The parts of a training run, built once over the ranks and held by both fronts: the Session
(your own loop, ``hvdtrain.setup``) and the Trainer (hvdtrain's loop, fit() and run()).

    topology     who this rank is: the world and the model-parallel mesh     hvdtrain.parallel.topology
    strategy     how the model's state is spread over the ranks              hvdtrain.strategies
    batching/lr  this rank's loaders, the global batch, the scaled LR        hvdtrain.data, hvdtrain.components
    checkpoints  what a checkpoint holds, saving and resuming                hvdtrain.checkpoint
    reporter     start lines, progress, the run directory, memory, timeline  hvdtrain.observability
    faults       preemption and the stall watchdog (elastic: the Trainer)    hvdtrain.fault_tolerance
    loop         epochs, batches and steps over those parts                  hvdtrain.loop

PartsHolder assembles them in order, one named step each: refusals, the model's preparation, the
mesh and its random streams, the checkpoint read and the batching, the strategy, the LR schedule,
the reporting, the checkpoints and the resume, the loop. What both fronts do with them (start and
end a training, explain an out-of-memory error, pretrained weights, Hugging Face export, closing)
is written once, on Parts.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

from hvdtrain.checkpoint import CheckpointError
from hvdtrain.checkpoint.coordination import Checkpointing, attempt, problems_on_any_rank
from hvdtrain.checkpoint.manager import CheckpointManager
from hvdtrain.components.activation_checkpointing import checkpoint_activations
from hvdtrain.components.callbacks import Callback, Callbacks
from hvdtrain.components.compile_cache import CompileCache
from hvdtrain.components.compiling import compile_forward
from hvdtrain.components.lr import LearningRate, SchedulerFactory
from hvdtrain.components.position import Position
from hvdtrain.components.precision import Precision
from hvdtrain.components.steps import StepFn, supervised_step
from hvdtrain.components.sync_batchnorm import convert_sync_batchnorm
from hvdtrain.config.train import TrainConfig
from hvdtrain.data.batching import Batching
from hvdtrain.data.sharding import LoaderFactory
from hvdtrain.distributed import collectives
from hvdtrain.distributed import rng
from hvdtrain.distributed import startup
from hvdtrain.distributed.environments import is_elastic_launch
from hvdtrain.distributed.world import World
from hvdtrain.fault_tolerance import out_of_memory as oom
from hvdtrain.fault_tolerance.handling import FaultHandling
from hvdtrain.loop import TrainingLoop
from hvdtrain.observability.efficiency import Efficiency
from hvdtrain.observability.reporting import Reporter
from hvdtrain.parallel.model_plan import ModelPlan
from hvdtrain.parallel.topology import Topology
from hvdtrain.parallel.sequence import modules as sequence_modules
from hvdtrain.parallel.sequence.batches import BatchSplitter, split_step
from hvdtrain.parallel.sequence.probe import prove as prove_split
from hvdtrain.strategies import build_strategy, launch_refusal
from hvdtrain.strategies.base import Strategy, tensor_names
from hvdtrain.strategies.deferred_init import DeferredInit, InitFn
from hvdtrain.weights import hf_export
from hvdtrain.weights import pretrained
from hvdtrain.weights.export import export_model_streamed

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class Parts:
    """What a training run is made of, built by PartsHolder; the Session and the Trainer are one."""

    config: TrainConfig
    job_config: Dict[str, Any]  # the script's whole configuration, in the run directory and every checkpoint
    # Under Horovod elastic, set-up runs no collective (see PartsHolder).
    elastic_launch: bool
    callbacks: Callbacks
    kept: Dict[str, Any]  # Session.keep(): your own state, in every checkpoint
    given_optimizer: torch.optim.Optimizer  # as the user built it; the strategy may step another (keep() checks)
    step_fn: StepFn
    initialization: Optional[DeferredInit]  # how a model built on the meta device got its values
    model: torch.nn.Module
    recomputed_blocks: List[torch.nn.Module]  # activation checkpointing
    precision: Precision
    topology: Topology
    faults: FaultHandling
    batching: Batching
    strategy: Strategy
    position: Position
    lr: LearningRate
    reporter: Reporter
    checkpoints: CheckpointManager
    loop: TrainingLoop

    @property
    def world(self) -> World:
        """This process's place in the job now (under Horovod elastic it changes with the world)."""
        return self.topology.world

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The optimizer the strategy steps (its param_groups carry the live learning rate)."""
        return self.strategy.optimizer

    def restart_schedule(self) -> None:
        """The LR scaled to the current global batch, warmed up, continuing at the current step."""
        start_schedule(self.lr, self.batching, self.topology, self.position)

    def begin_training(self, until_step: Optional[int]) -> None:
        """What every fit() and every epochs() starts with."""
        total = self.batching.steps_for(self.config.max_steps if until_step is None else until_step)
        self.reporter.start(total, self.position.step)
        self.faults.flight.open(self.reporter.path)  # under elastic the run directory is agreed at the first sync
        self.faults.start_watchdog(self.strategy.pending_communication)
        self.loop.begin()
        self.callbacks.call("on_train_start")

    def end_training(self) -> None:
        """What every fit() and every epochs() ends with, however it ends."""
        self.reporter.finish(self.position.step)
        if self.loop.compile_cache is not None:  # the evaluation's graph too, once compiled
            self.loop.compile_cache.save()
        self.faults.stop_watchdog()
        self.batching.release_workers()

    def out_of_memory_explained(self) -> contextlib.AbstractContextManager:
        """Around training: an out-of-memory error says what the loop was doing and what this rank held."""
        return oom.explained(lambda error: self._explain_out_of_memory(error, self.loop.phase, self.optimizer,
                                                                      self.strategy.memory_bytes()))

    def _explain_out_of_memory(self, error: BaseException, phase: str, optimizer: torch.optim.Optimizer,
                              held: Dict[str, int]) -> str:
        """The message for an out-of-memory ``error`` in ``phase``, logged on this rank too."""
        return explain_out_of_memory(self.config, self.topology, self.model, error, phase, optimizer, held)

    def load_pretrained(self, directory) -> int:
        """Start from a local Hugging Face model directory's weights (config.json + safetensors, as
        save_pretrained writes it), each rank reading only what it keeps (under zero1, zero2, fsdp
        its slices: hvdtrain.weights.pretrained). Every rank calls it, before training; a directory
        that does not fit the model is refused on every rank. Returns the bytes this rank read."""
        if self.position.step:
            raise ValueError(f"load_pretrained starts a run from pretrained weights, but this one is at step "
                             f"{self.position.step} (resumed from a checkpoint, or trained): its weights are newer")
        def read() -> Tuple[pretrained.SafetensorsSource, Any]:
            reader = pretrained.SafetensorsSource(directory)
            return reader, self.strategy.read_part(reader)
        outcome = attempt(read)
        problems = problems_on_any_rank(outcome if isinstance(outcome, str) else None, "pretrained")
        if problems:
            raise CheckpointError(f"the pretrained weights in {directory} cannot be loaded: {'; '.join(problems)}")
        reader, part = outcome
        self.strategy.load_part(part)
        self.topology.log.info(f"started from the pretrained weights in {directory} (this rank read "
                               f"{reader.bytes_read / 2**20:.1f} MiB)")
        return reader.bytes_read

    def export_hf(self, directory, max_shard_bytes: int = hf_export.DEFAULT_MAX_SHARD_BYTES) -> None:
        """A Hugging Face model, as it is now, as a directory ``from_pretrained`` loads (config.json,
        safetensors; numbered files and an index past ``max_shard_bytes``). Every rank calls it (fsdp
        gathers one unit at a time; no rank holds the whole model); rank 0 writes; a failure is raised
        on every rank."""
        if not hf_export.is_hf_model(self.model):
            raise TypeError(f"export_hf writes transformers models (PreTrainedModel); this model is a "
                            f"{type(self.model).__name__}: its weights are in the run directory's model.safetensors")
        failure = hf_export.export_hf(hf_export.hf_config_text(self.model), self.strategy.full_tensors(), directory,
                                      writes=self.world.is_root, max_shard_bytes=max_shard_bytes)
        failure = collectives.broadcast_object(failure, root_rank=0, name="export.hf")
        if failure:
            raise CheckpointError(failure)
        self.topology.log.info(f"Hugging Face model written to {directory} (transformers' from_pretrained loads it)")

    def close(self) -> None:
        """Close the run directory's files (the metrics, TensorBoard and log files) and let the
        checkpoint directory go (another run may own it; a later training claims it again)."""
        self.reporter.close()
        self.faults.flight.close()
        if self.checkpoints.protocol is not None:
            self.checkpoints.protocol.close()

    def close_mesh(self) -> None:
        """Remove every Horovod process set of the run: the topology's (the mesh's, the sequence, expert and
        hsdp groups'), and a strategy's own topology's if it made one (a collective: every rank calls it)."""
        self.topology.close()
        close_groups = getattr(self.strategy, "close_groups", None)
        if close_groups is not None:
            close_groups()


class PartsHolder:
    """What the Session (your own loop) and the Trainer (hvdtrain's loop) share: the parts of the run,
    built once in order on every rank and held as ``parts``, and the calls both offer."""

    own_loop = False  # the Session's: your loop runs the forward, not the Trainer's step

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        train_dataset: Dataset,
        val_dataset: Optional[Dataset] = None,
        config: Optional[TrainConfig] = None,
        loss_fn: LossFn = F.cross_entropy,
        world: Optional[World] = None,
        job_config: Optional[Mapping[str, Any]] = None,
        step_fn: Optional[StepFn] = None,
        model_plan: Optional[ModelPlan] = None,
        collate_fn: Optional[Callable[[List[Any]], Any]] = None,
        callbacks: Sequence[Callback] = (),
        lr_scheduler: Optional[SchedulerFactory] = None,
        init_fn: Optional[InitFn] = None,
        loader_factory: Optional[LoaderFactory] = None,
    ) -> None:
        """The parts of a run of ``model`` and ``optimizer`` on ``train_dataset``, over all ranks
        (every rank calls it); a checkpoint in train.checkpoint_dir is resumed.

        Args:
            model: built as for one process (on the meta device too: hvdtrain.strategies.deferred_init).
            optimizer: over ``model``, with the learning rate of one worker.
            train_dataset: the whole training set; each rank reads its shard.
            val_dataset: evaluated at each epoch's end (and every train.eval_every steps), if given.
            config: the ``train`` section (default: TrainConfig()).
            loss_fn: ``loss_fn(outputs, targets)``, the batch's mean loss (unless ``step_fn``).
            world: this process's place in the job (default: Horovod started from ``config``).
            job_config: the script's whole resolved configuration (default: the ``train`` section).
            step_fn: ``step_fn(model, batch) -> (loss, metrics)`` for batches of any structure.
            model_plan: how one replica is split under tensor or pipeline parallelism.
            collate_fn: how the loaders make a batch of samples.
            callbacks: hvdtrain.Callback instances, given this Session or Trainer.
            lr_scheduler: ``lr_scheduler(optimizer[, total_steps]) -> scheduler``, replacing hvdtrain's schedule.
            init_fn: ``init_fn(module)``, the values of a model built on the meta device.
            loader_factory: ``loader_factory(dataset, sampler, batch_size) -> DataLoader``.
        """
        cfg = config or TrainConfig()
        job_config = dict(job_config) if job_config is not None else {"train": cfg.to_dict()}
        world = world or startup.init(cfg)
        # Under Horovod elastic, set-up runs no collective: a worker that joins later runs this while
        # the others wait in the elastic sync, and mismatched collectives deadlock. The elastic sync
        # broadcasts rank 0's state (and its checkpoint, if it read one) instead.
        elastic_launch = is_elastic_launch()
        hooks = Callbacks(self, callbacks)  # callbacks are given the Session or Trainer the user holds
        refuse_what_cannot_run(cfg, world, elastic_launch, lr_scheduler)
        if cfg.sequence_parallel > 1 and self.own_loop:
            raise ValueError(f"train.sequence_parallel={cfg.sequence_parallel} cuts each batch inside the Trainer's "
                             f"step (each rank its part of every sequence); your own loop's forward would see whole "
                             f"sequences: use hvdtrain.Trainer (a step_fn of your own is cut the same way), or "
                             f"train.sequence_parallel=1")
        step_fn = step_fn or supervised_step(loss_fn)
        # Before hvdtrain changes the model (checkpointing, sequence, tensor and pipeline splits): the
        # whole model's FLOPs are counted on a meta copy of it; and this rank's peak (a CPU's measured).
        efficiency = Efficiency.at_setup(model, step_fn, cfg.precision, world.device)
        initialization, model, recomputed_blocks = prepare_model(cfg, model, optimizer, world, init_fn)
        precision = Precision(cfg.precision, world.device)
        topology = build_topology(cfg, world)
        # The stall watchdog guards the set-up's collectives too (a rank stuck in one ends the job).
        faults = FaultHandling(cfg, topology)
        with faults.guarding_setup():
            protocol, resumed, batching = read_checkpoint_and_batch(
                cfg, topology, faults, job_config, elastic_launch, train_dataset, val_dataset, collate_fn,
                loader_factory)
            # A data-parallel strategy wraps a model whose attention is already split; a tensor-parallel
            # one replaces the attention modules, so theirs are split once it has (prepare_sequences).
            splitter = prepare_sequences(topology, model) if topology.mesh is None else None
            # Its file is published into checkpoint_dir like a checkpoint: fenced by the run's lease.
            compile_cache = (CompileCache(cfg.checkpoint_dir, world.is_root, topology.log,
                                          before_publish=protocol.fence if protocol is not None else None)
                             if cfg.compile else None)
            strategy = shard(cfg, topology, model, optimizer, model_plan, loss_fn, initialization, elastic_launch,
                             compile_cache)
            if topology.mesh is not None:
                splitter = prepare_sequences(topology, model)
            if splitter is not None:
                prove_split(model, splitter, topology.sequence, strategy.forward_only, world.device)
            position = Position()
            lr = LearningRate(cfg, strategy.optimizer, lr_scheduler)
            start_schedule(lr, batching, topology, position)
            topology.follow(lambda followed: strategy.follow_world(followed.world))
            reporter = build_reporter(cfg, topology, job_config, strategy, batching, lr, recomputed_blocks,
                                      initialization, elastic_launch, efficiency)
            faults.flight.open(reporter.path)  # flight records into the run directory (set-up's stalls too)
            kept: Dict[str, Any] = {}
            checkpoints = CheckpointManager(cfg, topology, protocol, strategy, position, lr, precision, batching,
                                            job_config, hooks, kept, guard_io=faults.checkpoint_io)
            # Under elastic, a sharded strategy's first sync loads the checkpoint (every rank reads its part).
            if resumed is not None and not (elastic_launch and strategy.capabilities.elastic_from_checkpoint):
                with faults.checkpoint_io():
                    checkpoints.load(resumed)
            reporter.open_timeline(position.step)
            if splitter is not None:  # each rank computes its part of every sequence
                step_fn = split_step(step_fn, splitter)
            loop = TrainingLoop(cfg, topology, model, strategy, step_fn, precision, batching, lr, position, reporter,
                                checkpoints if protocol is not None else None, faults, hooks,
                                compile_cache=compile_cache)
        self.parts = Parts(config=cfg, job_config=job_config, elastic_launch=elastic_launch, callbacks=hooks,
                           kept=kept, given_optimizer=optimizer, step_fn=step_fn, initialization=initialization, model=model,
                           recomputed_blocks=recomputed_blocks, precision=precision, topology=topology, faults=faults,
                           batching=batching, strategy=strategy, position=position, lr=lr, reporter=reporter,
                           checkpoints=checkpoints, loop=loop)

    # --- what users and callbacks read ------------------------------------------------------------

    @property
    def model(self) -> torch.nn.Module:
        """The model on this rank's device, as the strategy trains it (call it in your forward)."""
        return self.parts.model

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The optimizer the strategy steps (its param_groups carry the live learning rate)."""
        return self.parts.optimizer

    @property
    def strategy(self) -> Strategy:
        """How the model's state is spread over the ranks (``exported_model_state()`` makes it whole)."""
        return self.parts.strategy

    @property
    def world(self) -> World:
        """This process's place in the job now (under Horovod elastic it changes with the world)."""
        return self.parts.world

    @property
    def global_step(self) -> int:
        """Optimizer steps taken since the run's start (a resumed run counts on)."""
        return self.parts.position.step

    @property
    def history(self) -> List[Dict[str, float]]:
        """The records of the epochs trained by the last fit() or epochs(), one per epoch."""
        return self.parts.loop.history

    @property
    def preempted(self) -> bool:
        """Training ended for a preemption signal (train.preempt_signal): the step is checkpointed and,
        under SLURM, the job requeued; your script should end (the next start resumes)."""
        return self.parts.loop.preempted

    # --- the calls both offer ---------------------------------------------------------------------

    def evaluate(self) -> Dict[str, float]:
        """The step's loss and metrics over the whole validation set (every rank's shard), as
        val_loss, val_<metric>."""
        return self.parts.loop.evaluate()

    def request_stop(self, reason: str) -> None:
        """End training at the next point where the ranks agree (after an evaluation, at an epoch's
        end, every preempt_check_every steps), with a checkpoint of that step; for callbacks."""
        self.parts.callbacks.request_stop(reason)

    def state_dict(self) -> Dict[str, Any]:
        """Everything needed to continue exactly, in the full checkpoint format (every rank calls it)."""
        return self.parts.checkpoints.state_dict()

    def load_pretrained(self, directory) -> int:
        """Start from a local Hugging Face model directory's weights, each rank reading only what it
        keeps; every rank calls it, before training. Returns the bytes this rank read
        (Parts.load_pretrained)."""
        return self.parts.load_pretrained(directory)

    def export_hf(self, directory, max_shard_bytes: int = hf_export.DEFAULT_MAX_SHARD_BYTES) -> None:
        """A Hugging Face model, as it is now, as a directory ``from_pretrained`` loads; every rank
        calls it, rank 0 writes (Parts.export_hf). The Trainer's ``run()`` does it at the end, into
        the run directory's ``hf/``."""
        self.parts.export_hf(directory, max_shard_bytes)

    def export(self, directory) -> None:
        """The model as it is now, whole, as ``directory``/model.safetensors under every state_dict
        name (tied weights under each of theirs), with the step and strategy in its metadata. Every
        rank calls it: the strategy's tensors come one at a time (fsdp gathers one unit at a time; no
        rank holds the whole model); rank 0 writes; a failure is raised on every rank. The Trainer's
        run() does it at the end, into the run directory."""
        parts = self.parts
        aliases = {names[0]: names for names, _ in tensor_names(parts.model)}
        failure = export_model_streamed(parts.strategy.full_tensors(), aliases, directory, writes=self.world.is_root,
                                        metadata={"step": parts.position.step, "strategy": parts.config.strategy})
        failure = collectives.broadcast_object(failure, root_rank=0, name="export.model")
        if failure:
            raise CheckpointError(failure)
        parts.topology.log.info(f"trained model written to {directory}/model.safetensors (safetensors)")

    def close(self) -> None:
        """Close the run directory's files and let the checkpoint directory go (a later training
        claims it again)."""
        self.parts.close()

    def close_mesh(self) -> None:
        """Remove the model-parallel mesh's Horovod process sets (a collective: every rank calls it).
        A process that goes on after training (a sweep of Trainers, a test suite) closes them; the
        run cannot step, gather or checkpoint afterwards."""
        self.parts.close_mesh()


# --- the steps of PartsHolder's set-up, in order --------------------------------------------------------------

def refuse_what_cannot_run(cfg: TrainConfig, world: World, elastic_launch: bool,
                           lr_scheduler: Optional[SchedulerFactory]) -> None:
    """What this launch cannot do, refused on every rank alike before any collective, instead of
    failing or hanging in the first step.

    Args:
        cfg: the ``train`` section.
        world: what Horovod was started with (hierarchical all-reduce).
        elastic_launch: under Horovod elastic, async saves and your own scheduler are refused.
        lr_scheduler: your own schedule, if given: it replaces hvdtrain's, which must then be off.
    """
    if cfg.hierarchical_allreduce and not world.hierarchical_allreduce:
        raise ValueError(startup.hierarchical_conflict())
    if cfg.checkpoint_async and elastic_launch:
        raise ValueError("train.checkpoint_async is not supported under Horovod elastic (a world change while a "
                         "write is in flight is not handled): launch without --min-np/--max-np, or "
                         "set train.checkpoint_async=false")
    warmup = cfg.warmup_steps if cfg.warmup_steps is not None else cfg.warmup_epochs  # steps replace epochs
    if lr_scheduler is not None and (warmup or cfg.lr_schedule != "constant"):
        raise ValueError(f"lr_scheduler replaces hvdtrain's own schedule: set train.warmup_epochs=0, "
                         f"train.warmup_steps=null (or 0) and train.lr_schedule=constant (got "
                         f"{cfg.warmup_epochs:g}, {cfg.warmup_steps} and {cfg.lr_schedule}), and put a warm-up "
                         f"into your scheduler if you want one")
    if cfg.sequence_parallel > 1 and elastic_launch:
        raise ValueError(f"train.sequence_parallel={cfg.sequence_parallel} is not supported under Horovod elastic (the "
                         f"sequence groups are fixed at start): launch without --min-np/--max-np")
    if lr_scheduler is not None and elastic_launch:
        raise ValueError("lr_scheduler is not supported under Horovod elastic: the global batch and the scaled "
                         "rates change with the world, and your scheduler was built for one; use train.lr_schedule, "
                         "or launch without --min-np/--max-np")
    refusal = launch_refusal(cfg, world, elastic_launch)
    if refusal:
        raise ValueError(refusal)


def prepare_model(cfg: TrainConfig, model: torch.nn.Module, optimizer: torch.optim.Optimizer, world: World,
                  init_fn: Optional[InitFn]) -> Tuple[Optional[DeferredInit], torch.nn.Module, List[torch.nn.Module]]:
    """The model on this rank's device, before the strategy wraps it: (its deferred initialization
    if it was built on the meta device, the model, the blocks whose activations are recomputed).

    Args:
        cfg: seed, sync_batchnorm and activation_checkpointing.
        model: as the user built it.
        optimizer: over ``model`` (a deferred initialization gives its parameters values too).
        world: this rank's device.
        init_fn: the values of a model built on the meta device, if given.
    """
    # Before anything holds the model's tensors: a model built on the meta device gets tensors
    # on this rank's device that take memory only once the strategy gives them values.
    deferred = DeferredInit.of(model, optimizer, world.device, cfg.seed, init_fn)
    # Before the strategy wraps it: the converted layers keep the same parameter objects.
    model = (convert_sync_batchnorm(model) if cfg.sync_batchnorm else model).to(world.device)
    recomputed = checkpoint_activations(model, cfg.activation_checkpointing, cfg.activation_checkpointing_every)
    return deferred, model, recomputed


def build_topology(cfg: TrainConfig, world: World) -> Topology:
    """The world and the model-parallel mesh, with the mesh's random streams."""
    # The mesh is a collective, refused on every rank alike when it does not divide the world.
    topology = Topology.build(world, cfg.tensor_parallel, cfg.pipeline_parallel, cfg.sequence_parallel)
    if topology.mesh is not None:  # every rank, so that a group's first rank starts its stream anew too
        rng.seed_everything(rng.rank_seed(cfg.seed, topology.rng_rank))
    return topology


def read_checkpoint_and_batch(cfg: TrainConfig, topology: Topology, faults: FaultHandling,
                              job_config: Dict[str, Any], elastic_launch: bool, train_dataset: Dataset,
                              val_dataset: Optional[Dataset], collate_fn: Optional[Callable[[List[Any]], Any]],
                              loader_factory: Optional[LoaderFactory],
                              ) -> Tuple[Optional[Checkpointing], Any, Batching]:
    """The checkpoint to resume (if train.checkpoint_dir has one), then this rank's loaders:
    (the checkpoint protocol or None, the checkpoint read or None, the batching).

    Args:
        cfg: checkpoint_dir, batch_size, micro_batches.
        topology: the data-parallel world the loaders shard over.
        faults: guards the checkpoint's reading.
        job_config: what a checkpoint records.
        elastic_launch: under Horovod elastic the checkpoint is not broadcast (no collective at set-up).
        train_dataset: the training set.
        val_dataset: the validation set, if any.
        collate_fn: how the loaders make a batch.
        loader_factory: the user's own loaders, if given.
    """
    # Read before the loaders are built: a run resumed on another worker count keeps the
    # checkpoint's global batch, so its batch per worker follows from it.
    protocol = Checkpointing(cfg, topology, job_config) if cfg.checkpoint_dir else None
    with faults.checkpoint_io():
        resumed = protocol.start(broadcast=not elastic_launch) if protocol else None
    batch_size = protocol.batch_per_worker(resumed, elastic_launch) if protocol else cfg.batch_size
    if topology.mesh is not None and batch_size % cfg.micro_batches:
        raise ValueError(f"each worker's batch of {batch_size} (from the checkpoint's global batch) cannot be "
                         f"cut into train.micro_batches={cfg.micro_batches}: choose a divisor of {batch_size}")
    batching = Batching(cfg, topology.data_world, batch_size, train_dataset, val_dataset, collate_fn, loader_factory)
    return protocol, resumed, batching


def prepare_sequences(topology: Topology, model: torch.nn.Module) -> Optional[BatchSplitter]:
    """Under sequence parallelism, the model's attention split by heads around an all-to-all and the
    splitter of its batches; None otherwise. Refused by name on every rank alike (the same model
    everywhere) before any collective of the step. Under tensor parallelism the heads split are this
    rank's share of the tensor group's."""
    if topology.sequence is None:
        return None
    return sequence_modules.prepare(model, topology.sequence)


def shard(cfg: TrainConfig, topology: Topology, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
          model_plan: Optional[ModelPlan], loss_fn: LossFn, deferred: Optional[DeferredInit],
          elastic_launch: bool, compile_cache: Optional[CompileCache] = None) -> Strategy:
    """The strategy (train.strategy) over the model and optimizer, rank 0's state everywhere.

    Args:
        cfg: strategy, compile.
        topology: the world and the mesh.
        model: prepared (prepare_model).
        optimizer: the user's; the strategy wraps it, or steps one of its own.
        model_plan: the split of one replica under tensor or pipeline parallelism.
        loss_fn: a pipeline's last stage computes it.
        deferred: a meta-device model's initialization, which the strategy runs.
        elastic_launch: under Horovod elastic the elastic sync broadcasts instead.
        compile_cache: under train.compile, loaded before the first compile (components.compile_cache).
    """
    world = topology.world
    # The strategy wraps the optimizer: for ddp, Horovod's hooks start each gradient's all-reduce
    # as soon as backward produces it (overlap, tensor fusion).
    phase = "set-up (sharding the model and optimizer)"
    with oom.explained(lambda error: explain_out_of_memory(cfg, topology, model, error, phase, optimizer, held={})):
        strategy = build_strategy(cfg, model, optimizer, world, mesh=topology.mesh, plan=model_plan,
                                  loss_fn=loss_fn, deferred=deferred, topology=topology)
    if cfg.compile:  # the forward only, in place: hooks, state_dict keys, checkpoints unchanged
        compile_forward(model, world.device)
        if compile_cache is not None:
            compile_cache.load()
    # Rank 0's parameters and optimizer state, everywhere, before the first step. Before the rates
    # are scaled: a sharded strategy's broadcast loads the user's optimizer state, and with it the
    # groups' unscaled rates.
    if not elastic_launch:
        strategy.broadcast_from_root()
    return strategy


def start_schedule(lr: LearningRate, batching: Batching, topology: Topology, position: Position) -> None:
    """The LR scaled to the current global batch, warmed up, continuing at the current step.

    Args:
        lr: the rates and the schedule.
        batching: the global batch, the warm-up and the run's total steps.
        topology: the data-parallel world the rates are scaled to.
        position: the step the schedule continues at.
    """
    lr.start(batching.global_batch_size, batching.warmup_steps, topology.data_world, position.step,
             batching.total_steps)


def build_reporter(cfg: TrainConfig, topology: Topology, job_config: Dict[str, Any], strategy: Strategy,
                   batching: Batching, lr: LearningRate, recomputed_blocks: List[torch.nn.Module],
                   deferred: Optional[DeferredInit], elastic_launch: bool,
                   efficiency: Optional[Efficiency] = None) -> Reporter:
    """The reporter (run directory, progress, memory, timeline), and the start line it prints.

    Args:
        cfg: the ``train`` section.
        topology: who reports.
        job_config: recorded in the run directory.
        strategy: its memory and plan note.
        batching: the batch sizes, for the start line.
        lr: the scaled rates, for the start line.
        recomputed_blocks: activation checkpointing, for the start line.
        deferred: a meta-device model's initialization, for the start line.
        elastic_launch: under Horovod elastic the run directory is agreed at each sync.
        efficiency: the model FLOPs and this rank's peak (named in the start line).
    """
    reporter = Reporter(cfg, topology, job_config, strategy, elastic_launch, efficiency)
    recomputed = (f"; activation checkpointing: {len(recomputed_blocks)} blocks ({cfg.activation_checkpointing})"
                  if recomputed_blocks else "")
    notes = "".join(f"; {note}" for note in (getattr(strategy, "plan_note", ""), getattr(strategy, "overlap_note", ""))
                    if note)
    reporter.announce(f"{batching.describe()}; {lr.describe()}; strategy {cfg.strategy}; "
                      f"reduction {cfg.reduction}{recomputed}{_initialized(deferred)}{notes}"
                      f"{'; ' + efficiency.peak.describe() if efficiency is not None else ''}")
    return reporter


def explain_out_of_memory(cfg: TrainConfig, topology: Topology, model: torch.nn.Module, error: BaseException,
                          phase: str, optimizer: torch.optim.Optimizer, held: Dict[str, int]) -> str:
    """What ran out of memory, where and with what held, logged on this rank and returned.

    Args:
        cfg: the strategy named in the message.
        topology: this rank's world and log.
        model: its size.
        error: the out-of-memory error.
        phase: what was running.
        optimizer: its state's size.
        held: the strategy's bytes by kind (empty during set-up).
    """
    world = topology.world
    message = oom.explain(error, rank=world.rank, host=world.hostname, phase=phase, strategy=cfg.strategy,
                          workers=world.size, model=model, optimizer=optimizer, held=held, device=world.device)
    topology.log.error(message)  # every rank's own log says it, not only the rank that prints
    return message


def _initialized(deferred: Optional[DeferredInit]) -> str:
    """How a model built on the meta device got its values, for the start line."""
    if deferred is None:
        return ""
    return (f"; built on the meta device, initialized {deferred.granularity} (at most "
            f"{deferred.peak_bytes / 2**20:.1f} MiB of it at once)")
