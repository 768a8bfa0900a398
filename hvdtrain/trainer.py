"""The training loop, the same for every strategy.

The steps of Horovod data parallelism, in order, each marked where it happens:
  1. every rank starts from rank 0's parameters and optimizer state   (__init__)
  2. each rank reads its own shard, reshuffled every epoch            (loop._train_epoch)
  3. forward and backward on the shard                                (loop._train_epoch)
  4. gradients reduced across ranks during backward                   (the strategy's hooks)
  5. every rank applies the same update                               (loop._update, strategy.step)
  6. rank 0 logs; metrics are reduced over every rank's samples       (loop._report, evaluate)

How the model's state is spread over the ranks (replicated, or sharded as in ZeRO) is the
strategy's (hvdtrain.strategies). The Trainer is set-up and the public calls (fit, run,
evaluate); the loop is hvdtrain.training.loop's, the state a checkpoint holds hvdtrain.checkpoint.manager's,
checkpoint files hvdtrain.checkpoint.protocol's, failures hvdtrain.fault_tolerance.handling', and what a run reports
hvdtrain.observability.reporting's.
"""
from __future__ import annotations

import time
from dataclasses import replace
from typing import Any, Callable, Dict, List, Mapping, Optional

import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

from hvdtrain.distributed import startup as dist, rng
from hvdtrain.fault_tolerance import elastic, out_of_memory as oom
from hvdtrain.data.batching import Batching
from hvdtrain.checkpoint.protocol import Checkpointing
from hvdtrain.training.compiling import compile_forward
from hvdtrain.config.train import TrainConfig
from hvdtrain.data.sharding import ShardedSampler
from hvdtrain.fault_tolerance.elastic import TrainerState, is_elastic_launch
from hvdtrain.checkpoint.export import export_model
from hvdtrain.fault_tolerance.handling import FaultHandling
from hvdtrain.observability.logs import get_logger
from hvdtrain.observability.memory import MemoryReport
from hvdtrain.training.loop import TrainingLoop
from hvdtrain.training.metrics import evaluate
from hvdtrain.training.precision import Precision
from hvdtrain.observability.progress import Progress, resolve_mode
from hvdtrain.observability.reporting import TimelineWindow, announce, announce_settings, open_run_dir
from hvdtrain.checkpoint.manager import Resumable
from hvdtrain.observability.run_directory import RunDirectory
from hvdtrain.training.steps import StepFn, supervised_step
from hvdtrain.parallel.mesh import Mesh
from hvdtrain.strategies import build_strategy, launch_refusal
from hvdtrain.parallel.model_plan import ModelPlan
from hvdtrain.training.sync_batchnorm import convert_sync_batchnorm

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class Trainer(Resumable, TrainingLoop):
    """Trains ``model`` with ``optimizer`` on ``train_dataset``, data-parallel over all ranks.

    Build the model and optimizer as for one process, with the learning rate of one worker:
    the Trainer hands both to the strategy (``config.strategy``), scales the rate and
    broadcasts rank 0's state. ``loss_fn`` takes (outputs, targets) and returns the mean loss
    of the batch; or ``step_fn(model, batch) -> (loss, metrics)`` computes both from a batch of
    any structure (a dict, say; see hvdtrain.training.steps), and every metric is reported as a mean over
    every rank's samples, for training and validation. ``job_config`` is the script's whole
    resolved configuration (all sections), recorded in the run directory and in every checkpoint;
    by default only the ``train`` section.

    The loop itself is hvdtrain.training.loop's, the checkpointed state hvdtrain.checkpoint.manager's (base classes).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        train_dataset: Dataset,
        val_dataset: Optional[Dataset] = None,
        config: Optional[TrainConfig] = None,
        loss_fn: LossFn = F.cross_entropy,
        world: Optional[dist.World] = None,
        job_config: Optional[Mapping[str, Any]] = None,
        step_fn: Optional[StepFn] = None,
        model_plan: Optional[ModelPlan] = None,
    ) -> None:
        self.config = config or TrainConfig()
        self.job_config = dict(job_config) if job_config is not None else {"train": self.config.to_dict()}
        cfg = self.config
        self.world = world or dist.init(seed=cfg.seed, timeline=cfg.timeline_steps > 0,
                                        hierarchical_allreduce=cfg.hierarchical_allreduce,
                                        dynamic_process_sets=cfg.model_parallel)
        self.log = get_logger(self.world)
        self._check_reduction()
        self.loss_fn = loss_fn
        if step_fn is not None and cfg.pipeline_parallel > 1:
            raise ValueError("train.pipeline_parallel > 1 computes the loss on the last stage with loss_fn(outputs, "
                             "targets) and cannot run a step_fn, which needs the whole model: pass loss_fn "
                             "(and (inputs, targets) batches), or use tensor_parallel instead of a pipeline")
        self.step_fn = step_fn or supervised_step(loss_fn)
        # Before the strategy wraps it: the converted layers keep the same parameter objects.
        self.model = convert_sync_batchnorm(model) if cfg.sync_batchnorm else model
        self.model = self.model.to(self.world.device)
        self.precision = Precision(cfg.precision, self.world.device)
        # Under Horovod elastic, set-up runs no collective: a worker that joins later runs this
        # while the others wait in the elastic sync, and mismatched collectives deadlock. The
        # elastic sync broadcasts rank 0's state (and its checkpoint, if it read one) instead.
        self.elastic_launch = is_elastic_launch()
        refusal = launch_refusal(cfg, self.world, self.elastic_launch)
        if refusal:
            raise ValueError(refusal)

        # The model-parallel mesh (a collective; refused on every rank alike when it does not divide
        # the world); without one, every rank is a data-parallel worker.
        self.mesh = (Mesh.build(self.world.size, self.world.rank, cfg.tensor_parallel, cfg.pipeline_parallel)
                     if cfg.model_parallel else None)
        # What the data sees: one worker per model replica (the data-parallel group's width).
        self.data_world = (replace(self.world, rank=self.mesh.coordinates.data, size=self.mesh.shape.data)
                           if self.mesh is not None else self.world)
        # A tensor group computes replicated activations alike on every rank: its dropout masks must
        # agree, so its ranks share the random stream of the group's first rank.
        self.rng_rank = self.mesh.tensor.ranks[0] if self.mesh is not None else self.world.rank
        self.mesh_shape = ((self.mesh.shape.data, self.mesh.shape.pipeline, self.mesh.shape.tensor)
                           if self.mesh is not None else (self.world.size, 1, 1))
        if self.mesh is not None:  # every rank, so that a group's first rank starts its stream anew too
            rng.seed_everything(rng.rank_seed(cfg.seed, self.rng_rank))

        # Read before the loaders are built: a run resumed on another worker count keeps the
        # checkpoint's global batch, so its batch per worker follows from it.
        self.checkpoints = Checkpointing(cfg, self.world, self.log, self.data_world) if cfg.checkpoint_dir else None
        resumed = None
        if self.checkpoints is not None and cfg.resume:
            resumed = self.checkpoints.read_newest(broadcast=not self.elastic_launch)
        batch_size = (self.checkpoints.batch_per_worker(resumed, self.elastic_launch)
                      if self.checkpoints is not None else cfg.batch_size)
        self._datasets = (train_dataset, val_dataset)
        if self.mesh is not None and batch_size % cfg.micro_batches:
            raise ValueError(f"each worker's batch of {batch_size} (from the checkpoint's global batch) cannot be "
                             f"cut into train.micro_batches={cfg.micro_batches}: choose a divisor of {batch_size}")
        self.batching = Batching(cfg, self.data_world, batch_size, train_dataset, val_dataset)

        # 4. The strategy wraps the optimizer: for ddp, Horovod's hooks start each gradient's
        #    all-reduce as soon as backward produces it (overlap, tensor fusion).
        self._phase = "set-up (sharding the model and optimizer)"
        with oom.explained(lambda error: self._explain_out_of_memory(error, optimizer, held={})):
            self.strategy = build_strategy(cfg, self.model, optimizer, self.world, mesh=self.mesh,
                                           plan=model_plan, loss_fn=loss_fn)
        if cfg.compile:  # the forward only, in place: hooks, state_dict keys, checkpoints unchanged
            compile_forward(self.model, self.world.device)
        self._base_lrs = [group["lr"] for group in self.optimizer.param_groups]  # one worker's rates
        self.epoch = 0
        self.step = 0
        self.epoch_position = 0  # samples of the current epoch's global order already trained on
        self._configure_lr()
        # 1. Rank 0's parameters and optimizer state, everywhere, before the first step.
        if not self.elastic_launch:
            self.strategy.broadcast_from_root()

        self.faults = FaultHandling(cfg, self.world, self.log)
        self._elastic: Optional[TrainerState] = None
        self.preempted = False
        self.grad_norm = float("nan")  # before clipping, at the last step (train.max_grad_norm)
        self.run_dir: Optional[RunDirectory] = open_run_dir(cfg, self.world, self.log, self.job_config,
                                                            self.elastic_launch)
        self._announce()
        self._started = time.time()
        self.progress = Progress("off", 0, 0, self.log)  # fit() sets the real one
        if resumed is not None:
            self.load_state_dict(resumed)
        self.timeline = TimelineWindow(cfg.timeline_steps, self.step, self.run_dir, self.log)
        self.memory = MemoryReport(self.strategy, self.world, self.log, gather=not self.elastic_launch)

    def _check_reduction(self) -> None:
        """Refuse what Horovod cannot do in this world (train.reduction, train.hierarchical_allreduce):
        on every rank alike, before any collective, instead of failing or hanging in the first step."""
        cfg, world = self.config, self.world
        if cfg.hierarchical_allreduce and not world.hierarchical_allreduce:
            raise ValueError(dist.hierarchical_conflict())

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The optimizer the strategy steps (its param_groups carry the live learning rate)."""
        return self.strategy.optimizer

    # What follows from the world and the global batch (hvdtrain.data.batching), read by the loop.

    @property
    def sampler(self) -> ShardedSampler:
        return self.batching.sampler

    @property
    def global_batch_size(self) -> int:
        return self.batching.global_batch_size

    @property
    def steps_per_epoch(self) -> int:
        return self.batching.steps_per_epoch

    @property
    def warmup_steps(self) -> int:
        return self.batching.warmup_steps

    def _configure_lr(self) -> None:
        """Scale one worker's rates to the global batch, warmed up, continuing at the current step."""
        self.lr_scale, self.scheduler = self.batching.lr_schedule(self.optimizer, self._base_lrs, self.step)

    def _on_world_change(self) -> None:
        """Elastic reset: Horovod formed a new world; follow its size (sampler, batch, LR)."""
        previous = self.world.size
        self.world = dist.reformed(self.world)
        self.data_world = self.world  # elastic runs are data-parallel only
        self.rng_rank, self.mesh_shape = self.world.rank, (self.world.size, 1, 1)
        self.log = get_logger(self.world)
        self.faults.follow(self.world, self.log)
        self.strategy.world = self.world
        # Elastic: the global batch follows the world, so the batch per worker is the configured one.
        self.batching = Batching(self.config, self.world, self.config.batch_size, *self._datasets)
        self._configure_lr()
        self.log.info(f"world changed from {previous} to {self.world.size} workers: global batch "
                      f"{self.global_batch_size}, lr x {self.lr_scale:g}; continuing at step {self.step}")

    def _announce(self) -> None:
        announce(self.world, self.log, self.elastic_launch, self.mesh)
        self.log.info(self.batching.describe(self.lr_scale))
        if self.world.hierarchical_allreduce:
            self.log.info(dist.hierarchical_effect(True, dist.nccl_built(), self.world.device.type,
                                                   self.world.cross_size))
        announce_settings(self.log, self.job_config)

    def _epoch_has_steps_left(self) -> bool:
        return self.batching.has_steps_left(self.epoch_position)

    def _finished(self) -> bool:
        return self.preempted or (self.config.max_steps is not None and self.step >= self.config.max_steps)

    def fit(self) -> List[Dict[str, float]]:
        """Train to the configured epochs (or max_steps); returns one metrics dict per epoch.

        Every rank returns the same history: all values are reduced across ranks.
        """
        history: List[Dict[str, float]] = []
        total = self.config.epochs * self.steps_per_epoch
        if self.config.max_steps is not None:
            total = min(total, self.config.max_steps)
        self.progress = Progress(resolve_mode(self.config.progress, self.world.is_root), total, self.step, self.log)
        self.faults.start_watchdog(self.strategy.pending_communication)
        explain = lambda error: self._explain_out_of_memory(error, self.optimizer, self.strategy.memory_bytes())
        try:
            with oom.explained(explain):
                if self.elastic_launch:
                    self._elastic = TrainerState(self, self._on_world_change)
                    elastic.run(self._elastic, lambda: self._fit(history))
                else:
                    self._fit(history)
        finally:
            self.progress.close()
            self.faults.stop_watchdog()
            self.timeline.close(self.step)
        return history

    def _explain_out_of_memory(self, error: BaseException, optimizer: torch.optim.Optimizer,
                               held: Dict[str, int]) -> str:
        message = oom.explain(error, rank=self.world.rank, host=self.world.hostname, phase=self._phase,
                          strategy=self.config.strategy, workers=self.world.size, model=self.model,
                          optimizer=optimizer, held=held, device=self.world.device)
        self.log.error(message)  # every rank's own log says it, not only the rank that prints
        return message

    def run(self) -> Optional[Dict[str, float]]:
        """fit(), then close the run directory; the final metrics (the same on every rank).

        None when the run was preempted: it is checkpointed (and requeued under SLURM), and the
        next start resumes. A run resumed from its own last checkpoint has nothing left to
        train: its model is evaluated instead.
        """
        run_dir = self.run_dir.path if self.run_dir is not None else None
        try:
            history = self.fit()
        finally:
            self.close()
        if self.preempted:
            if self.world.is_root:
                print(f"preempted at step {self.step}; run again to resume", flush=True)
            return None
        final = history[-1] if history else self.evaluate()
        exported = self.strategy.exported_model_state()  # every rank: a collective
        self.final_model_state = exported  # the whole trained model, on every rank (model parallel: gathered)
        if run_dir is not None and self.world.is_root:
            path = export_model(exported, run_dir,
                                metadata={"step": self.step, "strategy": self.config.strategy})
            self.log.info(f"trained model written to {path} (safetensors, with config.yaml beside it)")
        return final

    def close(self) -> None:
        """Close the run directory's files (the metrics, TensorBoard and log files)."""
        if self.run_dir is not None:
            self.run_dir.close()
            self.run_dir = None

    def close_mesh(self) -> None:
        """Remove the model-parallel mesh's Horovod process sets (a collective: every rank calls it).

        Horovod negotiates every live process set on every cycle of its background thread, so
        each set left behind slows every later collective (measured at 4 ranks under Gloo on 2
        cores: a small all-reduce took ~30 ms with no extra set, 70-160 ms with two). A process that goes on
        after training (a sweep of Trainers, a test suite) closes them; the Trainer cannot step,
        gather or checkpoint afterwards."""
        if self.mesh is not None:
            self.mesh.close()

    def evaluate(self) -> Dict[str, float]:
        """The step's loss and metrics over the whole validation set (every rank's shard), as
        val_loss, val_<metric>."""
        if self.batching.val_loader is None:
            return {}
        self._phase = "evaluation"
        strategy = self.strategy
        return evaluate(self.model, self.batching.val_loader, lambda _, batch: strategy.forward_only(self.step_fn, batch),
                        self.world.device, self.precision.autocast, after_batch=lambda: self.faults.beat(self.step),
                        lockstep=strategy.collective_forward, counts_samples=strategy.counts_samples)
