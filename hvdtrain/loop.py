"""The training loop, the same for every strategy: epochs, and in each the steps of data parallelism.

    2. each rank reads its own shard, reshuffled every epoch             (batches)
    3. forward and backward on the shard                                 (run, or your own loop)
    4. gradients reduced across ranks during backward                    (the strategy's hooks)
    5. every rank applies the same update                                (step, update)
    6. rank 0 reports; metrics are reduced over every rank's samples     (reporter, evaluate)

(1., rank 0's state everywhere before the first step, is the set-up's: hvdtrain.parts.) How the model's
state is spread over the ranks is the strategy's; the loop never asks which one it runs.
"""
from __future__ import annotations

import dataclasses
import itertools
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Dict, Iterator, List, Optional

import torch

from hvdtrain.checkpoint.manager import CheckpointManager
from hvdtrain.common.flight.recorder import RECORDER
from hvdtrain.config.train import TrainConfig
from hvdtrain.data.batching import Batching
from hvdtrain.distributed import collectives
from hvdtrain.fault_tolerance.handling import FaultHandling
from hvdtrain.observability.reporting import Reporter
from hvdtrain.parallel.topology import Topology
from hvdtrain.strategies.base import Strategy
from hvdtrain.components import token_mean
from hvdtrain.components.callbacks import Callbacks
from hvdtrain.components.compile_cache import CompileCache
from hvdtrain.components.evaluation import evaluate
from hvdtrain.components.lr import LearningRate
from hvdtrain.components.metrics import RunningMeans, Throughput, Totals
from hvdtrain.components.position import Position
from hvdtrain.components.precision import Precision
from hvdtrain.components.steps import StepFn, batch_size, to_device

if TYPE_CHECKING:
    from hvdtrain.fault_tolerance.elastic import Commits


@dataclass
class TrainingLoop:
    """Runs epochs of steps over the parts it is given; its own state is what it reports."""

    config: TrainConfig
    topology: Topology
    model: torch.nn.Module
    strategy: Strategy
    step_fn: StepFn
    precision: Precision
    batching: Batching
    lr: LearningRate
    position: Position
    reporter: Reporter
    checkpoints: Optional[CheckpointManager]  # None: the run keeps no checkpoints
    faults: FaultHandling
    callbacks: Callbacks
    compile_cache: Optional[CompileCache] = None  # train.compile: saved once the first step compiled
    phase: str = "set-up"  # what the loop is doing, for an out-of-memory message
    grad_norm: float = float("nan")  # before clipping, at the last step (train.max_grad_norm or clip_to)
    # Your own loop's clip_grad_norm_(max_norm): the coming step's clip, applied where max_grad_norm's is.
    clip_to: Optional[float] = None
    preempted: bool = False
    stopped: bool = False  # a callback asked, and every rank agreed
    # Under Horovod elastic, for one run(): when the state survivors roll back to is committed.
    commits: Optional["Commits"] = None
    history: List[Dict[str, float]] = dataclasses.field(default_factory=list)  # one record per epoch
    # The epoch in progress (batches()): its limit, its running means and counts, its micro-batches.
    until_step: Optional[int] = None
    epoch_done: bool = True
    interrupted: bool = False  # step() ended training inside the epoch
    micro_batches: int = 0
    samples: int = 0  # in the current micro-batch
    # The current micro-batch's scored items and its loss weight (run(): token_mean); 1 / accumulation
    # is the weight your own loop's backward() applies.
    items: Optional[int] = None
    loss_weight: token_mean.Weight = 1.0
    step_items: Optional[token_mean.StepItems] = None
    window: Optional[RunningMeans] = None
    throughput: Optional[Throughput] = None
    epoch_totals: Optional[Totals] = None

    def finished(self, until_step: Optional[int]) -> bool:
        """Preempted, stopped by a callback, or at the step limit: ``until_step``, else max_steps."""
        limit = self.config.max_steps if until_step is None else until_step
        return self.preempted or self.stopped or (limit is not None and self.position.step >= limit)

    def begin(self) -> None:
        """Every fit() and every epochs() starts here: a stop ended the previous one, and its records
        are the previous one's."""
        self.stopped = False
        self.callbacks.forget_stop()
        self.history = []

    def run(self, until_step: Optional[int] = None, commits: Optional["Commits"] = None) -> None:
        """The Trainer's loop: every batch through the strategy's forward and backward (a pipeline
        runs its schedule there), then step(): the same epochs, batches and steps a library user's
        own loop runs (hvdtrain.session). ``commits``: under Horovod elastic."""
        self.commits = commits
        for _ in self.epochs(until_step):
            for batch in self.batches(weighed=True):
                self.phase = "the forward and backward pass"
                flight = RECORDER.begin_phase("forward and backward", self.position.step)
                loss, metrics = self.strategy.forward_backward(self.step_fn, batch, self.precision.autocast,
                                                               self.precision.scale_loss, self.loss_weight)
                RECORDER.end_phase(flight)
                self.record(loss, metrics)
                self.step()

    def epochs(self, until_step: Optional[int] = None) -> Iterator[int]:
        """Yields each epoch to train (its batches: batches()), then closes it: one record each in
        ``self.history``, evaluation, the epoch's checkpoint and callbacks; until the configured epochs,
        max_steps or ``until_step``."""
        position = self.position
        self.until_step = until_step
        while position.epoch < self.config.epochs and not self.finished(until_step):
            started = time.perf_counter()
            self.epoch_done = False
            yield position.epoch
            if not self.epoch_done:
                raise RuntimeError("an epoch's batches were left before their end: every rank must take them all "
                                   "(a rank that leaves alone leaves the others waiting in a collective); end "
                                   "training early with request_stop(reason) or train.max_steps")
            train, samples = self.epoch_totals.means(), self.epoch_totals.count
            elapsed = time.perf_counter() - started
            if self.preempted:
                break
            index = position.epoch  # as epochs() yielded it: every epoch is named from 0, one way
            if not self.batching.has_steps_left(position.epoch_position):
                position.epoch, position.epoch_position = position.epoch + 1, 0
            # max_steps can end training inside an epoch: epochs_done says how far it got.
            record = {
                "epoch": index,
                "epochs_done": self.batching.epoch_progress(position.epoch, position.epoch_position),
                "step": position.step,
                **{f"train_{name}": value for name, value in train.items()},
                "samples_per_sec": samples / elapsed,
                **self.reporter.efficiency_figures(samples / elapsed),
                "lr": self.lr.current,
                **self.evaluate(),
            }
            self.history.append(record)
            self.reporter.epoch(record)
            if self.batching.val_loader is not None:
                self.callbacks.call("on_evaluation_end", position.step,
                                    {k: v for k, v in record.items() if k.startswith("val_")})
            self.callbacks.call("on_epoch_end", dict(record))
            if self.checkpoints is not None:
                self.checkpoints.save_unless_saved()
            if self.commits is not None:
                self.commits.at_epoch_end()
            if self.stop_if_agreed("loop.stop.epoch"):
                break
        if self.checkpoints is not None:  # an asynchronous save's write, done before the run returns
            with self.faults.checkpoint_io():
                self.checkpoints.finish()

    def batches(self, weighed: bool = False) -> Iterator[Any]:
        """This rank's batches of the epoch (on its device), from where a resumed epoch stopped; after
        each, the caller runs forward and backward (record() its loss) and step(). Ends at the
        shard's end, or where step() ended training (max_steps, a preemption, an agreed stop).
        ``weighed`` (the Trainer's own steps): each step's micro-batches are read before its first,
        and each gets its ``loss_weight``, its share of the global batch's loss (token_mean)."""
        position = self.position
        device = self.topology.world.device
        # 2. A new permutation each epoch, the same on every rank; each rank takes its slice
        #    (from where a resumed epoch stopped).
        self.batching.sampler.set_epoch(position.epoch, start=position.epoch_position)
        self.batching.exhausted = False
        self.model.train()
        self.window = RunningMeans(device)
        self.throughput = Throughput(self.batching.world.size)  # data-parallel width: distinct samples
        self.epoch_totals = Totals()
        self.micro_batches, self.interrupted, self.items = 0, False, None
        loading = RECORDER.begin_phase("data loading", position.step)  # the flight recorder's phases
        loader = self.batching.train_loader
        for batch in self._weighed(loader) if weighed else loader:
            RECORDER.end_phase(loading)
            if self.finished(self.until_step):
                break
            self.samples = batch_size(batch)
            self.reporter.first_batch(batch, self.samples)  # the model FLOPs, counted once per start
            yield to_device(batch, device)
            if self.interrupted:
                break
            loading = RECORDER.begin_phase("data loading", position.step)
        else:  # the loader ran out: a stream's epoch is over (every rank alike: whole global batches)
            RECORDER.end_phase(loading)
            self.batching.exhausted = True
        if weighed:  # a step read and not trained (the end of training): its count's all-reduce waited for
            float(self.loss_weight)
        self.epoch_totals += self.window.reduce(name="train.epoch")
        self.epoch_done = True

    def evaluation_items(self) -> Optional[token_mean.ItemCounter]:
        """What the validation loss is weighed by, batch by batch: the step's scored tokens (the
        validation set's token mean, as one pass over it computes) under loss_mean=tokens, else None
        (samples)."""
        if self.config.resolved_loss_mean != token_mean.TOKENS:
            return None
        return token_mean.resolve_counter(self.step_fn, self.model)

    def _weighed(self, loader: Any) -> Iterator[Any]:
        """The loader's batches, a step's micro-batches read before its first: their scored items
        counted, the step's weights made from the global batch's count (one all-reduce per step, every
        rank alike: each reads the same number of batches), each batch yielded with ``items`` and
        ``loss_weight`` set. batches() stops at the end of training, as it does over the loader."""
        if self.step_items is None:  # resolved once: what the step's loss averages over
            self.step_items = token_mean.StepItems(token_mean.resolve_counter(self.step_fn, self.model), batch_size,
                                                   self.config.resolved_loss_mean, collectives.allreduce_sum_async)
        accumulation, data_width = self.config.accumulation, self.batching.world.size
        replication = self.topology.world.size // data_width  # ranks holding each replica's batch
        batches = iter(loader)
        while True:
            window = list(itertools.islice(batches, accumulation))
            if not window:
                return
            counts = [self.step_items.items(batch) for batch in window]
            for batch, items, weight in zip(window, counts, self.step_items.weights(counts, accumulation, data_width,
                                                                                    replication)):
                self.items, self.loss_weight = items, weight
                yield batch

    def record(self, loss: torch.Tensor, metrics: Dict[str, Any]) -> None:
        """The micro-batch's loss and metrics, for the reported means (3. forward and backward were run):
        the loss weighed by its scored items when the step counts them (the global batch's token mean),
        the metrics by samples."""
        counted = self.strategy.counts_samples
        tokens = self.items if self.items is not None and self.step_items.counts_tokens else None
        self.window.add(loss, metrics, self.samples if counted else 0,
                        loss_weight=None if tokens is None else (tokens if counted else 0))
        self.throughput.add(self.samples)

    def step(self) -> bool:
        """After each micro-batch's backward: at the last of train.accumulation, the optimizer step
        (synchronize, unscale, clip, step, zero, LR) and what follows a step, each at its cadence
        (evaluation, elastic commits, checkpoints, the preemption and stop votes, logs). Returns
        whether a step was taken."""
        self.micro_batches += 1
        if self.micro_batches % self.config.accumulation:
            return False
        self.synchronize_and_update()
        self.advance()
        self.evaluate_if_due()
        if self.commits is not None:
            self.commits.after_step(self.position.step)  # the point survivors roll back to; may raise to resize
        if self.checkpoints is not None:
            flight = RECORDER.begin_phase("checkpoint", self.position.step)
            saved = self.checkpoints.maybe_save()
            RECORDER.end_phase(flight)
            if saved and self.commits is not None:
                self.commits.after_checkpoint()
        self.vote_or_log()
        return True

    def synchronize_and_update(self) -> None:
        """5. Wait for the reduced gradients, then the same update on every rank. The wait is timed
        apart from the update: it is the step's exposed communication."""
        self.phase = "gradient synchronization"
        step = self.position.step
        flight = RECORDER.begin_phase("gradient synchronization", step)
        waited = time.perf_counter()
        self.strategy.synchronize()
        self.throughput.add_wait(time.perf_counter() - waited)
        RECORDER.end_phase(flight)
        self.phase = "the optimizer step"
        flight = RECORDER.begin_phase("optimizer step", step)
        self.update()
        RECORDER.end_phase(flight)
        self.reporter.after_first_step(self.position.step + 1)
        if self.compile_cache is not None:
            self.compile_cache.after_first_step()
        self.strategy.zero_grad()
        self.lr.step()

    def advance(self) -> None:
        """The position moves one step on; the watchdog, the reporter and the callbacks hear of it."""
        position = self.position
        position.step += 1
        position.epoch_position += self.batching.global_batch_size
        if self.checkpoints is not None:  # (under elastic a rollback can bring the same step number back)
            self.checkpoints.forget_saved_step()
        self.faults.beat(position.step)
        self.reporter.after_step(position.step)
        self.callbacks.call("on_step_end", position.step)

    def evaluate_if_due(self) -> None:
        """train.eval_every, unless this step ends the epoch or the run (whose end evaluates)."""
        every, position = self.config.eval_every, self.position
        if (every and position.step % every == 0 and not self.finished(self.until_step)
                and self.batching.has_steps_left(position.epoch_position)):
            self.evaluate_between_steps()

    def vote_or_log(self) -> None:
        """The preemption and stop votes (every preempt_check_every steps; every rank alike), else,
        every log_every steps, the reduced means reported."""
        step = self.position.step
        preempted, stop = self.faults.votes(step, self.callbacks.stop_reason is not None)
        if preempted:
            self.stop_for_preemption()
            self.interrupted = True
        elif self.callbacks.agreed(stop):
            self.stop_at_this_step()
            self.interrupted = True
        elif step % self.config.log_every == 0:
            totals = self.window.reduce(name="train.window")
            self.epoch_totals += totals
            self.report(totals.means(), self.throughput)

    def update(self) -> None:
        """The synchronized gradients unscaled and checked (fp16: a step with inf/nan on any rank is
        skipped on every rank), clipped, then the strategy's step."""
        strategy = self.strategy
        if self.precision.scaled and not self.precision.unscale_and_check(
                strategy.owned_gradients(), strategy.capabilities.shards_gradients, name="fp16.nonfinite"):
            # Every rank decided alike: rank 0 says it once, the others into their own logs.
            log = self.topology.log
            say = log.warning if self.topology.is_root else log.info
            say(f"step {self.position.step + 1}: inf/nan in the fp16 gradients, step skipped on every rank; "
                f"loss scale now {self.precision.scale:g}")
            self.clip_to = None
            return
        max_norm = self.config.max_grad_norm if self.clip_to is None else self.clip_to
        self.clip_to = None
        if max_norm is not None:
            self.grad_norm = strategy.clip_grad_norm_(max_norm)
        strategy.step()

    def report(self, means: Dict[str, float], throughput: Throughput) -> None:
        """Every log_every steps: the progress display and a step record."""
        samples_per_sec, comm_fraction = throughput.read()
        extra: Dict[str, float] = {"grad_norm": self.grad_norm} if self.config.max_grad_norm is not None else {}
        if self.precision.scaled:
            extra.update(loss_scale=self.precision.scale, skipped_steps=self.precision.skipped_steps)
        position = self.position
        self.reporter.window(position.epoch, self.batching.epoch_progress(position.epoch, position.epoch_position),
                             position.step, means, self.lr.current, samples_per_sec, comm_fraction, extra)
        self.callbacks.call("on_log", position.step, dict(means))

    def evaluate(self) -> Dict[str, float]:
        """The step's loss and metrics over the whole validation set (every rank's shard), as
        val_loss, val_<metric>."""
        if self.batching.val_loader is None:
            return {}
        self.phase = "evaluation"
        strategy = self.strategy
        flight = RECORDER.begin_phase("evaluation", self.position.step)
        try:
            return evaluate(self.model, self.batching.val_loader,
                            lambda _, batch: strategy.forward_only(self.step_fn, batch), self.topology.world.device,
                            self.precision.autocast, after_batch=lambda: self.faults.beat(self.position.step),
                            lockstep=strategy.capabilities.collective_forward, counts_samples=strategy.counts_samples,
                            items=self.evaluation_items())
        finally:
            RECORDER.end_phase(flight)

    def evaluate_between_steps(self) -> None:
        """train.eval_every: the validation metrics now, recorded and printed; training then goes on
        in train mode, with the random streams it had (a model or step that draws random numbers
        while it evaluates does not change the masks training draws next)."""
        if self.batching.val_loader is None:
            return
        device = self.topology.world.device
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            metrics = self.evaluate()
        self.model.train()
        position = self.position
        self.reporter.evaluation({"epoch": position.epoch,
                                  "epochs_done": self.batching.epoch_progress(position.epoch, position.epoch_position),
                                  "step": position.step, **metrics})
        self.callbacks.call("on_evaluation_end", position.step, metrics)
        self.stop_if_agreed("loop.stop.evaluation")

    def stop_if_agreed(self, name: str) -> bool:
        """Every rank: stop when a callback asked on any rank (a vote); the step is checkpointed first."""
        if self.stopped:  # agreed already (every rank alike): the epoch's end after a stop mid-epoch
            return True
        if not self.callbacks.stop_agreed(name):
            return False
        self.stop_at_this_step()
        return True

    def stop_at_this_step(self) -> None:
        """Every rank agreed to stop for a callback: checkpoint this step and end as at max_steps."""
        self.stopped = True
        if self.checkpoints is not None:
            self.checkpoints.save_unless_saved()
        if self.topology.is_root:
            self.topology.log.info(f"stopped at step {self.position.step}: {self.callbacks.stop_reason}")

    def stop_for_preemption(self) -> None:
        """Every rank agreed to stop: checkpoint now, requeue the job (rank 0), and return from fit."""
        if self.checkpoints is None:
            self.topology.log.warning("preemption signal, but no checkpoint_dir: this run cannot be resumed")
        else:
            self.checkpoints.save_unless_saved()
            with self.faults.checkpoint_io():
                self.checkpoints.finish()  # written before the job is requeued (and killed)
        self.preempted = True
        self.faults.requeue_after_preemption(self.position.step)
