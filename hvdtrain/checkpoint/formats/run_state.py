"""Where a run is and what it was: saved with the model and optimizer state in every checkpoint,
full or sharded, and read back through one definition."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar, Dict, List, Mapping, Sequence, Tuple


@dataclass(frozen=True)
class RunState:
    epoch: int
    step: int
    epoch_position: int  # samples of the epoch's global order already trained on
    global_batch: int  # kept on resume at another worker count
    world_size: int
    scheduler: Dict[str, Any]  # the LR schedule's state_dict
    data_parallel: int = 0  # the global batch's workers (model replicas); 0: world_size
    mesh: Tuple[int, int, int] = (0, 1, 1)  # data, pipeline, tensor: whose RNG state is whose
    strategy: str = "ddp"
    precision: Dict[str, Any] = field(default_factory=dict)  # fp16's loss scale
    config: Dict[str, Any] = field(default_factory=dict)  # the job's resolved settings, every section
    kept: str = ""  # the session's keep() objects' states (hvdtrain.checkpoint.formats.kept), rank 0's, encoded

    # What every full checkpoint holds (hvdtrain wrote these from the first format on).
    FULL: ClassVar[Tuple[str, ...]] = ("scheduler", "epoch", "step", "epoch_position", "global_batch", "world_size")
    # What a sharded checkpoint's manifest holds beside its own keys (strategy and world size among them).
    SHARDED: ClassVar[Tuple[str, ...]] = ("scheduler", "epoch", "step", "epoch_position", "global_batch", "precision",
                                "config")
    # What a manifest holds when the run has it (manifests written before these existed lack them).
    SHARDED_OPTIONAL: ClassVar[Tuple[str, ...]] = ("kept", "data_parallel", "mesh")

    def __post_init__(self) -> None:
        if not self.data_parallel:  # checkpoints before model parallelism: one worker per rank
            object.__setattr__(self, "data_parallel", self.world_size)
        if not self.mesh[0]:
            object.__setattr__(self, "mesh", (self.world_size, 1, 1))
        object.__setattr__(self, "mesh", tuple(self.mesh))

    def to_dict(self) -> Dict[str, Any]:
        state = asdict(self)
        state["mesh"] = list(self.mesh)
        return state

    def shared(self) -> Dict[str, Any]:
        """The part a sharded checkpoint's manifest stores (JSON)."""
        shared = {key: getattr(self, key) for key in self.SHARDED + self.SHARDED_OPTIONAL}
        shared["mesh"] = list(self.mesh)
        return shared

    @classmethod
    def from_checkpoint(cls, state: Mapping[str, Any]) -> "RunState":
        """The run state of a checkpoint (a full one, or a sharded one's manifest); keys older
        checkpoints lack take their defaults."""
        known = [name for name in cls.__dataclass_fields__ if name in state]
        return cls(**{name: state[name] for name in known})


def expert_parallel_of(checkpoint: Mapping[str, Any]) -> int:
    """train.expert_parallel of the run that wrote ``checkpoint`` (a full one, or a sharded one's
    manifest), from the settings it records; 1 when it records none (written before them)."""
    train = (checkpoint.get("config") or {}).get("train") or {}
    return int(train.get("expert_parallel", 1) or 1)


def missing_keys(state: Any, required: Sequence[str]) -> List[str]:
    return [key for key in required if key not in state] if isinstance(state, dict) else list(required)
