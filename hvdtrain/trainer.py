"""The Trainer: hvdtrain's own loop on a training session (hvdtrain.session), the same for every
strategy: fit() trains through the strategy's forward and backward (a pipeline's schedule included),
under Horovod elastic too; run() then writes the trained model. The set-up, the steps, the
checkpoints and the reports are the session's: your own loop on it runs the same code.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional

import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

from hvdtrain.checkpoint import CheckpointError
from hvdtrain.weights import hf_export
from hvdtrain.weights.export import export_model_streamed
from hvdtrain.config.train import PRECISIONS
from hvdtrain.data.sharding import sharded_loader
from hvdtrain.distributed import collectives
from hvdtrain.distributed import startup
from hvdtrain.distributed.world import World
from hvdtrain.fault_tolerance import elastic
from hvdtrain.fault_tolerance import out_of_memory as oom
from hvdtrain.session import LossFn, Session
from hvdtrain.strategies.base import tensor_names
from hvdtrain.components.evaluation import evaluate
from hvdtrain.components.precision import Precision
from hvdtrain.components.steps import StepFn, supervised_step


class Trainer(Session):
    """Trains ``model`` with ``optimizer`` on ``train_dataset``, data-parallel over all ranks: a
    Session (its arguments: hvdtrain.session.Session) and hvdtrain's loop over it, fit() and run()."""

    # --- what elastic calls -----------------------------------------------------------------------

    def follow_world(self) -> None:
        """Horovod elastic formed a new world: the topology follows it (and with it every part that
        reads it), and so do the shards, the global batch and the LR (under elastic the global batch
        follows the world, so the batch per worker is the configured one)."""
        previous = self.topology.reform()
        self.batching.rebuild(self.topology.data_world, self.config.batch_size)
        self.restart_schedule()
        where = ("from the newest checkpoint" if self.strategy.capabilities.elastic_from_checkpoint
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
        # Each rank's memory of its own last save differs after a world change: forgotten at every sync.
        on_sync = [self.loop.forget_saved_step, self.restart_schedule, self.reporter.agree_run_directory]
        if self.strategy.capabilities.elastic_from_checkpoint:
            return elastic.CheckpointedElasticState(self.continue_from_newest_checkpoint, on_reset=self.follow_world,
                                                    on_sync=on_sync)
        return elastic.ElasticState(self.model, self.optimizer, self.position, self.precision,
                                    on_reset=self.follow_world, on_sync=on_sync)


    # --- the public calls -------------------------------------------------------------------------

    def fit(self, until_step: Optional[int] = None) -> List[Dict[str, float]]:
        """Train to the configured epochs, or max_steps; ``until_step`` replaces max_steps (fit again
        with a later one to go on). Returns one metrics dict per epoch, the same on every rank (all
        reduced across ranks)."""
        loop = self.loop
        self._begin_training(until_step)
        explain = lambda error: self._explain_out_of_memory(error, loop.phase, self.optimizer,
                                                            self.strategy.memory_bytes())
        try:
            with oom.explained(explain):
                if self.elastic_launch:
                    state = self._elastic_state()
                    commits = elastic.Commits(state.commit, self.config.elastic_commit_every,
                                              with_checkpoints=self.strategy.capabilities.elastic_from_checkpoint)
                    elastic.run(state, lambda: loop.run(until_step, commits))
                else:
                    loop.run(until_step)
        finally:
            self._end_training()
        history = list(loop.history)
        self.callbacks.call("on_train_end", history)
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


