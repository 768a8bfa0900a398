"""The learning rate of data parallelism: one worker's rate scaled to the global batch, warmed up,
then held (constant) or decayed to a fraction of it by the run's last step (linear, cosine, or wsd:
warm-up, stable, then a linear decay over the last part of the run).

One step over N workers x batch B sees N*B samples: the linear scaling rule (Goyal et al. 2017)
multiplies the rate by N (and by the accumulated micro-batches), reached by a linear warm-up from
one worker's rate. A rate that is not scaled (one worker, scale_lr=false) warms up from its peak
divided by the warm-up's steps. Under Adasum the rate is not scaled by the workers (Adasum adds
orthogonal updates and averages parallel ones; Horovod's rule: one worker's rate over MPI, times
the GPUs per host with NCCL).
"""
from __future__ import annotations

import inspect
import math
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
from torch.optim.lr_scheduler import LambdaLR, LRScheduler

from hvdtrain.config.train import TrainConfig
from hvdtrain.distributed import collectives
from hvdtrain.distributed.world import World


def lr_scale(global_batch: int, base_batch: int, enabled: bool, reduction: str = "average",
             workers: int = 1, adasum_factor: int = 1) -> float:
    """How many one-worker batches one step sees: workers x accumulation, in the usual case.

    Measured in samples, so a run resumed on another worker count with the same global batch
    (and so a smaller or larger batch per worker) keeps the learning rate it had.
    Under Adasum, only one worker's own samples count (its accumulation), times ``adasum_factor``.

    Args:
        global_batch: samples per optimizer step, every worker's together.
        base_batch: one worker's micro-batch, in samples.
        enabled: train.scale_lr; False: 1.
        reduction: average or adasum.
        workers: data-parallel workers.
        adasum_factor: adasum_lr_factor: 1 over MPI, the GPUs per host with NCCL.
    """
    if not enabled:
        return 1.0
    if reduction == "adasum":
        return global_batch / workers / base_batch * adasum_factor
    return global_batch / base_batch


def adasum_lr_factor(device_type: str, nccl_built: bool, local_size: int) -> int:
    """Horovod's rule for the LR under Adasum: on GPUs with NCCL the ranks of a host are averaged
    (NCCL) before Adasum combines the hosts, so scale by the GPUs per host; otherwise (MPI, every
    rank combined by Adasum) do not scale by the workers at all."""
    return local_size if device_type == "cuda" and nccl_built else 1


def warmup_start(scale: float, warmup_steps: int) -> float:
    """The warm-up's multiplier on the scaled LR at step 0 (1: no warm-up).

    Scaled (``scale`` > 1): 1/scale, so training starts at one worker's rate, from which Goyal et
    al. ramp to the scaled one. Not scaled (one worker, scale_lr=false; or below 1, a run resumed
    under Adasum on more workers): no smaller rate is known to be safe, so 1/warmup_steps, as
    transformers' get_linear_schedule_with_warmup ramps from 0, but without its step at rate 0.
    """
    if scale <= 0:
        raise ValueError(f"LR scale must be positive, got {scale}")
    if warmup_steps <= 0:
        return 1.0
    return 1.0 / scale if scale > 1.0 else 1.0 / warmup_steps


def warmup_factor(scale: float, warmup_steps: int) -> Callable[[int], float]:
    """Multiplier on the scaled LR at each step: warmup_start at step 0, rising linearly to 1 at
    step ``warmup_steps``, then 1. The optimizer's LR is already multiplied by ``scale``."""
    start = warmup_start(scale, warmup_steps)
    if start == 1.0:
        return lambda step: 1.0

    def factor(step: int) -> float:
        progress = min(1.0, step / warmup_steps)
        return start + (1.0 - start) * progress

    return factor


def decay_factor(schedule: str, warmup_steps: int, total_steps: int, min_ratio: float,
                 decay_fraction: float) -> Callable[[int], float]:
    """Multiplier on the peak LR after the warm-up: 1 until the decay starts (at the warm-up's end;
    wsd: at the last ``decay_fraction`` of ``total_steps``), then down to ``min_ratio`` at
    ``total_steps``, and ``min_ratio`` beyond it (a run extended past its planned end).

    Args:
        schedule: constant, linear, cosine or wsd.
        warmup_steps: optimizer steps of warm-up, where a linear or cosine decay starts.
        total_steps: the run's optimizer steps.
        min_ratio: the multiplier at the end.
        decay_fraction: wsd: the share of ``total_steps`` spent decaying, at the end.
    """
    if schedule == "constant":
        return lambda step: 1.0
    start = max(warmup_steps, total_steps - round(decay_fraction * total_steps)) if schedule == "wsd" else warmup_steps
    length = total_steps - start

    def factor(step: int) -> float:
        if step <= start:
            return 1.0
        if length <= 0 or step >= total_steps:
            return min_ratio
        progress = (step - start) / length
        shape = 0.5 * (1.0 + math.cos(math.pi * progress)) if schedule == "cosine" else 1.0 - progress
        return min_ratio + (1.0 - min_ratio) * shape

    return factor


def set_scaled_lr(optimizer: torch.optim.Optimizer, base_lrs: Sequence[float], scale: float) -> None:
    """Each group's rate = its one-worker rate x scale (also as the scheduler's initial_lr)."""
    for group, base in zip(optimizer.param_groups, base_lrs):
        group["lr"] = group["initial_lr"] = base * scale


def configured_rates(optimizer: torch.optim.Optimizer, lr: Optional[float]) -> List[float]:
    """One worker's peak rate of every parameter group: the optimizer's own, or, with train.lr set,
    train.lr for the first group and the same multiple of their own for the others (a head at 10x
    the body's rate stays at 10x)."""
    own = [float(group["lr"]) for group in optimizer.param_groups]
    if lr is None:
        return own
    if not own[0] > 0:
        raise ValueError(f"train.lr={lr:g} scales the optimizer's rates by the first parameter group's, which is "
                         f"{own[0]:g}: give that group a rate > 0, or leave train.lr unset (null) to keep the "
                         f"optimizer's own rates")
    return [lr * rate / own[0] for rate in own]


SchedulerFactory = Callable[..., LRScheduler]  # (optimizer) or (optimizer, total_steps)


def wants_total_steps(factory: SchedulerFactory) -> bool:
    """Whether your scheduler factory requires the run's total steps after the optimizer, as most
    schedules need (transformers' get_cosine_schedule_with_warmup, torch's OneCycleLR):
    ``lambda optimizer, total_steps: ...``. Only a second parameter without a default counts: a
    scheduler class or a functools.partial given as the factory has defaulted ones (ConstantLR's
    factor, a partial's keywords), which the total must not fill silently."""
    try:
        parameters = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature: the one-argument form
        return False
    required = [p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
                and p.default is p.empty]
    return len(required) >= 2


class LearningRate:
    """The optimizer's rates for one global batch: one worker's rates (as the user built the
    optimizer) times the scale, warmed up, then following train.lr_schedule; started again when
    the global batch changes. With ``factory`` (the user's scheduler over the optimizer the strategy
    steps, built once its rates are scaled) that scheduler replaces the warm-up and train.lr_schedule."""

    def __init__(self, config: TrainConfig, optimizer: torch.optim.Optimizer,
                 factory: Optional[SchedulerFactory] = None) -> None:
        self.config = config
        self.optimizer = optimizer
        self.factory = factory
        self.base_lrs: List[float] = configured_rates(optimizer, config.lr)  # one worker's
        self.scale = 1.0
        self.rate_fixed = False  # start() decides
        self.scheduler: LRScheduler  # hvdtrain's LambdaLR, or the user's own

    def start(self, global_batch: int, warmup_steps: int, world: World, step: int,
              total_steps: Optional[int]) -> None:
        """Scale the peak rates to this world's global batch and set the schedule, continuing at ``step``.

        Args:
            global_batch: samples per optimizer step, every worker's together.
            warmup_steps: optimizer steps of warm-up.
            world: the data-parallel view of the world.
            step: the optimizer step to continue at (0: the start).
            total_steps: the run's optimizer steps (None: unknown, a stream without len(); the
                schedule is then constant, Batching refuses a decay).
        """
        config = self.config
        self.world = world
        adasum = self._adasum_factor() if config.reduction == "adasum" else 1
        self.scale = lr_scale(global_batch, config.batch_size, config.scale_lr, config.reduction, world.size, adasum)
        self.warmup_steps, self.total_steps = warmup_steps, total_steps
        set_scaled_lr(self.optimizer, self.base_lrs, self.scale)
        # Constant without warm-up, the rate never changes after this: step() then leaves it alone, so
        # that a scheduler your own loop steps drives it (the step count still advances: checkpoints
        # record it). Decided here, once, not in every step.
        self.rate_fixed = self.factory is None and not warmup_steps and config.lr_schedule == "constant"
        if self.factory is not None:
            if step:  # the Trainer refuses what would restart it mid-run (Horovod elastic)
                raise RuntimeError(f"a scheduler of your own starts at step 0, not {step}: its state resumes it")
            if wants_total_steps(self.factory):
                if total_steps is None:
                    raise ValueError("your lr_scheduler takes the run's total steps, and this stream has no len() to "
                                     "count them by: set train.max_steps, or give the stream a __len__")
                self.scheduler = self.factory(self.optimizer, total_steps)
            else:
                self.scheduler = self.factory(self.optimizer)
            if not isinstance(self.scheduler, LRScheduler):
                raise TypeError(f"lr_scheduler must return a torch LR scheduler over the optimizer it is given, "
                                f"got {type(self.scheduler).__name__}")
            return
        warmup = warmup_factor(self.scale, warmup_steps)
        decay = decay_factor(config.lr_schedule, warmup_steps, total_steps, config.min_lr_ratio, config.decay_fraction)
        self.scheduler = LambdaLR(self.optimizer, lambda at: warmup(at) * decay(at), last_epoch=step - 1)

    def step(self) -> None:
        if self.rate_fixed:
            self.scheduler.last_epoch += 1
            return
        self.scheduler.step()

    @property
    def current(self) -> float:
        return self.optimizer.param_groups[0]["lr"]

    def state_dict(self) -> Dict[str, Any]:
        return self.scheduler.state_dict()

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state)

    def _describe_warmup(self) -> str:
        """Where the warm-up starts, and why there (warmup_start)."""
        if not self.warmup_steps:
            return ", no warm-up"
        start = warmup_start(self.scale, self.warmup_steps)
        rates = "/".join(f"{rate * self.scale * start:g}" for rate in dict.fromkeys(self.base_lrs))
        origin = "one worker's rate" if self.scale > 1.0 else f"peak / {self.warmup_steps}"
        text = f" after {self.warmup_steps} warm-up steps from {rates} ({origin})"
        if self.total_steps is not None and self.warmup_steps > self.total_steps:
            text += f" (longer than the run's {self.total_steps} steps: the peak is never reached)"
        return text

    def _adasum_factor(self) -> int:
        return adasum_lr_factor(self.world.device.type, collectives.nccl_built(), self.world.local_size)

    def describe(self) -> str:
        """The start line's part: the rate, its scale and warm-up, and Adasum's rule when it applies."""
        config = self.config
        rates = "/".join(f"{rate:g}" for rate in dict.fromkeys(self.base_lrs))
        peaks = "/".join(f"{rate * self.scale:g}" for rate in dict.fromkeys(self.base_lrs))
        source = "train.lr" if config.lr is not None else "the optimizer's"
        # A port from DDP, Accelerate or Lightning does not expect the rate to move: say why it did.
        why = (" for the global batch: train.scale_lr, false keeps your rate"
               if config.scale_lr and self.scale != 1.0 and config.reduction != "adasum" else "")
        rates = f"peak lr {peaks} ({source} {rates} x {self.scale:g}{why})"
        if self.factory is not None:
            return f"{rates}, then your {type(self.scheduler).__name__}"
        text = f"{rates}{self._describe_warmup()}"
        if config.lr_schedule != "constant":
            text += f", {config.lr_schedule} decay to x {config.min_lr_ratio:g} at step {self.total_steps}"
        if config.reduction != "adasum" or not config.scale_lr:
            return text
        factor = self._adasum_factor()
        how = (f" x {factor} GPUs per host: Horovod's rule for Adasum with NCCL, which averages within a host"
               if factor > 1 else ": Horovod's rule for Adasum over MPI")
        return (text + f" (the lr is not scaled by the {self.world.size} workers, only by one worker's batch x "
                f"accumulation{how})")
