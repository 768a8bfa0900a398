"""A training session for your own loop, Horovod-style (``hvdtrain.setup`` builds it): the parts
of a run (hvdtrain.parts: topology, strategy, batching, LR, checkpoints, reporter, faults, loop) and
the calls of a loop written over them. The Trainer holds the same parts and runs hvdtrain's loop
(hvdtrain.trainer): both run the same epochs, batches and steps (hvdtrain.loop).

    hv = hvdtrain.setup(model, optimizer, train_set, config)
    for epoch in hv.epochs():             # from where a resumed run stopped
        for inputs, targets in hv.batches():   # this rank's shard, on its device
            loss = F.cross_entropy(hv.model(inputs), targets)
            hv.backward(loss)
            hv.step()                     # synchronize, clip, step, zero, LR, checkpoints, logs
"""
from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path
from typing import Any, Callable, Iterator, List, Mapping, Optional

import torch
from torch.optim.lr_scheduler import LRScheduler
from torch.utils.data import DataLoader, Dataset

from hvdtrain.checkpoint import CheckpointError
from hvdtrain.checkpoint.coordination import Checkpointing
from hvdtrain.checkpoint.formats.run_state import RunState
from hvdtrain.components.frozen import prepare_frozen
from hvdtrain.config.train import TrainConfig
from hvdtrain.distributed import user_collectives
from hvdtrain.distributed.environments import is_elastic_launch
from hvdtrain.parts import PartsHolder


class Session(PartsHolder):
    """``model`` and ``optimizer`` set up to train on ``train_dataset``, data-parallel over all ranks,
    for your own loop (``hvdtrain.setup``: epochs, batches, backward, step).

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
    (hvdtrain.components.callbacks; EarlyStopping is one), given this session. ``lr_scheduler(optimizer)
    -> scheduler``, or ``lr_scheduler(optimizer, total_steps)`` given the run's optimizer steps: your own
    LR schedule, built over the optimizer the strategy steps once its rates are scaled to the global
    batch, stepped after every optimizer step and kept in checkpoints; it replaces train.warmup_epochs,
    train.warmup_steps and train.lr_schedule (leave them at their defaults: 0, null and constant).
    ``loader_factory(dataset, sampler, batch_size) -> DataLoader``: your own loaders (any DataLoader
    argument: workers, persistent_workers, worker_init_fn, collate_fn...) over hvdtrain's sampler and
    batch size, for training and evaluation; a loader that does not read through them is refused.

    A model built under ``torch.device("meta")`` (and its optimizer over it) takes no memory until
    the session gives it values from ``train.seed``: the modules' own initialization, then Hugging
    Face's or ``init_fn(module)``, equal to the model built whole; under fsdp each rank computes
    its shards with one unit in memory at a time, never the whole model
    (hvdtrain.strategies.deferred_init).

    The parts it is made of (strategy, batching, checkpoints...) are ``parts`` (hvdtrain.parts).
    """

    own_loop = True
    _training = False  # inside epochs(): save_state/load_state wait until it ends

    # --- what users read --------------------------------------------------------------------------

    @property
    def device(self) -> torch.device:
        """This rank's device: batches() are moved to it, and the model lives there."""
        return self.parts.world.device

    @property
    def steps_per_epoch(self) -> Optional[int]:
        """Optimizer steps in an epoch at the global batch (None: a stream without len())."""
        return self.parts.batching.steps_per_epoch

    @property
    def total_steps(self) -> Optional[int]:
        """The run's optimizer steps: train.epochs' at the global batch, or train.max_steps if sooner;
        what a schedule of your own decays over (None: a stream without len() and no max_steps)."""
        return self.parts.batching.total_steps

    # --- your own loop ----------------------------------------------------------------------------

    def epochs(self, until_step: Optional[int] = None) -> Iterator[int]:
        """The epochs to train, from where a resumed run stopped, up to train.epochs (or max_steps, or
        ``until_step``). At each epoch's end: its record (``history``, metrics.jsonl), the evaluation of
        the validation set if one was given, the epoch's checkpoint and the callbacks. Iterate over
        batches() inside; end early only through request_stop() or a step limit, on every rank."""
        parts = self.parts
        parts.begin_training(until_step)
        self._training = True
        try:
            yield from parts.loop.epochs(until_step)
        finally:
            self._training = False
            parts.end_training()
        parts.callbacks.call("on_train_end", self.history)

    def batches(self) -> Iterator[Any]:
        """This rank's batches of the current epoch, on its device: its shard of the epoch's order
        (the same order at any worker count), from where a resumed epoch stopped. Run forward and
        backward() on each, then step()."""
        if self.parts.loop.epoch_done:
            raise RuntimeError("batches() belongs inside an epoch: iterate over them in `for epoch in hv.epochs():`")
        return self.parts.loop.batches()

    def autocast(self) -> contextlib.AbstractContextManager:
        """The forward's mixed precision (train.precision): ``with hv.autocast(): loss = ...``."""
        return self.parts.precision.autocast()

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of the micro-batch's mean loss (scaled for fp16, divided over train.accumulation);
        the strategy's hooks start the gradients' reduction as backward produces them. The loss
        also goes into the reported means."""
        parts = self.parts
        parts.loop.record(loss.detach(), {})
        scaled = parts.precision.scale_loss(loss)
        accumulation = parts.config.accumulation
        parts.strategy.backward(scaled / accumulation if accumulation > 1 else scaled)

    def step(self) -> bool:
        """After each backward(): at the last micro-batch of train.accumulation, the same update on
        every rank (gradients synchronized, fp16 unscaled and checked, clipped to train.max_grad_norm,
        stepped and zeroed, the LR schedule advanced), then what follows a step: train.checkpoint_every,
        train.eval_every, the logs and the preemption and stop votes. Returns whether it stepped."""
        return self.parts.loop.step()

    def clip_grad_norm_(self, max_norm: float) -> None:
        """Clip the coming step's gradients to a whole-model norm of at most ``max_norm``: call it
        between backward() and step(), as Accelerate's. The clip itself runs inside step(), once the
        gradients are reduced over every rank (fp16: unscaled and checked), at the last micro-batch of
        train.accumulation, by the strategy (a sharded gradient counted once): clipping here, before
        the reduction, would clip each rank's own gradients. The norm measured before clipping is
        ``grad_norm`` after step(). Refused with train.max_grad_norm, which clips every step already."""
        if self.parts.config.max_grad_norm is not None:
            raise ValueError(f"clip_grad_norm_({max_norm}): train.max_grad_norm="
                             f"{self.parts.config.max_grad_norm} clips every step already, and the gradients "
                             f"would be clipped twice: set train.max_grad_norm=null to clip in your loop, or "
                             f"drop this call")
        if not (isinstance(max_norm, (int, float)) and not isinstance(max_norm, bool) and max_norm > 0):
            raise ValueError(f"clip_grad_norm_({max_norm!r}): give a positive number")
        self.parts.loop.clip_to = float(max_norm)

    def prepare_model(self, model: torch.nn.Module) -> torch.nn.Module:
        """A second model your loop runs but does not train (a distillation teacher, a frozen
        reference), returned ready: rank 0's weights on every rank, on this rank's device, eval(),
        requires_grad off; run it under torch.no_grad(). Build the same model on every rank. It is
        held whole on each rank under every strategy, and not checkpointed: build or load it again
        on every start. A model the session trains is refused (several trained models are not
        supported: see setup). A collective: every rank calls it."""
        parts = self.parts
        trained = list(parts.model.parameters()) + [p for group in parts.given_optimizer.param_groups
                                                    for p in group["params"]]
        return prepare_frozen(model, parts.world.device, trained, "prepare_model")

    @property
    def grad_norm(self) -> float:
        """The whole model's gradient norm before clipping, at the last step that clipped (nan before)."""
        return self.parts.loop.grad_norm

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
            self.parts.kept[name] = value
            self.parts.checkpoints.restore_kept(name)

    def _check_kept_scheduler(self, name: str, scheduler: LRScheduler) -> None:
        """A scheduler you step yourself must set the rates of the optimizer the strategy steps, and
        be the only one that does: either mistake would leave your schedule silently unused."""
        parts = self.parts
        stepped = {id(group) for group in parts.optimizer.param_groups}
        drives = any(id(group) in stepped for group in scheduler.optimizer.param_groups)
        if not drives and scheduler.optimizer is parts.given_optimizer:
            raise ValueError(f"keep({name}=...): this scheduler sets the rates of the optimizer you built, which is "
                             f"not the one the session steps (train.strategy={parts.config.strategy} steps one of "
                             f"its own, hv.optimizer): build the scheduler over hv.optimizer")
        if drives and not parts.lr.rate_fixed and scheduler is not parts.lr.scheduler:
            ours = ("your lr_scheduler" if parts.lr.factory is not None else
                    f"a warm-up of {parts.lr.warmup_steps} steps and train.lr_schedule={parts.config.lr_schedule}")
            raise ValueError(f"keep({name}=...): hvdtrain's own schedule ({ours}) sets this optimizer's rates after "
                             f"every step, over what your {type(scheduler).__name__} sets. To step it yourself, set "
                             f"train.warmup_epochs=0, train.warmup_steps=null and train.lr_schedule=constant "
                             f"(hvdtrain then scales the rates once and leaves them to you); or give it to setup as "
                             f"lr_scheduler=lambda optimizer: ..., which hvdtrain steps and keeps")

    def save(self) -> None:
        """A checkpoint of this step into train.checkpoint_dir, now (every rank calls it)."""
        if self.parts.checkpoints.protocol is None:
            raise ValueError("save() writes into train.checkpoint_dir, and none is set: set it (the runs of one "
                             "job share it; a rerun resumes from the newest checkpoint there)")
        self.parts.checkpoints.save_unless_saved()

    def save_state(self, path) -> None:
        """A checkpoint of this step into the directory ``path`` (Accelerate's name), written now (not
        in the background) as save() writes into train.checkpoint_dir: the same files (atomic, checksummed; a sharded
        train.checkpoint_format under zero and fsdp too), kept train.keep_checkpoints deep, the
        directory claimed by this run while it writes. Full format: rank 0 writes, so ``path`` may be
        on rank 0's own storage; sharded: every rank writes its part, so it must be storage every
        rank shares. Every rank calls it, with the same path. load_state(path) continues from it."""
        with self._checkpoints_at(path, "save_state") as checkpoints:
            checkpoints.save()

    def load_state(self, path) -> None:
        """Continue from the newest checkpoint in the directory ``path`` (save_state's, or any
        train.checkpoint_dir's): the model, the optimizer, the position in the data, the LR
        schedule, fp16's scale, the RNG states, the callbacks' and keep()'s states, checked against
        their checksums and this run's settings as a resume is. The loop then continues bitwise as
        the saved run would have. Full format: rank 0 reads and broadcasts; sharded: every rank
        reads the files (shared storage). Call it outside epochs(), on every rank, with the same
        path, at the global batch the checkpoint was written with."""
        with self._checkpoints_at(path, "load_state") as checkpoints:
            state = checkpoints.protocol.start(broadcast=True)
            if state is None:
                raise CheckpointError(f"load_state({str(path)!r}): no checkpoint there; save_state(path) writes one")
            saved, batch = RunState.from_checkpoint(state), self.parts.batching.global_batch_size
            if saved.global_batch != batch:
                raise ValueError(f"load_state({str(path)!r}): the checkpoint was written at a global batch of "
                                 f"{saved.global_batch}, this run takes {batch}: set train.batch_size so that "
                                 f"it is {saved.global_batch} (batch_size x accumulation x data-parallel ranks), "
                                 f"or resume through train.checkpoint_dir, which adapts the batch")
            checkpoints.load(state)

    @contextlib.contextmanager
    def _checkpoints_at(self, path, call: str) -> Iterator[Any]:
        """This session's checkpoints through the directory ``path``, released afterwards."""
        parts = self.parts
        if getattr(self, "_training", False):
            raise RuntimeError(f"{call}(path) belongs outside epochs(): inside, the loop's position would "
                               f"change under it; call it before or after `for epoch in hv.epochs():`")
        own = parts.config.checkpoint_dir
        if own and Path(own).resolve() == Path(path).resolve():
            raise ValueError(f"{call}({str(path)!r}) is train.checkpoint_dir, which this run owns: use save() "
                             f"(a rerun resumes from there by itself), or give another directory")
        # Written at once (not in the background), and read whatever train.resume says of the run's own
        # directory; train.resume=force still lets a checkpoint of other settings load.
        resume = "force" if parts.config.resume == "force" else "true"
        config = dataclasses.replace(parts.config, checkpoint_dir=str(path), checkpoint_async=False, resume=resume)
        protocol = Checkpointing(config, parts.topology, parts.job_config)
        try:
            yield parts.checkpoints.through(protocol)
        finally:
            protocol.close()

    # --- what a loop of your own reaches for (Accelerate's and Fabric's helpers, by hvdtrain's names) ---

    @property
    def is_main_process(self) -> bool:
        """Whether this is rank 0, the rank that logs, prints and writes the run's files."""
        return self.parts.world.is_root

    def print(self, *args: Any, **kwargs: Any) -> None:
        """print() on rank 0 only (the other ranks print nothing), flushed at once."""
        if self.is_main_process:
            print(*args, **{"flush": True, **kwargs})

    def gather(self, values: Any) -> Any:
        """Every rank's tensors concatenated along the first dimension, in rank order, on every rank
        (uneven row counts allowed; a number becomes one row per rank; dicts, lists and tuples of
        tensors alike). A collective: every rank calls it."""
        return user_collectives.gather(values)

    def reduce(self, values: Any, op: str = "mean") -> Any:
        """Every rank's tensors combined element by element on every rank: ``mean``, ``sum``, ``max``
        or ``min`` (dicts, lists and tuples of tensors alike). A collective: every rank calls it."""
        return user_collectives.reduce(values, op)

    def barrier(self) -> None:
        """Every rank waits here until all have arrived."""
        user_collectives.barrier()

    def main_process_first(self) -> contextlib.AbstractContextManager:
        """``with hv.main_process_first(): ...``: rank 0 runs the block, then the others (a download
        or a cache filled once, read by all)."""
        return user_collectives.main_process_first(self.is_main_process)

    def log(self, values: Mapping[str, Any], step: Optional[int] = None) -> None:
        """Your metrics into the run's records (metrics.jsonl and train.loggers: TensorBoard, CSV,
        MLflow, W&B) as a ``log`` record at ``step`` (default: the optimizer steps taken so far),
        written by rank 0; numbers or one-element tensors. Not a collective: reduce() first what
        every rank holds a part of."""
        record = {}
        for key, value in values.items():
            if isinstance(value, torch.Tensor):
                if value.numel() != 1:
                    raise ValueError(f"log({key}=...): a tensor of {value.numel()} elements; log numbers "
                                     f"(reduce() or .mean() it first)")
                value = value.item()
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                raise TypeError(f"log({key}=...): a number, got {type(value).__name__}")
            record[key] = value
        if not self.is_main_process:
            return
        reporter = self.parts.reporter
        if reporter.path is None and not getattr(self, "_said_no_run_dir", False):
            self._said_no_run_dir = True
            self.parts.topology.log.warning("log(): train.run_dir is null, so the run keeps no records and these "
                                            "values go nowhere: set train.run_dir (e.g. runs)")
        reporter.record("log", {"step": self.parts.position.step if step is None else step, **record})

    def loader(self, dataset: Dataset, batch_size: Optional[int] = None,
               collate_fn: Optional[Callable[[List[Any]], Any]] = None) -> DataLoader:
        """Another data set (a test set), cut into one shard per data-parallel rank, in order, each
        sample once; batches of train.eval_batch_size (else the training batch) unless given, made by
        the session's collate_fn (or loader_factory) unless another collate_fn is given."""
        return self.parts.batching.evaluation_loader(dataset, batch_size, collate_fn)

def setup(model: torch.nn.Module, optimizer: torch.optim.Optimizer, train_dataset: Dataset,
          config: Optional[TrainConfig] = None, **options: Any) -> Session:
    """A Session for your own loop: ``model`` and ``optimizer`` (one worker's, as for one process)
    handed to ``config.strategy``, rank 0's state broadcast, the rates scaled to the global batch,
    ``train_dataset`` sharded over the ranks, and the newest checkpoint in train.checkpoint_dir
    resumed. Every rank calls it.

    What needs hvdtrain's own loop is refused here, before any collective: pipeline parallelism
    (its schedule runs forward and backward together: use the Trainer) and Horovod elastic (a world
    change restarts the loop from a commit: use the Trainer).

    Args:
        model: built as for one process (on the meta device too).
        optimizer: over ``model``, with the learning rate of one worker.
        train_dataset: the whole training set; each rank reads its shard.
        config: the ``train`` section (default: TrainConfig()).
        options: the Session's other arguments (val_dataset, world, job_config, collate_fn, callbacks,
            lr_scheduler, model_plan, init_fn, loader_factory, loss_fn or step_fn for evaluate()).
    """
    config = config or TrainConfig()
    refuse_several(model, optimizer)
    if config.pipeline_parallel > 1:
        raise ValueError("train.pipeline_parallel > 1 runs forward and backward together in the pipeline's schedule, "
                         "which your own loop cannot interleave: use hvdtrain.Trainer (loss_fn, or dict batches with "
                         "labels for a Hugging Face model), or tensor_parallel in your own loop")
    if is_elastic_launch():
        raise ValueError("your own loop under Horovod elastic (--min-np/--max-np) is not supported: a world change "
                         "rolls the loop back to a commit, which hvdtrain.Trainer does; launch with a fixed -np")
    return Session(model, optimizer, train_dataset, config=config, **options)


def refuse_several(model: Any, optimizer: Any) -> None:
    """One model and one optimizer per session: several (a GAN's generator and discriminator, each
    with its optimizer) would each need their own strategy, gradient reduction, clipping and
    checkpoint part, which a session does not hold. Refused before any collective."""
    several = ("several models or optimizers (a GAN's two, a model and its teacher) are not supported by one "
               "session: give one nn.Module and one optimizer over its parameters (wrap the models in one "
               "nn.Module whose forward runs them, with one optimizer and per-group learning rates); a model you "
               "do not train (a teacher) goes through hv.prepare_model(teacher) after setup")
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"setup(model=...): a {type(model).__name__}, not an nn.Module: {several}")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"setup(optimizer=...): a {type(optimizer).__name__}, not a torch.optim.Optimizer: {several}")
