"""The Trainer's side of checkpoints: what a checkpoint holds to continue exactly, and putting it back.

A part of the Trainer (its base class), kept in a file of its own: the state a run saves (the
strategy's model and optimizer state, where the run is, the LR schedule, the loss scale, every
rank's RNG), how a resumed run takes it back (a full checkpoint, or each rank's own part of a
sharded one), and the save on preemption. Files and who writes them: hvdtrain.checkpoint.protocol.
"""
from __future__ import annotations

from typing import Any, Dict

from hvdtrain.distributed import startup as dist, rng
from hvdtrain.checkpoint.store import FORMAT_VERSION
from hvdtrain.checkpoint.sharded_format import is_sharded


class Resumable:
    """State and resume of a Trainer (which provides every attribute used here)."""

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
            "data_parallel": self.data_world.size,  # the global batch's workers (model replicas)
            "mesh": list(self.mesh_shape),  # data, pipeline, tensor: whose RNG is whose
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
            saved_mesh = state.get("mesh", [state["world_size"], 1, 1])  # before meshes: data parallel only
            if state["world_size"] == self.world.size and list(saved_mesh) == list(self.mesh_shape):
                own_rng = state["rng"][self.world.rank]
        self.scheduler.load_state_dict(state["scheduler"])
        self.precision.load_state_dict(state.get("precision", {}))  # absent before hvdtrain had it
        self.epoch, self.step = state["epoch"], state["step"]
        self.epoch_position = state["epoch_position"]
        if own_rng is not None:
            rng.restore(own_rng)
        else:
            # Rank r of the new world is not rank r of the old one: derive fresh per-rank seeds.
            rng.seed_everything(rng.rank_seed(self.config.seed + self.step, self.rng_rank))
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

    def _stop_for_preemption(self) -> None:
        """Every rank agreed to stop: checkpoint now, requeue the job (rank 0), and return from fit."""
        if self.checkpoints is None:
            self.log.warning("preemption signal, but no checkpoint_dir: this run cannot be resumed")
        else:
            self.save_checkpoint()
        self.preempted = True
        self.faults.requeue_after_preemption(self.step)
