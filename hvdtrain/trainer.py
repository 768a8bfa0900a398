"""The data-parallel training loop.

The steps of Horovod data parallelism, in order, each marked where it happens:
  1. every rank starts from rank 0's parameters and optimizer state   (__init__)
  2. each rank reads its own shard, reshuffled every epoch            (_train_epoch)
  3. forward and backward on the shard                                (_train_epoch)
  4. gradients averaged by ring all-reduce during backward            (DistributedOptimizer hooks)
  5. every rank applies the same update                               (optimizer.step)
  6. rank 0 logs; metrics are reduced over every rank's samples       (_log_progress, evaluate)
"""
from __future__ import annotations

import time
from typing import Callable, Dict, List, Optional

import torch
import torch.nn.functional as F
from torch.optim.lr_scheduler import LambdaLR
from torch.utils.data import Dataset

from hvdtrain import dist
from hvdtrain.config import TrainConfig
from hvdtrain.data import ShardedSampler, sharded_loader
from hvdtrain.log import get_logger
from hvdtrain.metrics import RunningLoss, Throughput, evaluation_metrics
from hvdtrain.optim import distributed_optimizer, lr_scale, scale_learning_rate, warmup_factor

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class Trainer:
    """Trains ``model`` with ``optimizer`` on ``train_dataset``, data-parallel over all ranks.

    Build the model and optimizer as for one process, with the learning rate of one worker:
    the Trainer wraps the optimizer, scales the rate and broadcasts rank 0's state.
    ``loss_fn`` takes (outputs, targets) and returns the mean loss of the batch.
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
    ) -> None:
        self.config = config or TrainConfig()
        self.world = world or dist.init(seed=self.config.seed)
        self.log = get_logger(self.world)
        self.loss_fn = loss_fn
        self.model = model.to(self.world.device)
        cfg, world = self.config, self.world

        pin = self.world.device.type == "cuda"
        self.train_loader = sharded_loader(
            train_dataset, cfg.batch_size, world.rank, world.size, cfg.seed,
            train=True, num_workers=cfg.num_workers, pin_memory=pin,
        )
        self.val_loader = None
        if val_dataset is not None:
            self.val_loader = sharded_loader(
                val_dataset, cfg.batch_size, world.rank, world.size, cfg.seed,
                train=False, num_workers=cfg.num_workers, pin_memory=pin,
            )
        # Leftover micro-batches that do not fill an accumulation window are skipped: a
        # backward pass without its optimizer step would leak gradients into the next epoch.
        self.steps_per_epoch = len(self.train_loader) // cfg.accumulation
        if self.steps_per_epoch == 0:
            raise ValueError(
                f"each rank has {len(self.train_loader)} batches per epoch, fewer than "
                f"accumulation={cfg.accumulation}: lower --accumulation or --batch-size, "
                f"or use fewer workers than {world.size}"
            )

        # 4. Horovod's wrapper hooks each gradient for an all-reduce that overlaps backward.
        self.optimizer = distributed_optimizer(
            optimizer, self.model.named_parameters(), cfg.accumulation, cfg.fp16_allreduce
        )
        self.lr_scale = lr_scale(world.size, cfg.accumulation, cfg.scale_lr)
        scale_learning_rate(self.optimizer, self.lr_scale)
        # 1. Rank 0's parameters and optimizer state, everywhere, before the first step.
        dist.broadcast_model_and_optimizer(self.model, self.optimizer, root_rank=0)
        self.warmup_steps = round(cfg.warmup_epochs * self.steps_per_epoch)
        self.scheduler = LambdaLR(self.optimizer, warmup_factor(self.lr_scale, self.warmup_steps))

        self.epoch = 0
        self.step = 0
        self._announce()

    @property
    def sampler(self) -> ShardedSampler:
        return self.train_loader.sampler  # type: ignore[return-value]

    @property
    def global_batch_size(self) -> int:
        return self.config.batch_size * self.config.accumulation * self.world.size

    def _announce(self) -> None:
        w, cfg = self.world, self.config
        self.log.info(
            f"{w.size} workers ({w.cross_size} hosts x {w.local_size}) started by {w.launcher}, "
            f"{w.controller.upper()} controller, {w.threads} threads/rank, device {w.device}"
        )
        # Where every rank runs, in one line: a collective, so every rank calls it.
        hosts = dist.allgather_object(w.hostname, name="trainer.hosts")
        ranks_by_host: Dict[str, List[int]] = {}
        for rank, host in enumerate(hosts):
            ranks_by_host.setdefault(host, []).append(rank)
        self.log.info("ranks per host: " + "; ".join(
            f"{host}: {','.join(map(str, ranks))}" for host, ranks in ranks_by_host.items()))
        self.log.info(
            f"global batch {self.global_batch_size} = {cfg.batch_size} x {cfg.accumulation} "
            f"accumulation x {w.size} workers; {self.steps_per_epoch} steps/epoch; "
            f"lr {cfg.lr:g} x {self.lr_scale:g} after {self.warmup_steps} warm-up steps"
        )

    def _finished(self) -> bool:
        return self.config.max_steps is not None and self.step >= self.config.max_steps

    def fit(self) -> List[Dict[str, float]]:
        """Train to the configured epochs (or max_steps); returns one metrics dict per epoch.

        Every rank returns the same history: all values are reduced across ranks.
        """
        history: List[Dict[str, float]] = []
        while self.epoch < self.config.epochs and not self._finished():
            started = time.perf_counter()
            train_loss, samples = self._train_epoch()
            elapsed = time.perf_counter() - started
            self.epoch += 1
            record = {
                "epoch": self.epoch,
                "step": self.step,
                "train_loss": train_loss,
                "samples_per_sec": samples / elapsed,
                "lr": self.optimizer.param_groups[0]["lr"],
                **self.evaluate(),
            }
            history.append(record)
            self.log.info(
                f"epoch {self.epoch}/{self.config.epochs} step {self.step} "
                f"train_loss {train_loss:.4f}"
                + (f" val_loss {record['val_loss']:.4f} val_accuracy {record['val_accuracy']:.4f}"
                   if "val_accuracy" in record else "")
                + f" {record['samples_per_sec']:.0f} samples/s"
            )
        return history

    def _train_epoch(self) -> tuple:
        """One pass over this rank's shard; returns (mean train loss over all ranks, global samples)."""
        cfg, device = self.config, self.world.device
        # 2. A new permutation each epoch, the same on every rank; each rank takes its slice.
        self.sampler.set_epoch(self.epoch)
        self.model.train()
        window = RunningLoss(device)
        throughput = Throughput(self.world.size)
        epoch_loss_sum = epoch_count = 0.0
        usable_batches = self.steps_per_epoch * cfg.accumulation

        for index, (inputs, targets) in enumerate(self.train_loader):
            if index >= usable_batches or self._finished():
                break
            inputs = inputs.to(device, non_blocking=True)
            targets = targets.to(device, non_blocking=True)
            # 3. Forward and backward on this rank's micro-batch; Horovod's hooks start each
            #    gradient's all-reduce as soon as backward has produced it.
            loss = self.loss_fn(self.model(inputs), targets)
            (loss / cfg.accumulation if cfg.accumulation > 1 else loss).backward()
            window.add(loss, len(targets))
            throughput.add(len(targets))
            if (index + 1) % cfg.accumulation:
                continue
            # 5. Wait for the averaged gradients, then the same update on every rank.
            self.optimizer.step()
            self.optimizer.zero_grad()
            self.scheduler.step()
            self.step += 1
            if self.step % cfg.log_every == 0:
                loss_sum, count = window.reduce(name="train.window_loss")
                epoch_loss_sum, epoch_count = epoch_loss_sum + loss_sum, epoch_count + count
                self._log_progress(loss_sum / count, throughput.read())

        loss_sum, count = window.reduce(name="train.epoch_loss")
        epoch_loss_sum, epoch_count = epoch_loss_sum + loss_sum, epoch_count + count
        mean = epoch_loss_sum / epoch_count if epoch_count else float("nan")
        return mean, epoch_count

    def _log_progress(self, loss: float, samples_per_sec: float) -> None:
        self.log.info(
            f"epoch {self.epoch + 1} step {self.step} loss {loss:.4f} "
            f"lr {self.optimizer.param_groups[0]['lr']:.4g} {samples_per_sec:.0f} samples/s"
        )

    @torch.no_grad()
    def evaluate(self) -> Dict[str, float]:
        """Validation loss and accuracy over the whole validation set (every rank's shard)."""
        if self.val_loader is None:
            return {}
        self.model.eval()
        device = self.world.device
        loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        correct = torch.zeros((), dtype=torch.int64, device=device)
        count = 0
        for inputs, targets in self.val_loader:
            inputs, targets = inputs.to(device), targets.to(device)
            outputs = self.model(inputs)
            loss_sum += self.loss_fn(outputs, targets).to(torch.float64) * len(targets)
            correct += (outputs.argmax(dim=1) == targets).sum()
            count += len(targets)
        return evaluation_metrics(float(loss_sum), int(correct), count, name="val.metrics")
