"""A training session: the model, optimizer and data set up over the ranks, for your own loop and
for the Trainer, which is one loop written on it (one code path, not two).

    topology     who this rank is: the world and the model-parallel mesh     hvdtrain.parallel.topology
    strategy     how the model's state is spread over the ranks              hvdtrain.strategies
    batching/lr  this rank's loaders, the global batch, the scaled LR        hvdtrain.data, hvdtrain.components
    checkpoints  what a checkpoint holds, saving and resuming                hvdtrain.checkpoint
    reporter     start lines, progress, the run directory, memory, timeline  hvdtrain.observability
    faults       preemption and the stall watchdog (elastic: the Trainer)    hvdtrain.fault_tolerance
    loop         epochs, batches and steps over those parts                  hvdtrain.loop

Your own loop, Horovod-style (``hvdtrain.setup`` builds the session)::

    hv = hvdtrain.setup(model, optimizer, train_set, config)
    for epoch in hv.epochs():             # from where a resumed run stopped
        for inputs, targets in hv.batches():   # this rank's shard, on its device
            loss = F.cross_entropy(hv.model(inputs), targets)
            hv.backward(loss)
            hv.step()                     # synchronize, clip, step, zero, LR, checkpoints, logs
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch.optim.lr_scheduler import LRScheduler
from torch.utils.data import DataLoader, Dataset

from hvdtrain.checkpoint.manager import CheckpointManager
from hvdtrain.checkpoint.coordination import Checkpointing, attempt, problems_on_any_rank
from hvdtrain.checkpoint import CheckpointError
from hvdtrain.weights import hf_export
from hvdtrain.weights import pretrained
from hvdtrain.config.train import TrainConfig
from hvdtrain.data.batching import Batching
from hvdtrain.data.sharding import LoaderFactory, ShardedSampler
from hvdtrain.distributed import collectives
from hvdtrain.distributed import rng
from hvdtrain.distributed import startup
from hvdtrain.distributed.environments import is_elastic_launch
from hvdtrain.distributed.world import World
from hvdtrain.fault_tolerance import out_of_memory as oom
from hvdtrain.fault_tolerance.handling import FaultHandling
from hvdtrain.loop import TrainingLoop
from hvdtrain.observability.reporting import Reporter
from hvdtrain.parallel.model_plan import ModelPlan
from hvdtrain.parallel.topology import Topology
from hvdtrain.strategies import build_strategy, launch_refusal
from hvdtrain.strategies.deferred_init import DeferredInit, InitFn
from hvdtrain.components.activation_checkpointing import checkpoint_activations
from hvdtrain.components.callbacks import Callback, Callbacks
from hvdtrain.components.compiling import compile_forward
from hvdtrain.components.lr import LearningRate, SchedulerFactory
from hvdtrain.components.position import Position
from hvdtrain.components.precision import Precision
from hvdtrain.components.steps import StepFn, supervised_step
from hvdtrain.components.sync_batchnorm import convert_sync_batchnorm

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class Session:
    """``model`` and ``optimizer`` set up to train on ``train_dataset``, data-parallel over all ranks:
    for your own loop (``hvdtrain.setup``: epochs, batches, backward, step) and the Trainer's.

    Build the model and optimizer as for one process, with the learning rate of one worker: the
    session hands both to the strategy (``config.strategy``), scales the rate and broadcasts rank 0's
    state. ``loss_fn(outputs, targets)`` returns the batch's mean loss; or ``step_fn(model, batch) ->
    (loss, metrics)`` computes both from a batch of any structure (hvdtrain.components.steps), every
    metric reported as a mean over every rank's samples. ``job_config``: the script's whole resolved
    configuration, recorded in the run directory and every checkpoint (default: the ``train`` section).
    ``model_plan``: how one replica is split under tensor or pipeline parallelism. ``collate_fn``:
    how the loaders make a batch of samples, for training and evaluation (as DataLoader's, e.g. a
    Hugging Face DataCollatorWithPadding: each batch padded only to its own longest sample).
    ``callbacks``: hvdtrain.Callback instances called at the loop's usual points, on every rank
    (hvdtrain.components.callbacks; EarlyStopping is one). ``lr_scheduler(optimizer) -> scheduler``:
    your own LR schedule, built over the optimizer the strategy steps once its rates are scaled to
    the global batch, stepped after every optimizer step and kept in checkpoints; it replaces
    train.warmup_epochs, train.warmup_steps and train.lr_schedule (set them to 0, null and constant).
    ``loader_factory(dataset, sampler, batch_size) -> DataLoader``: your own loaders (any DataLoader
    argument: workers, persistent_workers, worker_init_fn, collate_fn...) over hvdtrain's sampler and
    batch size, for training and evaluation; a loader that does not read through them is refused.

    A model built under ``torch.device("meta")`` (and its optimizer over it) takes no memory until
    the session gives it values from ``train.seed``: the modules' own initialization, then Hugging
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
        loader_factory: Optional[LoaderFactory] = None,
    ) -> None:
        self.config = cfg = config or TrainConfig()
        self.job_config = dict(job_config) if job_config is not None else {"train": cfg.to_dict()}
        world = world or startup.init(seed=cfg.seed, timeline=cfg.timeline_steps > 0,
                                      hierarchical_allreduce=cfg.hierarchical_allreduce,
                                      dynamic_process_sets=cfg.model_parallel)
        # Under Horovod elastic, set-up runs no collective: a worker that joins later runs this while
        # the others wait in the elastic sync, and mismatched collectives deadlock. The elastic sync
        # broadcasts rank 0's state (and its checkpoint, if it read one) instead.
        self.elastic_launch = is_elastic_launch()
        self.callbacks = Callbacks(self, callbacks)
        self._refuse_what_cannot_run(world, step_fn, lr_scheduler)
        self.kept: Dict[str, Any] = {}  # keep(): your own state, in every checkpoint
        self.given_optimizer = optimizer  # as the user built it; the strategy may step another (keep() checks)
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
                                     collate_fn, loader_factory)

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
                                                 self.precision, self.batching, self.job_config, self.callbacks,
                                                 self.kept)
            # Under elastic, a sharded strategy's first sync loads the checkpoint (every rank reads its part).
            if resumed is not None and not (self.elastic_launch and self.strategy.capabilities.elastic_from_checkpoint):
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
        if cfg.checkpoint_async and self.elastic_launch:
            raise ValueError("train.checkpoint_async is not supported under Horovod elastic (a world change while a "
                             "write is in flight is not handled): launch without --min-np/--max-np, or "
                             "set train.checkpoint_async=false")
        warmup = cfg.warmup_steps if cfg.warmup_steps is not None else cfg.warmup_epochs  # steps replace epochs
        if lr_scheduler is not None and (warmup or cfg.lr_schedule != "constant"):
            raise ValueError(f"lr_scheduler replaces hvdtrain's own schedule: set train.warmup_epochs=0, "
                             f"train.warmup_steps=null (or 0) and train.lr_schedule=constant (got "
                             f"{cfg.warmup_epochs:g}, {cfg.warmup_steps} and {cfg.lr_schedule}), and put a warm-up "
                             f"into your scheduler if you want one")
        if lr_scheduler is not None and self.elastic_launch:
            raise ValueError("lr_scheduler is not supported under Horovod elastic: the global batch and the scaled "
                             "rates change with the world, and your scheduler was built for one; use train.lr_schedule, "
                             "or launch without --min-np/--max-np")
        refusal = launch_refusal(cfg, world, self.elastic_launch)
        if refusal:
            raise ValueError(refusal)

    # --- what the parts hold, as attributes of the session ----------------------------------------

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
    def global_step(self) -> int:
        """Optimizer steps taken since the run's start (a resumed run counts on)."""
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

    def restart_schedule(self) -> None:
        """The LR scaled to the current global batch, warmed up, continuing at the current step."""
        self.lr.start(self.batching.global_batch_size, self.batching.warmup_steps, self.topology.data_world,
                      self.position.step, self.batching.total_steps)

    # --- your own loop ----------------------------------------------------------------------------

    @property
    def device(self) -> torch.device:
        """This rank's device: batches() are moved to it, and the model lives there."""
        return self.world.device

    def epochs(self, until_step: Optional[int] = None) -> Iterator[int]:
        """The epochs to train, from where a resumed run stopped, up to train.epochs (or max_steps, or
        ``until_step``). At each epoch's end: its record (``history``, metrics.jsonl), the evaluation of
        the validation set if one was given, the epoch's checkpoint and the callbacks. Iterate over
        batches() inside; end early only through request_stop() or a step limit, on every rank."""
        self._begin_training(until_step)
        try:
            yield from self.loop.epochs(until_step)
        finally:
            self._end_training()
        self.callbacks.call("on_train_end", self.history)

    @property
    def history(self) -> List[Dict[str, float]]:
        """The records of the epochs trained by the last epochs() (or fit()), one per epoch."""
        return self.loop.history

    def batches(self) -> Iterator[Any]:
        """This rank's batches of the current epoch, on its device: its shard of the epoch's order
        (the same order at any worker count), from where a resumed epoch stopped. Run forward and
        backward() on each, then step()."""
        if self.loop.epoch_done:
            raise RuntimeError("batches() belongs inside an epoch: iterate over them in `for epoch in hv.epochs():`")
        return self.loop.batches()

    @property
    def preempted(self) -> bool:
        """The epochs ended for a preemption signal (train.preempt_signal): the step is checkpointed and,
        under SLURM, the job requeued; your script should end (the next start resumes)."""
        return self.loop.preempted

    def autocast(self) -> contextlib.AbstractContextManager:
        """The forward's mixed precision (train.precision): ``with hv.autocast(): loss = ...``."""
        return self.precision.autocast()

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of the micro-batch's mean loss (scaled for fp16, divided over train.accumulation);
        the strategy's hooks start the gradients' reduction as backward produces them. The loss
        also goes into the reported means."""
        self.loop.record(loss.detach(), {})
        scaled = self.precision.scale_loss(loss)
        accumulation = self.config.accumulation
        self.strategy.backward(scaled / accumulation if accumulation > 1 else scaled)

    def step(self) -> bool:
        """After each backward(): at the last micro-batch of train.accumulation, the same update on
        every rank (gradients synchronized, fp16 unscaled and checked, clipped to train.max_grad_norm,
        stepped and zeroed, the LR schedule advanced), then what follows a step: train.checkpoint_every,
        train.eval_every, the logs and the preemption and stop votes. Returns whether it stepped."""
        return self.loop.step()

    def keep(self, **objects: Any) -> None:
        """Your own state, saved in every checkpoint this session writes and given back on resume:
        each object has state_dict()/load_state_dict() (your LR scheduler, a metric) or is a dict
        (your counters: updated in place). The same on every rank: rank 0's is saved. Keep them
        right after set-up: a run that resumed loads their saved state now. A scheduler you step
        yourself is built over ``hv.optimizer``, with train.warmup_epochs=0, train.warmup_steps
        null and train.lr_schedule=constant (else hvdtrain's schedule sets the rates after each
        step): otherwise it is refused, as it would change nothing."""
        for name, value in objects.items():
            if not (isinstance(value, dict) or (hasattr(value, "state_dict") and hasattr(value, "load_state_dict"))):
                raise TypeError(f"keep({name}=...): give an object with state_dict() and load_state_dict(), or a "
                                f"dict; got {type(value).__name__}")
            if isinstance(value, LRScheduler):
                self._check_kept_scheduler(name, value)
            self.kept[name] = value
            self.checkpoints.restore_kept(name)

    def _check_kept_scheduler(self, name: str, scheduler: LRScheduler) -> None:
        """A scheduler you step yourself must set the rates of the optimizer the strategy steps, and
        be the only one that does: either mistake would leave your schedule silently unused."""
        stepped = {id(group) for group in self.optimizer.param_groups}
        drives = any(id(group) in stepped for group in scheduler.optimizer.param_groups)
        if not drives and scheduler.optimizer is self.given_optimizer:
            raise ValueError(f"keep({name}=...): this scheduler sets the rates of the optimizer you built, which is "
                             f"not the one the session steps (train.strategy={self.config.strategy} steps one of "
                             f"its own, hv.optimizer): build the scheduler over hv.optimizer")
        if drives and not self.lr.rate_fixed and scheduler is not self.lr.scheduler:
            ours = ("your lr_scheduler" if self.lr.factory is not None else
                    f"a warm-up of {self.lr.warmup_steps} steps and train.lr_schedule={self.config.lr_schedule}")
            raise ValueError(f"keep({name}=...): hvdtrain's own schedule ({ours}) sets this optimizer's rates after "
                             f"every step, over what your {type(scheduler).__name__} sets. To step it yourself, set "
                             f"train.warmup_epochs=0, train.warmup_steps=null and train.lr_schedule=constant "
                             f"(hvdtrain then scales the rates once and leaves them to you); or give it to setup as "
                             f"lr_scheduler=lambda optimizer: ..., which hvdtrain steps and keeps")

    def save(self) -> None:
        """A checkpoint of this step into train.checkpoint_dir, now (every rank calls it)."""
        if self.checkpoints.protocol is None:
            raise ValueError("save() writes into train.checkpoint_dir, and none is set: set it (the runs of one "
                             "job share it; a rerun resumes from the newest checkpoint there)")
        self.loop.save_checkpoint()

    def loader(self, dataset: Dataset, batch_size: Optional[int] = None,
               collate_fn: Optional[Callable[[List[Any]], Any]] = None) -> DataLoader:
        """Another data set (a test set), cut into one shard per data-parallel rank, in order, each
        sample once; batches of train.eval_batch_size (else the training batch) unless given, made by
        the session's collate_fn (or loader_factory) unless another collate_fn is given."""
        return self.batching.evaluation_loader(dataset, batch_size, collate_fn)

    def _begin_training(self, until_step: Optional[int]) -> None:
        """What every fit() and every epochs() starts with."""
        total = self.batching.steps_for(self.config.max_steps if until_step is None else until_step)
        self.reporter.start(total, self.position.step)
        self.faults.start_watchdog(self.strategy.pending_communication)
        self.loop.begin()
        self.callbacks.call("on_train_start")

    def _end_training(self) -> None:
        self.reporter.finish(self.position.step)
        self.faults.stop_watchdog()
        self.batching.release_workers()

    # --- the public calls -------------------------------------------------------------------------

    def request_stop(self, reason: str) -> None:
        """End training at the next point where the ranks agree (after an evaluation, at an epoch's
        end, every preempt_check_every steps), with a checkpoint of that step; for callbacks."""
        self.callbacks.request_stop(reason)

    def state_dict(self) -> Dict[str, Any]:
        """Everything needed to continue exactly, in the full checkpoint format (every rank calls it)."""
        return self.checkpoints.state_dict()

    def _explain_out_of_memory(self, error: BaseException, phase: str, optimizer: torch.optim.Optimizer,
                               held: Dict[str, int]) -> str:
        world = self.topology.world
        message = oom.explain(error, rank=world.rank, host=world.hostname, phase=phase,
                              strategy=self.config.strategy, workers=world.size, model=self.model,
                              optimizer=optimizer, held=held, device=world.device)
        self.topology.log.error(message)  # every rank's own log says it, not only the rank that prints
        return message

    def evaluate(self) -> Dict[str, float]:
        """The step's loss and metrics over the whole validation set (every rank's shard), as
        val_loss, val_<metric>."""
        return self.loop.evaluate()

    def load_pretrained(self, directory) -> int:
        """Start from a local Hugging Face model directory's weights (config.json + safetensors, as
        save_pretrained writes it), each rank reading only what it keeps (under zero1, zero2, fsdp
        its slices: hvdtrain.weights.pretrained). Every rank calls it, before fit(); a directory
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



def _initialized(deferred: Optional[DeferredInit]) -> str:
    """How a model built on the meta device got its values, for the start line."""
    if deferred is None:
        return ""
    return f"; built on the meta device, initialized {deferred.granularity} (at most {deferred.peak_bytes / 2**20:.1f} MiB of it at once)"



def setup(model: torch.nn.Module, optimizer: torch.optim.Optimizer, train_dataset: Dataset,
          config: Optional[TrainConfig] = None, **options: Any) -> Session:
    """A Session for your own loop: ``model`` and ``optimizer`` (one worker's, as for one process)
    handed to ``config.strategy``, rank 0's state broadcast, the rates scaled to the global batch,
    ``train_dataset`` sharded over the ranks, and the newest checkpoint in train.checkpoint_dir
    resumed. ``options``: the Session's (val_dataset, world, job_config, collate_fn, callbacks,
    lr_scheduler, model_plan, init_fn, loss_fn or step_fn for evaluate()). Every rank calls it.

    What needs hvdtrain's own loop is refused here, before any collective: pipeline parallelism
    (its schedule runs forward and backward together: use the Trainer) and Horovod elastic (a world
    change restarts the loop from a commit: use the Trainer)."""
    config = config or TrainConfig()
    if config.pipeline_parallel > 1:
        raise ValueError("train.pipeline_parallel > 1 runs forward and backward together in the pipeline's schedule, "
                         "which your own loop cannot interleave: use hvdtrain.Trainer (loss_fn, or dict batches with "
                         "labels for a Hugging Face model), or tensor_parallel in your own loop")
    if is_elastic_launch():
        raise ValueError("your own loop under Horovod elastic (--min-np/--max-np) is not supported: a world change "
                         "rolls the loop back to a commit, which hvdtrain.Trainer does; launch with a fixed -np")
    return Session(model, optimizer, train_dataset, config=config, **options)
