"""The Trainer's checkpoints: what one holds to continue exactly, and putting it back.

A checkpoint holds the strategy's model and optimizer state, the run state (hvdtrain.checkpoint.
formats.run_state: where the run is, the LR schedule, fp16's loss scale, the settings) and every rank's RNG
states. A resumed run takes back a full checkpoint, or each rank its own part of a sharded one.
Across ranks: hvdtrain.checkpoint.coordination; how a strategy reads what it keeps: Strategy.load_from
and hvdtrain.checkpoint.sources.
"""
from __future__ import annotations

import contextlib
import copy
from typing import Any, Callable, ContextManager, Dict, Mapping, Optional

from hvdtrain.checkpoint import FORMAT_VERSION
from hvdtrain.checkpoint.formats import kept as kept_state
from hvdtrain.checkpoint.coordination import Checkpointing
from hvdtrain.checkpoint.formats.run_state import RunState, expert_parallel_of
from hvdtrain.checkpoint.formats.sharded import is_sharded, resumes_as_written
from hvdtrain.checkpoint.sources.full import FullStateSource
from hvdtrain.common.capabilities import EVERY_PART
from hvdtrain.config.train import TrainConfig
from hvdtrain.data.batching import Batching
from hvdtrain.distributed import rng
from hvdtrain.distributed import collectives
from hvdtrain.parallel.topology import Topology
from hvdtrain.strategies.base import Strategy
from hvdtrain.components.callbacks import Callbacks
from hvdtrain.components.lr import LearningRate
from hvdtrain.components.position import Position
from hvdtrain.components.precision import Precision


class CheckpointManager:
    """Saves and restores one Trainer's state.

    Args:
        config: the run's train settings (strategy, checkpoint format, resume).
        topology: the ranks and their mesh: whose RNG states are whose.
        protocol: the checkpoint directory's work across ranks; None when the run keeps no checkpoints
            (state_dict and load still work: they are how a caller saves elsewhere).
        strategy: holds the model and optimizer state saved and restored.
        position: where the run is (epoch, step, samples of the epoch).
        lr: the learning rate's schedule state.
        precision: fp16's loss scale state.
        batching: the global batch size, recorded.
        job_config: the job's resolved settings, recorded (a resume compares them).
        callbacks: the callbacks whose states every checkpoint holds (None: none).
        kept: the session's keep() objects by name, a dict it fills later (None: an empty one).
        guard_io: a context around every save from the loop (the stall watchdog's checkpoint_io:
            a save may outlast a step's stall limit).
    """

    def __init__(self, config: TrainConfig, topology: Topology, protocol: "Checkpointing | None",
                 strategy: Strategy, position: Position, lr: LearningRate, precision: Precision,
                 batching: Batching, job_config: Mapping[str, Any], callbacks: Optional[Callbacks] = None,
                 kept: Optional[Dict[str, Any]] = None,
                 guard_io: Callable[[], ContextManager] = contextlib.nullcontext) -> None:
        self.config, self.topology, self.protocol = config, topology, protocol
        self.guard_io = guard_io
        # The step of the last checkpoint, until the next step (or elastic sync): a save it would repeat is skipped.
        self.saved_at: Optional[int] = None
        # The session's keep() objects (a dict it fills later), and their states in the checkpoint resumed.
        self.kept: Dict[str, Any] = {} if kept is None else kept
        self.kept_state: Dict[str, Any] = {}
        self.callbacks = callbacks or Callbacks(None, [])
        self.strategy, self.position, self.lr, self.precision = strategy, position, lr, precision
        self.batching, self.job_config = batching, job_config

    def run_state(self) -> RunState:
        """What every rank holds alike (no collective)."""
        topology = self.topology
        return RunState(**self.position.as_dict(), global_batch=self.batching.global_batch_size,
                        world_size=topology.world.size, scheduler=self.lr.state_dict(),
                        data_parallel=topology.data_world.size, mesh=topology.mesh_shape,
                        strategy=self.config.strategy, precision=self.precision.state_dict(),
                        config=dict(self.job_config), kept=kept_state.encode(self.kept))

    def state_dict(self) -> Dict[str, Any]:
        """Everything needed to continue exactly, in the full format. Every rank calls it: it gathers
        the RNG states, and a sharded strategy gathers the model and optimizer state."""
        rng_states = collectives.allgather_object(rng.capture(), name="checkpoint.rng")
        callback_states = collectives.allgather_object(self.callbacks.state_dict(), name="checkpoint.callbacks")
        return {"format": FORMAT_VERSION, **self.strategy.state_dict(), **self.run_state().to_dict(),
                "rng": rng_states, "callbacks": callback_states}

    def load(self, state: Dict[str, Any]) -> None:
        """A full checkpoint (every rank holds it all), or a sharded one's manifest (every rank then
        reads its own file: its slices and its RNG states)."""
        saved = RunState.from_checkpoint(state)
        own_rng, own_callbacks = None, None
        as_written = is_sharded(state) and resumes_as_written(state, self.config.strategy, self.topology.world.size,
                                                              self.topology.mesh_shape, self.config.expert_parallel)
        if as_written:
            # A mesh's rank keeps parts of every rank's file (read through a source, as at another
            # layout); its own file still holds its RNG states. A flat strategy's rank reads its own file.
            every_part = self.strategy.capabilities.loads == EVERY_PART
            shard = (self.protocol.load_resharded(state, self.strategy, keep_own=True) if every_part
                     else self.protocol.load_own_shard(state, self.strategy))
            own_rng, own_callbacks = shard["rng"], shard.get("callbacks", {})
        elif is_sharded(state):  # another worker count or strategy: each rank's RNG is seeded anew below
            self.protocol.load_resharded(state, self.strategy)
        else:
            self.strategy.load_from(FullStateSource(state))  # every rank holds it all: nothing to agree on
            if (saved.world_size == self.topology.world.size and saved.mesh == self.topology.mesh_shape
                    and expert_parallel_of(state) == self.config.expert_parallel):  # else: other experts per rank
                own_rng = state["rng"][self.topology.world.rank]
                if saved.strategy == self.config.strategy:  # a zero2 rank's averages are its slices, not ddp's model
                    own_callbacks = state.get("callbacks", [{}] * len(state["rng"]))[self.topology.world.rank]
        self.lr.load_state_dict(saved.scheduler)
        self.precision.load_state_dict(saved.precision)
        self.kept_state = kept_state.decode(saved.kept)
        for name in self.kept:
            self.restore_kept(name)
        self.position.update(saved.epoch, saved.step, saved.epoch_position)
        if own_callbacks is not None:
            self.callbacks.load_state_dict(own_callbacks)
        elif self.callbacks.state_dict():  # another layout's per-rank state: the callbacks start theirs anew
            self.callbacks.discard_state()
            self.topology.log.warning("the checkpoint was written by another layout: the callbacks' per-rank state "
                                      "(an EMA's averages) starts anew from the loaded weights")
        if own_rng is not None:
            rng.restore(own_rng)
        else:
            # Rank r of the new world is not rank r of the old one: derive fresh per-rank seeds.
            rng.seed_everything(rng.rank_seed(self.config.seed + saved.step, self.topology.rng_rank))
        self.topology.log.info(f"resumed at epoch {saved.epoch}, step {saved.step}, "
                               f"sample {saved.epoch_position} of the epoch")

    def through(self, protocol: Checkpointing) -> "CheckpointManager":
        """The same run's state saved to and loaded from another directory's ``protocol`` (a session's
        save_state(path)): every part shared, only the directory (and what it saved last) its own."""
        other = copy.copy(self)
        other.protocol, other.saved_at = protocol, None
        return other

    def restore_kept(self, name: str) -> None:
        """keep()'s object ``name`` takes its state from the checkpoint resumed, if that holds one."""
        if name in self.kept_state:
            kept_state.restore(self.kept[name], self.kept_state[name])

    def save(self) -> None:
        """Every rank calls it. Full: the state is gathered, rank 0 writes, the others wait.
        Sharded: every rank writes its own part, nothing is gathered; rank 0 adds the manifest.
        Asynchronous (train.checkpoint_async): the writes run in the background; see finish()."""
        step = self.position.step
        if self.config.checkpoint_format == "sharded":
            own = {"strategy": self.strategy.shard_state_dict(), "rng": rng.capture(),
                   "callbacks": self.callbacks.state_dict()}
            self.protocol.save_sharded(own, self.run_state().shared(), step)
        else:
            self.protocol.save(self.state_dict(), step)

    def save_unless_saved(self) -> None:
        """A checkpoint of this step, unless it was just written, no step since (max_steps ending a
        run on a checkpoint_every step reaches the epoch's end save too); the callbacks hear of it."""
        if self.saved_at == self.position.step:
            return
        with self.guard_io():
            self.save()
        self.saved_at = self.position.step
        self.callbacks.call("on_checkpoint", self.position.step)

    def maybe_save(self) -> bool:
        """train.checkpoint_every: a checkpoint when this step is due; the last step of an epoch is
        saved by the epoch's end, as the start of the next. Returns whether it saved."""
        every, position = self.config.checkpoint_every, self.position
        if not (every and position.step % every == 0 and self.batching.has_steps_left(position.epoch_position)):
            return False
        self.save_unless_saved()
        return True

    def forget_saved_step(self) -> None:
        """After every step, and under Horovod elastic at every sync: ``saved_at`` is this process's
        own memory, and after a world change the ranks' differ (a worker that joins saved nothing; a
        survivor may have written the very checkpoint the world continues from). It decides whether a
        save, a collective, runs: forgotten on every rank, every rank saves alike."""
        self.saved_at = None

    def finish(self) -> None:
        """Every rank calls it: the background write in flight (train.checkpoint_async) is done, and
        its failure on any rank raised on every rank. Nothing to wait for otherwise."""
        if self.protocol is not None:
            self.protocol.finish()
