"""The Trainer's loop: epochs, and in each the steps of data parallelism (2., 3. and 5. of
hvdtrain.trainer's list), with what is reported along the way.

A part of the Trainer (its base class), kept in a file of its own so that the loop reads in one
place: batches to the device, forward under the precision's autocast, the strategy's backward,
synchronize, the update (fp16's check, clipping, the step), the LR schedule, checkpoints,
preemption, and the reductions of loss and metrics every log_every steps.
"""
from __future__ import annotations

import time
from typing import Dict, List

from hvdtrain.training.metrics import RunningMeans, Throughput, Totals
from hvdtrain.observability.reporting import epoch_line
from hvdtrain.training.steps import batch_size, to_device


class TrainingLoop:
    """The loop of a Trainer (which provides every attribute used here)."""

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
        throughput = Throughput(self.batching.world.size)  # data-parallel width: distinct samples
        epoch_totals = Totals()

        for index, batch in enumerate(self.batching.train_loader):
            if self._finished():
                break
            batch = to_device(batch, device)
            samples = batch_size(batch)
            # 3. Forward and backward on this rank's micro-batch; the strategy's hooks start each
            #    gradient's reduction as soon as backward has produced it.
            self._phase = "the forward and backward pass"
            loss, metrics = strategy.forward_backward(self.step_fn, batch, self.precision.autocast,
                                                      self.precision.scale_loss, cfg.accumulation)
            window.add(loss, metrics, samples if strategy.counts_samples else 0)
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
            # Every rank decided alike: rank 0 says it once, the others into their own logs.
            say = self.log.warning if self.world.is_root else self.log.info
            say(f"step {self.step + 1}: inf/nan in the fp16 gradients, step skipped on every rank; "
                f"loss scale now {self.precision.scale:g}")
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
