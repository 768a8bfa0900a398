"""The training loop, the same for every strategy.

The steps of Horovod data parallelism, in order, each marked where it happens:
  1. every rank starts from rank 0's parameters and optimizer state   (__init__)
  2. each rank reads its own shard, reshuffled every epoch            (_train_epoch)
  3. forward and backward on the shard                                (_train_epoch)
  4. gradients reduced across ranks during backward                   (the strategy's hooks)
  5. every rank applies the same update                               (strategy.step)
  6. rank 0 logs; metrics are reduced over every rank's samples       (_report, evaluate)

How the model's state is spread over the ranks (replicated, or sharded as in ZeRO) is the
strategy's (hvdtrain.strategies); checkpoints are hvdtrain.checkpointing's, failures
hvdtrain.faults', and what a run reports hvdtrain.reporting's.
"""
from __future__ import annotations

import time
from typing import Any, Callable, Dict, List, Mapping, Optional

import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

from hvdtrain import dist, elastic, oom, rng
from hvdtrain.batching import Batching
from hvdtrain.checkpoint import FORMAT_VERSION
from hvdtrain.checkpointing import Checkpointing
from hvdtrain.config import TrainConfig
from hvdtrain.data import ShardedSampler
from hvdtrain.elastic import TrainerState, is_elastic_launch
from hvdtrain.export import export_model
from hvdtrain.faults import FaultHandling
from hvdtrain.log import get_logger
from hvdtrain.memory import MemoryReport
from hvdtrain.metrics import RunningMeans, Throughput, Totals, evaluate
from hvdtrain.precision import Precision
from hvdtrain.progress import Progress, resolve_mode
from hvdtrain.reporting import TimelineWindow, announce, announce_settings, epoch_line, open_run_dir
from hvdtrain.rundir import RunDirectory
from hvdtrain.sharded_checkpoint import is_sharded
from hvdtrain.steps import StepFn, batch_size, supervised_step, to_device
from hvdtrain.strategies import ELASTIC_STRATEGIES, build_strategy
from hvdtrain.sync_batchnorm import convert_sync_batchnorm

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class Trainer:
    """Trains ``model`` with ``optimizer`` on ``train_dataset``, data-parallel over all ranks.

    Build the model and optimizer as for one process, with the learning rate of one worker:
    the Trainer hands both to the strategy (``config.strategy``), scales the rate and
    broadcasts rank 0's state. ``loss_fn`` takes (outputs, targets) and returns the mean loss
    of the batch; or ``step_fn(model, batch) -> (loss, metrics)`` computes both from a batch of
    any structure (a dict, say; see hvdtrain.steps), and every metric is reported as a mean over
    every rank's samples, for training and validation. ``job_config`` is the script's whole resolved configuration (all sections),
    recorded in the run directory and in every checkpoint; by default only the ``train`` section.
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
    ) -> None:
        self.config = config or TrainConfig()
        self.job_config = dict(job_config) if job_config is not None else {"train": self.config.to_dict()}
        self.world = world or dist.init(seed=self.config.seed, timeline=self.config.timeline_steps > 0)
        self.log = get_logger(self.world)
        self.loss_fn = loss_fn
        self.step_fn = step_fn or supervised_step(loss_fn)
        cfg = self.config
        # Before the strategy wraps it: the converted layers keep the same parameter objects.
        self.model = convert_sync_batchnorm(model) if cfg.sync_batchnorm else model
        self.model = self.model.to(self.world.device)
        self.precision = Precision(cfg.precision, self.world.device)
        # Under Horovod elastic, set-up runs no collective: a worker that joins later runs this
        # while the others wait in the elastic sync, and mismatched collectives deadlock. The
        # elastic sync broadcasts rank 0's state (and its checkpoint, if it read one) instead.
        self.elastic_launch = is_elastic_launch()
        if self.elastic_launch and cfg.strategy not in ELASTIC_STRATEGIES:
            raise ValueError(
                f"train.strategy={cfg.strategy} does not support Horovod elastic (its state is cut into "
                f"one shard per worker, and elastic changes the worker count mid-run): use "
                f"{' or '.join(ELASTIC_STRATEGIES)} under elastic, or launch without --min-np/--max-np")

        # Read before the loaders are built: a run resumed on another worker count keeps the
        # checkpoint's global batch, so its batch per worker follows from it.
        self.checkpoints = Checkpointing(cfg, self.world, self.log) if cfg.checkpoint_dir else None
        resumed = None
        if self.checkpoints is not None and cfg.resume:
            resumed = self.checkpoints.read_newest(broadcast=not self.elastic_launch)
        batch_size = (self.checkpoints.batch_per_worker(resumed, self.elastic_launch)
                      if self.checkpoints is not None else cfg.batch_size)
        self._datasets = (train_dataset, val_dataset)
        self.batching = Batching(cfg, self.world, batch_size, train_dataset, val_dataset)

        # 4. The strategy wraps the optimizer: for ddp, Horovod's hooks start each gradient's
        #    all-reduce as soon as backward produces it (overlap, tensor fusion).
        self._phase = "set-up (sharding the model and optimizer)"
        with oom.explained(lambda error: self._explain_out_of_memory(error, optimizer, held={})):
            self.strategy = build_strategy(cfg.strategy, self.model, optimizer, self.world,
                                           cfg.accumulation, cfg.fp16_allreduce)
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

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The optimizer the strategy steps (its param_groups carry the live learning rate)."""
        return self.strategy.optimizer

    # What follows from the world and the global batch (hvdtrain.batching), read by the loop.

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
        self.log = get_logger(self.world)
        self.faults.follow(self.world, self.log)
        self.strategy.world = self.world
        # Elastic: the global batch follows the world, so the batch per worker is the configured one.
        self.batching = Batching(self.config, self.world, self.config.batch_size, *self._datasets)
        self._configure_lr()
        self.log.info(f"world changed from {previous} to {self.world.size} workers: global batch "
                      f"{self.global_batch_size}, lr x {self.lr_scale:g}; continuing at step {self.step}")

    # ---- checkpoints ---------------------------------------------------------------------

    def state_dict(self) -> Dict[str, Any]:
        """Everything needed to continue exactly: every rank must call it (it gathers RNG states,
        and a sharded strategy gathers the model and optimizer state)."""
        rng_states = dist.allgather_object(rng.capture(), name="checkpoint.rng")
        return {
            "format": FORMAT_VERSION,
            **self.strategy.state_dict(),  # the full model and optimizer, in the plain formats
            **self.run_state(),
            "rng": rng_states,
        }

    def run_state(self) -> Dict[str, Any]:
        """What every rank holds alike: where the run is, its batch, its settings (no collective)."""
        return {
            "scheduler": self.scheduler.state_dict(),
            "epoch": self.epoch,
            "step": self.step,
            "epoch_position": self.epoch_position,
            "global_batch": self.global_batch_size,
            "world_size": self.world.size,
            "strategy": self.config.strategy,
            "precision": self.precision.state_dict(),  # fp16's loss scale continues on resume
            "config": self.job_config,
        }

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """A full checkpoint (every rank holds it all), or a sharded one's manifest (every rank
        then reads its own file: its slices and its RNG states)."""
        own_rng = None
        if is_sharded(state):
            own_rng = self.checkpoints.load_own_shard(state, self.strategy)
        else:
            self.strategy.load_state_dict(state)
            if state["world_size"] == self.world.size:
                own_rng = state["rng"][self.world.rank]
        self.scheduler.load_state_dict(state["scheduler"])
        self.precision.load_state_dict(state.get("precision", {}))  # absent before hvdtrain had it
        self.epoch, self.step = state["epoch"], state["step"]
        self.epoch_position = state["epoch_position"]
        if own_rng is not None:
            rng.restore(own_rng)
        else:
            # Rank r of the new world is not rank r of the old one: derive fresh per-rank seeds.
            rng.seed_everything(rng.rank_seed(self.config.seed + self.step, self.world.rank))
        self.log.info(f"resumed at epoch {self.epoch + 1}, step {self.step}, "
                      f"sample {state['epoch_position']} of the epoch")

    def save_checkpoint(self) -> None:
        """Every rank calls it. Full: the state is gathered, rank 0 writes, the others wait.
        Sharded: every rank writes its own part, nothing is gathered; rank 0 adds the manifest."""
        if self.config.checkpoint_format == "sharded":
            own = {"strategy": self.strategy.shard_state_dict(), "rng": rng.capture()}
            self.checkpoints.save_sharded(own, self.run_state(), self.step)
        else:
            self.checkpoints.save(self.state_dict(), self.step)
        self.faults.beat(self.step)  # a large checkpoint may take longer than a step

    def _announce(self) -> None:
        announce(self.world, self.log, self.elastic_launch)
        self.log.info(self.batching.describe(self.lr_scale))
        announce_settings(self.log, self.job_config)

    def _epoch_has_steps_left(self) -> bool:
        return self.batching.has_steps_left(self.epoch_position)

    def _finished(self) -> bool:
        return self.preempted or (self.config.max_steps is not None and self.step >= self.config.max_steps)

    def _stop_for_preemption(self) -> None:
        """Every rank agreed to stop: checkpoint now, requeue the job (rank 0), and return from fit."""
        if self.checkpoints is None:
            self.log.warning("preemption signal, but no checkpoint_dir: this run cannot be resumed")
        else:
            self.save_checkpoint()
        self.preempted = True
        self.faults.requeue_after_preemption(self.step)

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
        self.strategy.whole_model()  # every rank: from here on one rank may use the model alone
        if run_dir is not None and self.world.is_root:
            path = export_model(self.model.state_dict(), run_dir,
                                metadata={"step": self.step, "strategy": self.config.strategy})
            self.log.info(f"trained model written to {path} (safetensors, with config.yaml beside it)")
        return final

    def close(self) -> None:
        """Close the run directory's files (the metrics, TensorBoard and log files)."""
        if self.run_dir is not None:
            self.run_dir.close()
            self.run_dir = None

    def _fit(self, history: List[Dict[str, float]]) -> None:
        while self.epoch < self.config.epochs and not self._finished():
            started = time.perf_counter()
            train, samples = self._train_epoch()
            elapsed = time.perf_counter() - started
            if self.preempted:
                break
            if not self._epoch_has_steps_left():
                self.epoch, self.epoch_position = self.epoch + 1, 0
            # max_steps can end training inside an epoch: the record says how far it got.
            reached = self.epoch + self.epoch_position / self.batching.dataset_size
            record = {
                "epoch": reached,
                "step": self.step,
                **{f"train_{name}": value for name, value in train.items()},
                "samples_per_sec": samples / elapsed,
                "lr": self.optimizer.param_groups[0]["lr"],
                **self.evaluate(),
            }
            history.append(record)
            if self.run_dir is not None:
                self.run_dir.record("epoch", record, self._started)
            self.progress.message(epoch_line(record, self.config.epochs))
            if self.checkpoints is not None:
                self.save_checkpoint()
            if self._elastic is not None:
                self._elastic.commit()

    def _train_epoch(self) -> tuple:
        """One pass over this rank's shard; returns (mean train loss over all ranks, global samples)."""
        cfg, device, strategy = self.config, self.world.device, self.strategy
        # 2. A new permutation each epoch, the same on every rank; each rank takes its slice
        #    (from where a resumed epoch stopped).
        self.sampler.set_epoch(self.epoch, start=self.epoch_position)
        self.model.train()
        window = RunningMeans(device)
        throughput = Throughput(self.world.size)
        epoch_totals = Totals()

        for index, batch in enumerate(self.batching.train_loader):
            if self._finished():
                break
            batch = to_device(batch, device)
            samples = batch_size(batch)
            # 3. Forward and backward on this rank's micro-batch; the strategy's hooks start each
            #    gradient's reduction as soon as backward has produced it.
            self._phase = "the forward and backward pass"
            with self.precision.autocast():
                loss, metrics = self.step_fn(self.model, batch)
            scaled = self.precision.scale_loss(loss)
            strategy.backward(scaled / cfg.accumulation if cfg.accumulation > 1 else scaled)
            window.add(loss, metrics, samples)
            throughput.add(samples)
            if (index + 1) % cfg.accumulation:
                continue
            # 5. Wait for the reduced gradients, then the same update on every rank. The wait
            #    is timed apart from the update: it is the step's exposed communication.
            self._phase = "gradient synchronization"
            waited = time.perf_counter()
            strategy.synchronize()
            throughput.add_wait(time.perf_counter() - waited)
            self._phase = "the optimizer step"
            self._update()
            self.memory.after_first_step(self.run_dir, self.step + 1, self._started)
            strategy.zero_grad()
            self.scheduler.step()
            self.step += 1
            self.epoch_position += self.global_batch_size
            self.faults.beat(self.step)
            self.progress.advance()
            self.timeline.after_step(self.step)
            if self._elastic is not None and self.step % cfg.elastic_commit_every == 0:
                self._elastic.commit()  # the point survivors roll back to; may raise to resize
            # The last step of an epoch is saved by the epoch's end, as the start of the next.
            if (self.checkpoints is not None and cfg.checkpoint_every and self.step % cfg.checkpoint_every == 0
                    and self._epoch_has_steps_left()):
                self.save_checkpoint()
            if self.faults.preemption_agreed(self.step):
                self._stop_for_preemption()
                break
            if self.step % cfg.log_every == 0:
                totals = window.reduce(name="train.window")
                epoch_totals += totals
                self._report(totals.means(), throughput)

        epoch_totals += window.reduce(name="train.epoch")
        return epoch_totals.means(), epoch_totals.count

    def _update(self) -> None:
        """The synchronized gradients unscaled and checked (fp16: a step with inf/nan on any rank is
        skipped on every rank), clipped, then the strategy's step."""
        strategy = self.strategy
        if self.precision.scaled and not self.precision.unscale_and_check(
                strategy.owned_gradients(), strategy.shards_gradients, name="fp16.nonfinite"):
            self.log.warning(f"step {self.step + 1}: inf/nan in the fp16 gradients, step skipped on every "
                             f"rank; loss scale now {self.precision.scale:g}")
            return
        if self.config.max_grad_norm is not None:
            self.grad_norm = strategy.clip_grad_norm_(self.config.max_grad_norm)
        strategy.step()

    def _report(self, means: Dict[str, float], throughput: Throughput) -> None:
        """Every log_every steps: the progress display and a metrics record (values of rank 0,
        whose clock measures the job: every step ends in the same collective on every rank)."""
        samples_per_sec, comm_fraction = throughput.read()
        lr = self.optimizer.param_groups[0]["lr"]
        self.progress.report(self.epoch + 1, self.step, means["loss"], lr, samples_per_sec, comm_fraction)
        if self.run_dir is not None:
            extra = {"grad_norm": self.grad_norm} if self.config.max_grad_norm is not None else {}
            if self.precision.scaled:
                extra.update(loss_scale=self.precision.scale, skipped_steps=self.precision.skipped_steps)
            self.run_dir.record("step", {
                "step": self.step, "epoch": self.epoch + self.epoch_position / self.batching.dataset_size,
                **means, "lr": lr, "samples_per_sec": samples_per_sec, "comm_fraction": comm_fraction, **extra,
            }, self._started)

    def evaluate(self) -> Dict[str, float]:
        """The step's loss and metrics over the whole validation set (every rank's shard), as
        val_loss, val_<metric>."""
        if self.batching.val_loader is None:
            return {}
        self._phase = "evaluation"
        return evaluate(self.model, self.batching.val_loader, self.step_fn, self.world.device,
                        self.precision.autocast, after_batch=lambda: self.faults.beat(self.step),
                        lockstep=self.strategy.collective_forward)
