"""The Trainer: hvdtrain's own loop, the same for every strategy, over the parts of a run
(hvdtrain.parts, which the Session holds too): fit() trains through the strategy's forward and
backward (a pipeline's schedule included), under Horovod elastic too; run() then writes the trained
model. The set-up, the steps, the checkpoints and the reports are the parts': your own loop on a
Session runs the same code.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence

import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

from hvdtrain.checkpoint import CheckpointError
from hvdtrain.weights import hf_export
from hvdtrain.weights.export import export_model_streamed
from hvdtrain.components.callbacks import Callback
from hvdtrain.components.evaluation import evaluate
from hvdtrain.components.lr import SchedulerFactory
from hvdtrain.components.precision import Precision
from hvdtrain.components.steps import StepFn, supervised_step
from hvdtrain.config.train import PRECISIONS, TrainConfig
from hvdtrain.data.sharding import LoaderFactory, sharded_loader
from hvdtrain.distributed import collectives
from hvdtrain.distributed import startup
from hvdtrain.distributed.world import World
from hvdtrain.fault_tolerance import elastic
from hvdtrain.parallel.model_plan import ModelPlan
from hvdtrain.parts import LossFn, Parts, build_parts
from hvdtrain.strategies.base import Strategy, tensor_names
from hvdtrain.strategies.deferred_init import InitFn


class Trainer:
    """Trains ``model`` with ``optimizer`` on ``train_dataset``, data-parallel over all ranks: fit()
    and run(). Its arguments are the Session's (hvdtrain.session.Session); the parts it is made of
    (strategy, batching, checkpoints...) are ``parts`` (hvdtrain.parts)."""

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
        """The parts of the run, built on every rank (hvdtrain.parts.build_parts); callbacks are given this trainer.

        Args:
            model: built as for one process (on the meta device too).
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
            callbacks: hvdtrain.Callback instances.
            lr_scheduler: ``lr_scheduler(optimizer) -> scheduler``, replacing hvdtrain's schedule.
            init_fn: ``init_fn(module)``, the values of a model built on the meta device.
            loader_factory: ``loader_factory(dataset, sampler, batch_size) -> DataLoader``.
        """
        self.parts: Parts = build_parts(model, optimizer, train_dataset, val_dataset, config, loss_fn, world,
                                        job_config, step_fn, model_plan, collate_fn, callbacks, lr_scheduler,
                                        init_fn, loader_factory, owner=self)

    # --- what users and callbacks read ------------------------------------------------------------

    @property
    def model(self) -> torch.nn.Module:
        """The model on this rank's device, as the strategy trains it."""
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
        """The records of the epochs trained by the last fit(), one per epoch."""
        return self.parts.loop.history

    @property
    def preempted(self) -> bool:
        """The last fit() ended for a preemption signal (train.preempt_signal), checkpointed."""
        return self.parts.loop.preempted

    # --- the public calls -------------------------------------------------------------------------

    def fit(self, until_step: Optional[int] = None) -> List[Dict[str, float]]:
        """Train to the configured epochs, or max_steps; ``until_step`` replaces max_steps (fit again
        with a later one to go on). Returns one metrics dict per epoch, the same on every rank (all
        reduced across ranks)."""
        parts = self.parts
        parts.begin_training(until_step)
        try:
            with parts.out_of_memory_explained():
                if parts.elastic_launch:
                    self._run_elastic(until_step)
                else:
                    parts.loop.run(until_step)
        finally:
            parts.end_training()
        history = list(parts.loop.history)
        parts.callbacks.call("on_train_end", history)
        return history

    def run(self) -> Optional[Dict[str, float]]:
        """fit(), then close the run directory; the final metrics (the same on every rank).

        None when the run was preempted: it is checkpointed (and requeued under SLURM), and the
        next start resumes. A run resumed from its own last checkpoint has nothing left to train:
        its model is evaluated instead. The trained model is written to the run directory
        (model.safetensors; a Hugging Face model also as hf/), a tensor at a time: under fsdp one
        unit is gathered at a time and the model stays sharded (``strategy.exported_model_state()``
        makes it whole on every rank, when you want it so).
        """
        parts = self.parts
        run_dir = parts.reporter.path
        try:
            history = self.fit()
        finally:
            self.close()
        if parts.loop.preempted:
            if self.world.is_root:
                print(f"preempted at step {parts.position.step}; run again to resume", flush=True)
            return None
        final = history[-1] if history else self.evaluate()
        if run_dir is not None:
            if hf_export.is_hf_model(self.model):
                self.export_hf(run_dir / "hf")
            self._export_model(run_dir)
        return final

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
        keeps; every rank calls it, before fit(). Returns the bytes this rank read
        (hvdtrain.parts.Parts.load_pretrained)."""
        return self.parts.load_pretrained(directory)

    def export_hf(self, directory, max_shard_bytes: int = hf_export.DEFAULT_MAX_SHARD_BYTES) -> None:
        """A Hugging Face model, as it is now, as a directory ``from_pretrained`` loads; every rank
        calls it, rank 0 writes (hvdtrain.parts.Parts.export_hf). ``run()`` does it at the end, into
        the run directory's ``hf/``."""
        self.parts.export_hf(directory, max_shard_bytes)

    def close(self) -> None:
        """Close the run directory's files and let the checkpoint directory go (a later fit() claims
        it again)."""
        self.parts.close()

    def close_mesh(self) -> None:
        """Remove the model-parallel mesh's Horovod process sets (a collective: every rank calls it).
        A process that goes on after training (a sweep of Trainers, a test suite) closes them; the
        Trainer cannot step, gather or checkpoint afterwards."""
        self.parts.close_mesh()

    # --- Horovod elastic --------------------------------------------------------------------------

    def _run_elastic(self, until_step: Optional[int]) -> None:
        """The loop under Horovod elastic: committed every train.elastic_commit_every steps, rolled
        back to the last commit and resynchronized when the world changes."""
        parts = self.parts
        state = self._elastic_state()
        commits = elastic.Commits(state.commit, parts.config.elastic_commit_every,
                                  with_checkpoints=parts.strategy.capabilities.elastic_from_checkpoint)
        elastic.run(state, lambda: parts.loop.run(until_step, commits))

    def _elastic_state(self):
        """What Horovod elastic commits, rolls back to and syncs (hvdtrain.fault_tolerance.elastic)."""
        parts = self.parts
        # Each rank's memory of its own last save differs after a world change: forgotten at every sync.
        on_sync = [parts.checkpoints.forget_saved_step, parts.restart_schedule, parts.reporter.agree_run_directory]
        if parts.strategy.capabilities.elastic_from_checkpoint:
            return elastic.CheckpointedElasticState(self._continue_from_newest_checkpoint,
                                                    on_reset=self._follow_world, on_sync=on_sync)
        return elastic.ElasticState(parts.model, parts.optimizer, parts.position, parts.precision,
                                    on_reset=self._follow_world, on_sync=on_sync)

    def _follow_world(self) -> None:
        """Horovod elastic formed a new world: the topology follows it (and with it every part that
        reads it), and so do the shards, the global batch and the LR (under elastic the global batch
        follows the world, so the batch per worker is the configured one)."""
        parts = self.parts
        previous = parts.topology.reform()
        parts.batching.rebuild(parts.topology.data_world, parts.config.batch_size)
        parts.restart_schedule()
        where = ("from the newest checkpoint" if parts.strategy.capabilities.elastic_from_checkpoint
                 else f"at step {parts.position.step}")
        parts.topology.log.info(f"world changed from {previous} to {parts.world.size} workers: global batch "
                                f"{parts.batching.global_batch_size}, lr x {parts.lr.scale:g}; continuing {where}")

    def _continue_from_newest_checkpoint(self) -> None:
        """Under elastic, a sharded strategy's sync (every rank of the new world): the newest
        checkpoint, resharded for this world; at a fresh start, rank 0's state everywhere and a
        step-0 checkpoint, so that a worker lost before the first save has one to come back to."""
        parts = self.parts
        with parts.faults.checkpoint_io():
            newest = parts.checkpoints.protocol.read_newest()
            if newest is not None:
                parts.checkpoints.load(newest)
        if newest is None:
            parts.strategy.broadcast_from_root()
            parts.checkpoints.save_unless_saved()

    def _export_model(self, directory) -> None:
        """model.safetensors under every state_dict name, from the strategy's tensors one at a time
        (a collective); rank 0 writes; a failure is raised on every rank."""
        parts = self.parts
        aliases = {names[0]: names for names, _ in tensor_names(parts.model)}
        failure = export_model_streamed(parts.strategy.full_tensors(), aliases, directory, writes=self.world.is_root,
                                        metadata={"step": parts.position.step, "strategy": parts.config.strategy})
        failure = collectives.broadcast_object(failure, root_rank=0, name="export.model")
        if failure:
            raise CheckpointError(failure)
        parts.topology.log.info(f"trained model written to {directory}/model.safetensors (safetensors, with "
                                f"config.yaml beside it)")


def evaluate_model(model: torch.nn.Module, dataset: Dataset, world: Optional[World] = None, batch_size: int = 32,
                   loss_fn: LossFn = F.cross_entropy, step_fn: Optional[StepFn] = None,
                   collate_fn: Optional[Callable[[List[Any]], Any]] = None, precision: str = "fp32") -> Dict[str, float]:
    """Evaluation alone, no optimizer: a whole ``model`` (the same on every rank: one loaded from an
    export, say) over ``dataset`` cut into one shard per rank, in order, each sample once; returns
    val_loss, val_<metric> and val_samples, means over every sample, the same on every rank (a
    collective).

    Args:
        model: whole, the same on every rank.
        dataset: evaluated in order, each sample once.
        world: this process's place in the job (default: Horovod started with defaults).
        batch_size: samples per batch on each rank.
        loss_fn: ``loss_fn(outputs, targets)``, the batch's mean loss (unless ``step_fn``).
        step_fn: ``step_fn(model, batch) -> (loss, metrics)`` for batches of any structure.
        collate_fn: how the loader makes a batch of samples.
        precision: the forward's autocast, one of train.precision's values.
    """
    if precision not in PRECISIONS:
        raise ValueError(f"evaluate_model(precision=...) must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    world = world or startup.init()
    model = model.to(world.device)
    loader = sharded_loader(dataset, batch_size, world.rank, world.size, seed=0, collate_fn=collate_fn)
    return evaluate(model, loader, step_fn or supervised_step(loss_fn), world.device,
                    Precision(precision, world.device).autocast)


