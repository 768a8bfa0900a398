"""The Trainer: hvdtrain's own loop, the same for every strategy, over the parts of a run
(hvdtrain.parts, which the Session holds too): fit() trains through the strategy's forward and
backward (a pipeline's schedule included), under Horovod elastic too; run() then writes the trained
model. The set-up, the steps, the checkpoints and the reports are the parts': your own loop on a
Session runs the same code.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional

import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

from hvdtrain.weights import hf_export
from hvdtrain.components.evaluation import evaluate
from hvdtrain.components.precision import Precision
from hvdtrain.components.steps import StepFn, supervised_step
from hvdtrain.config.train import PRECISIONS
from hvdtrain.data.sharding import sharded_loader
from hvdtrain.distributed import startup
from hvdtrain.distributed.world import World
from hvdtrain.fault_tolerance import elastic
from hvdtrain.parts import LossFn, PartsHolder


class Trainer(PartsHolder):
    """Trains ``model`` with ``optimizer`` on ``train_dataset``, data-parallel over all ranks: fit()
    and run(). Its arguments and shared calls are hvdtrain.parts.PartsHolder's; the parts it is made of
    (strategy, batching, checkpoints...) are ``parts`` (hvdtrain.parts)."""

    # --- the public calls (the rest are PartsHolder's) ----------------------------------------------

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
            self.export(run_dir)
        return final

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
        # A rank learns the run directory at the first sync (agree_run_directory): its flight record
        # service opens there then, so `hvdtrain debug dump` reaches every rank, not rank 0 alone.
        on_sync = [parts.checkpoints.forget_saved_step, parts.restart_schedule, parts.reporter.agree_run_directory,
                   lambda: parts.faults.flight.open(parts.reporter.path)]
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


