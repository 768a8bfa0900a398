"""The Trainer: data-parallel training composed of parts, the same for every strategy.

    topology     who this rank is: the world and the model-parallel mesh     hvdtrain.parallel.topology
    strategy     how the model's state is spread over the ranks              hvdtrain.strategies
    batching/lr  this rank's loaders, the global batch, the scaled LR        hvdtrain.data, hvdtrain.training
    checkpoints  what a checkpoint holds, saving and resuming                hvdtrain.checkpoint
    reporter     start lines, progress, the run directory, memory, timeline  hvdtrain.observability
    faults       preemption and the stall watchdog (elastic: fit)            hvdtrain.fault_tolerance
    loop         epochs and steps over those parts                           hvdtrain.loop

The Trainer's own state is three counters (``position``); set-up below, then fit, run, evaluate.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

from hvdtrain.checkpoint.manager import CheckpointManager
from hvdtrain.checkpoint.protocol import Checkpointing, attempt, problems_on_any_rank
from hvdtrain.checkpoint import CheckpointError
from hvdtrain.checkpoint import hf_export
from hvdtrain.checkpoint import pretrained
from hvdtrain.checkpoint.export import export_model_streamed
from hvdtrain.config.train import PRECISIONS, TrainConfig
from hvdtrain.data.batching import Batching
from hvdtrain.data.sharding import ShardedSampler, sharded_loader
from hvdtrain.distributed import collectives
from hvdtrain.distributed import rng
from hvdtrain.distributed import startup
from hvdtrain.distributed.world import World
from hvdtrain.fault_tolerance import elastic
from hvdtrain.fault_tolerance import out_of_memory as oom
from hvdtrain.fault_tolerance.handling import FaultHandling
from hvdtrain.loop import TrainingLoop
from hvdtrain.observability.reporting import Reporter
from hvdtrain.parallel.model_plan import ModelPlan
from hvdtrain.parallel.topology import Topology
from hvdtrain.strategies import build_strategy, launch_refusal
from hvdtrain.strategies.base import tensor_names
from hvdtrain.strategies.deferred_init import DeferredInit, InitFn
from hvdtrain.training.activation_checkpointing import checkpoint_activations
from hvdtrain.training.callbacks import Callback, Callbacks
from hvdtrain.training.compiling import compile_forward
from hvdtrain.training.evaluation import evaluate
from hvdtrain.training.lr import LearningRate, SchedulerFactory
from hvdtrain.training.position import Position
from hvdtrain.training.precision import Precision
from hvdtrain.training.steps import StepFn, supervised_step
from hvdtrain.training.sync_batchnorm import convert_sync_batchnorm

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class Trainer:
    """Trains ``model`` with ``optimizer`` on ``train_dataset``, data-parallel over all ranks.

    Build the model and optimizer as for one process, with the learning rate of one worker: the
    Trainer hands both to the strategy (``config.strategy``), scales the rate and broadcasts rank 0's
    state. ``loss_fn(outputs, targets)`` returns the batch's mean loss; or ``step_fn(model, batch) ->
    (loss, metrics)`` computes both from a batch of any structure (hvdtrain.training.steps), every
    metric reported as a mean over every rank's samples. ``job_config``: the script's whole resolved
    configuration, recorded in the run directory and every checkpoint (default: the ``train`` section).
    ``model_plan``: how one replica is split under tensor or pipeline parallelism. ``collate_fn``:
    how the loaders make a batch of samples, for training and evaluation (as DataLoader's, e.g. a
    Hugging Face DataCollatorWithPadding: each batch padded only to its own longest sample).
    ``callbacks``: hvdtrain.Callback instances called at the loop's usual points, on every rank
    (hvdtrain.training.callbacks; EarlyStopping is one). ``lr_scheduler(optimizer) -> scheduler``:
    your own LR schedule, built over the optimizer the strategy steps once its rates are scaled to
    the global batch, stepped after every optimizer step and kept in checkpoints; it replaces
    train.warmup_epochs and train.lr_schedule (set them to 0 and constant).

    A model built under ``torch.device("meta")`` (and its optimizer over it) takes no memory until
    the Trainer gives it values from ``train.seed``: the modules' own initialization, then Hugging
    Face's or ``init_fn(module)``, equal to the model built whole; under fsdp each rank computes
    its shards with one unit in memory at a time, never the whole model
    (hvdtrain.strategies.deferred_init).
    """

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
    ) -> None:
        self.config = cfg = config or TrainConfig()
        self.job_config = dict(job_config) if job_config is not None else {"train": cfg.to_dict()}
        world = world or startup.init(seed=cfg.seed, timeline=cfg.timeline_steps > 0,
                                      hierarchical_allreduce=cfg.hierarchical_allreduce,
                                      dynamic_process_sets=cfg.model_parallel)
        # Under Horovod elastic, set-up runs no collective: a worker that joins later runs this while
        # the others wait in the elastic sync, and mismatched collectives deadlock. The elastic sync
        # broadcasts rank 0's state (and its checkpoint, if it read one) instead.
        self.elastic_launch = elastic.is_elastic_launch()
        self.callbacks = Callbacks(self, callbacks)
        self._refuse_what_cannot_run(world, step_fn, lr_scheduler)
        self.step_fn = step_fn or supervised_step(loss_fn)
        # Before anything holds the model's tensors: a model built on the meta device gets tensors
        # on this rank's device that take memory only once the strategy gives them values.
        self.initialization = deferred = DeferredInit.of(model, optimizer, world.device, cfg.seed, init_fn)
        # Before the strategy wraps it: the converted layers keep the same parameter objects.
        self.model = (convert_sync_batchnorm(model) if cfg.sync_batchnorm else model).to(world.device)
        self.recomputed_blocks = checkpoint_activations(self.model, cfg.activation_checkpointing,
                                                        cfg.activation_checkpointing_every)
        self.precision = Precision(cfg.precision, world.device)

        # The mesh is a collective, refused on every rank alike when it does not divide the world.
        self.topology = Topology.build(world, cfg.tensor_parallel, cfg.pipeline_parallel)
        if self.topology.mesh is not None:  # every rank, so that a group's first rank starts its stream anew too
            rng.seed_everything(rng.rank_seed(cfg.seed, self.topology.rng_rank))

        # The stall watchdog guards the set-up's collectives too (a rank stuck in one ends the job).
        self.faults = FaultHandling(cfg, self.topology)
        with self.faults.guarding_setup():
            # Read before the loaders are built: a run resumed on another worker count keeps the
            # checkpoint's global batch, so its batch per worker follows from it.
            protocol = Checkpointing(cfg, self.topology, self.job_config) if cfg.checkpoint_dir else None
            with self.faults.checkpoint_io():
                resumed = protocol.start(broadcast=not self.elastic_launch) if protocol else None
            batch_size = protocol.batch_per_worker(resumed, self.elastic_launch) if protocol else cfg.batch_size
            if self.topology.mesh is not None and batch_size % cfg.micro_batches:
                raise ValueError(f"each worker's batch of {batch_size} (from the checkpoint's global batch) cannot be "
                                 f"cut into train.micro_batches={cfg.micro_batches}: choose a divisor of {batch_size}")
            self.batching = Batching(cfg, self.topology.data_world, batch_size, train_dataset, val_dataset,
                                     collate_fn)

            # 4. The strategy wraps the optimizer: for ddp, Horovod's hooks start each gradient's
            #    all-reduce as soon as backward produces it (overlap, tensor fusion).
            with oom.explained(lambda error: self._explain_out_of_memory(error, "set-up (sharding the model and "
                                                                                "optimizer)", optimizer, held={})):
                self.strategy = build_strategy(cfg, self.model, optimizer, world, mesh=self.topology.mesh,
                                               plan=model_plan, loss_fn=loss_fn, deferred=deferred)
            if cfg.compile:  # the forward only, in place: hooks, state_dict keys, checkpoints unchanged
                compile_forward(self.model, world.device)
            # 1. Rank 0's parameters and optimizer state, everywhere, before the first step. Before the
            #    rates are scaled: a sharded strategy's broadcast loads the user's optimizer state, and
            #    with it the groups' unscaled rates.
            if not self.elastic_launch:
                self.strategy.broadcast_from_root()
            self.position = Position()
            self.lr = LearningRate(cfg, self.strategy.optimizer, lr_scheduler)
            self.restart_schedule()

            self.topology.follow(lambda topology: self.strategy.follow_world(topology.world))
            self.reporter = Reporter(cfg, self.topology, self.job_config, self.strategy, self.elastic_launch)
            recomputed = (f"; activation checkpointing: {len(self.recomputed_blocks)} blocks ({cfg.activation_checkpointing})"
                          if self.recomputed_blocks else "")
            self.reporter.announce(f"{self.batching.describe()}; {self.lr.describe()}; strategy {cfg.strategy}; "
                                   f"reduction {cfg.reduction}{recomputed}{_initialized(deferred)}"
                                   f"{'; ' + self.strategy.plan_note if getattr(self.strategy, 'plan_note', '') else ''}")
            self.checkpoints = CheckpointManager(cfg, self.topology, protocol, self.strategy, self.position, self.lr,
                                                 self.precision, self.batching, self.job_config, self.callbacks)
            # Under elastic, a sharded strategy's first sync loads the checkpoint (every rank reads its part).
            if resumed is not None and not (self.elastic_launch and self.strategy.elastic_from_checkpoint):
                with self.faults.checkpoint_io():
                    self.checkpoints.load(resumed)
            self.reporter.open_timeline(self.position.step)
            self.loop = TrainingLoop(cfg, self.topology, self.model, self.strategy, self.step_fn, self.precision,
                                     self.batching, self.lr, self.position, self.reporter,
                                     self.checkpoints if protocol is not None else None, self.faults,
                                     self.callbacks)

    def _refuse_what_cannot_run(self, world: World, step_fn: Optional[StepFn],
                                lr_scheduler: Optional[SchedulerFactory]) -> None:
        """What this launch cannot do, refused on every rank alike before any collective, instead of
        failing or hanging in the first step."""
        cfg = self.config
        if cfg.hierarchical_allreduce and not world.hierarchical_allreduce:
            raise ValueError(startup.hierarchical_conflict())
        if step_fn is not None and cfg.pipeline_parallel > 1:
            raise ValueError("train.pipeline_parallel > 1 computes the loss on the last stage with loss_fn(outputs, "
                             "targets) and cannot run a step_fn, which needs the whole model: pass loss_fn "
                             "(and (inputs, targets) batches), or use tensor_parallel instead of a pipeline")
        if cfg.checkpoint_async and self.elastic_launch:
            raise ValueError("train.checkpoint_async is not supported under Horovod elastic (a world change while a "
                             "write is in flight is not handled): launch without --min-np/--max-np, or "
                             "set train.checkpoint_async=false")
        if lr_scheduler is not None and (cfg.warmup_epochs or cfg.lr_schedule != "constant"):
            raise ValueError(f"lr_scheduler replaces hvdtrain's own schedule: set train.warmup_epochs=0 and "
                             f"train.lr_schedule=constant (got {cfg.warmup_epochs:g} and {cfg.lr_schedule}), and "
                             f"put a warm-up into your scheduler if you want one")
        if lr_scheduler is not None and self.elastic_launch:
            raise ValueError("lr_scheduler is not supported under Horovod elastic: the global batch and the scaled "
                             "rates change with the world, and your scheduler was built for one; use train.lr_schedule, "
                             "or launch without --min-np/--max-np")
        refusal = launch_refusal(cfg, world, self.elastic_launch)
        if refusal:
            raise ValueError(refusal)

    # --- what the parts hold, as attributes of the Trainer ----------------------------------------

    @property
    def world(self) -> World:
        """This process's place in the job now (under Horovod elastic it changes with the world)."""
        return self.topology.world

    @property
    def mesh(self):
        return self.topology.mesh

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The optimizer the strategy steps (its param_groups carry the live learning rate)."""
        return self.strategy.optimizer

    @property
    def step(self) -> int:
        return self.position.step

    @property
    def grad_norm(self) -> float:
        """The global gradient norm before clipping, at the last step (train.max_grad_norm)."""
        return self.loop.grad_norm

    @property
    def memory(self):
        """Every rank's bytes after the first step (hvdtrain.observability.memory)."""
        return self.reporter.memory

    @property
    def sampler(self) -> ShardedSampler:
        return self.batching.sampler

    @property
    def steps_per_epoch(self) -> int:
        return self.batching.steps_per_epoch

    @property
    def warmup_steps(self) -> int:
        return self.batching.warmup_steps

    @property
    def lr_scale(self) -> float:
        return self.lr.scale

    # --- what elastic calls -----------------------------------------------------------------------

    def restart_schedule(self) -> None:
        """The LR scaled to the current global batch, warmed up, continuing at the current step."""
        self.lr.start(self.batching.global_batch_size, self.batching.warmup_steps, self.topology.data_world,
                      self.position.step, self.batching.total_steps)

    def follow_world(self) -> None:
        """Horovod elastic formed a new world: the topology follows it (and with it every part that
        reads it), and so do the shards, the global batch and the LR (under elastic the global batch
        follows the world, so the batch per worker is the configured one)."""
        previous = self.topology.reform()
        self.batching.rebuild(self.topology.data_world, self.config.batch_size)
        self.restart_schedule()
        where = ("from the newest checkpoint" if self.strategy.elastic_from_checkpoint
                 else f"at step {self.position.step}")
        self.topology.log.info(f"world changed from {previous} to {self.world.size} workers: global batch "
                               f"{self.batching.global_batch_size}, lr x {self.lr.scale:g}; continuing {where}")

    def continue_from_newest_checkpoint(self) -> None:
        """Under elastic, a sharded strategy's sync (every rank of the new world): the newest
        checkpoint, resharded for this world; at a fresh start, rank 0's state everywhere and a
        step-0 checkpoint, so that a worker lost before the first save has one to come back to."""
        with self.faults.checkpoint_io():
            newest = self.checkpoints.protocol.read_newest()
            if newest is not None:
                self.checkpoints.load(newest)
        if newest is None:
            self.strategy.broadcast_from_root()
            self.loop.save_checkpoint()

    def _elastic_state(self):
        """What Horovod elastic commits, rolls back to and syncs (hvdtrain.fault_tolerance.elastic)."""
        on_sync = [self.restart_schedule, self.reporter.agree_run_directory]
        if self.strategy.elastic_from_checkpoint:
            self.loop.commit_with_checkpoints = True
            return elastic.CheckpointedElasticState(self.continue_from_newest_checkpoint, on_reset=self.follow_world,
                                                    on_sync=on_sync)
        return elastic.ElasticState(self.model, self.optimizer, self.position, self.precision,
                                    on_reset=self.follow_world, on_sync=on_sync)

    # --- the public calls -------------------------------------------------------------------------

    def request_stop(self, reason: str) -> None:
        """End training at the next point where the ranks agree (after an evaluation, at an epoch's
        end, every preempt_check_every steps), with a checkpoint of that step; for callbacks."""
        self.callbacks.request_stop(reason)

    def state_dict(self) -> Dict[str, Any]:
        """Everything needed to continue exactly, in the full checkpoint format (every rank calls it)."""
        return self.checkpoints.state_dict()

    def fit(self, until_step: Optional[int] = None) -> List[Dict[str, float]]:
        """Train to the configured epochs, or max_steps; ``until_step`` replaces max_steps (fit again
        with a later one to go on). Returns one metrics dict per epoch, the same on every rank (all
        reduced across ranks)."""
        history: List[Dict[str, float]] = []
        cfg, loop = self.config, self.loop
        total = self.batching.steps_for(cfg.max_steps if until_step is None else until_step)
        self.reporter.start(total, self.position.step)
        self.faults.start_watchdog(self.strategy.pending_communication)
        loop.stopped, self.callbacks.stop_reason = False, None  # a stop ends one fit(); another goes on
        self.callbacks.call("on_train_start")
        explain = lambda error: self._explain_out_of_memory(error, loop.phase, self.optimizer,
                                                            self.strategy.memory_bytes())
        try:
            with oom.explained(explain):
                if self.elastic_launch:
                    state = self._elastic_state()
                    loop.commit = state.commit
                    elastic.run(state, lambda: loop.run(history, until_step))
                else:
                    loop.run(history, until_step)
        finally:
            self.reporter.finish(self.position.step)
            self.faults.stop_watchdog()
        self.callbacks.call("on_train_end", history)
        return history

    def _explain_out_of_memory(self, error: BaseException, phase: str, optimizer: torch.optim.Optimizer,
                               held: Dict[str, int]) -> str:
        world = self.topology.world
        message = oom.explain(error, rank=world.rank, host=world.hostname, phase=phase,
                              strategy=self.config.strategy, workers=world.size, model=self.model,
                              optimizer=optimizer, held=held, device=world.device)
        self.topology.log.error(message)  # every rank's own log says it, not only the rank that prints
        return message

    def run(self) -> Optional[Dict[str, float]]:
        """fit(), then close the run directory; the final metrics (the same on every rank).

        None when the run was preempted: it is checkpointed (and requeued under SLURM), and the
        next start resumes. A run resumed from its own last checkpoint has nothing left to train:
        its model is evaluated instead. The trained model is written to the run directory
        (model.safetensors; a Hugging Face model also as hf/), a tensor at a time: under fsdp one
        unit is gathered at a time and the model stays sharded (``strategy.exported_model_state()``
        makes it whole on every rank, when you want it so).
        """
        run_dir = self.reporter.path
        try:
            history = self.fit()
        finally:
            self.close()
        if self.loop.preempted:
            if self.world.is_root:
                print(f"preempted at step {self.position.step}; run again to resume", flush=True)
            return None
        final = history[-1] if history else self.evaluate()
        if run_dir is not None:
            if hf_export.is_hf_model(self.model):
                self.export_hf(run_dir / "hf")
            self._export_model(run_dir)
        return final

    def _export_model(self, directory) -> None:
        """model.safetensors under every state_dict name, from the strategy's tensors one at a time
        (a collective); rank 0 writes; a failure is raised on every rank."""
        aliases = {names[0]: names for names, _ in tensor_names(self.model)}
        failure = export_model_streamed(self.strategy.full_tensors(), aliases, directory, writes=self.world.is_root,
                                        metadata={"step": self.position.step, "strategy": self.config.strategy})
        failure = collectives.broadcast_object(failure, root_rank=0, name="export.model")
        if failure:
            raise CheckpointError(failure)
        self.topology.log.info(f"trained model written to {directory}/model.safetensors (safetensors, with "
                               f"config.yaml beside it)")

    def evaluate(self) -> Dict[str, float]:
        """The step's loss and metrics over the whole validation set (every rank's shard), as
        val_loss, val_<metric>."""
        return self.loop.evaluate()

    def load_pretrained(self, directory) -> int:
        """Start from a local Hugging Face model directory's weights (config.json + safetensors, as
        save_pretrained writes it), each rank reading only what it keeps (under zero1, zero2, fsdp
        its slices: hvdtrain.checkpoint.pretrained). Every rank calls it, before fit(); a directory
        that does not fit the model is refused on every rank. Returns the bytes this rank read."""
        if self.position.step:
            raise ValueError(f"load_pretrained starts a run from pretrained weights, but this one is at step "
                             f"{self.position.step} (resumed from a checkpoint, or trained): its weights are newer")
        def read() -> Tuple[pretrained.SafetensorsReader, Dict[str, Any]]:
            reader = pretrained.SafetensorsReader(directory)
            return reader, pretrained.own_part(self.strategy, reader)
        outcome = attempt(read)
        problems = problems_on_any_rank(outcome if isinstance(outcome, str) else None, "pretrained")
        if problems:
            raise CheckpointError(f"the pretrained weights in {directory} cannot be loaded: {'; '.join(problems)}")
        reader, part = outcome
        pretrained.apply(self.strategy, part)
        self.topology.log.info(f"started from the pretrained weights in {directory} (this rank read "
                               f"{reader.bytes_read / 2**20:.1f} MiB)")
        return reader.bytes_read

    def export_hf(self, directory, max_shard_bytes: int = hf_export.DEFAULT_MAX_SHARD_BYTES) -> None:
        """A Hugging Face model, as it is now, as a directory ``from_pretrained`` loads (config.json,
        safetensors; numbered files and an index past ``max_shard_bytes``). Every rank calls it (fsdp
        gathers one unit at a time; no rank holds the whole model); rank 0 writes; a failure is raised
        on every rank. ``run()`` does it at the end, into the run directory's ``hf/``."""
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
        checkpoint directory go (another run may own it; a later fit() claims it again)."""
        self.reporter.close()
        if self.checkpoints.protocol is not None:
            self.checkpoints.protocol.close()

    def close_mesh(self) -> None:
        """Remove the model-parallel mesh's Horovod process sets (a collective: every rank calls it).
        A process that goes on after training (a sweep of Trainers, a test suite) closes them; the
        Trainer cannot step, gather or checkpoint afterwards."""
        self.topology.close()


def evaluate_model(model: torch.nn.Module, dataset: Dataset, world: Optional[World] = None, batch_size: int = 32,
                   loss_fn: LossFn = F.cross_entropy, step_fn: Optional[StepFn] = None,
                   collate_fn: Optional[Callable[[List[Any]], Any]] = None, precision: str = "fp32") -> Dict[str, float]:
    """Evaluation alone, no optimizer: a whole ``model`` (the same on every rank: one loaded from an
    export, say) over ``dataset`` cut into one shard per rank, in order, each sample once; returns
    val_loss, val_<metric> and val_samples, means over every sample, the same on every rank (a
    collective). ``step_fn(model, batch) -> (loss, metrics)`` for batches of any structure."""
    if precision not in PRECISIONS:
        raise ValueError(f"evaluate_model(precision=...) must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    world = world or startup.init()
    model = model.to(world.device)
    loader = sharded_loader(dataset, batch_size, world.rank, world.size, seed=0, collate_fn=collate_fn)
    return evaluate(model, loader, step_fn or supervised_step(loss_fn), world.device,
                    Precision(precision, world.device).autocast)


def _initialized(deferred: Optional[DeferredInit]) -> str:
    """How a model built on the meta device got its values, for the start line."""
    if deferred is None:
        return ""
    return f"; built on the meta device, initialized {deferred.granularity} (at most {deferred.peak_bytes / 2**20:.1f} MiB of it at once)"
