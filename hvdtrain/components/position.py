"""Where a run is: the Trainer's own state, three counters."""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Dict


@dataclass
class Position:
    epoch: int = 0
    step: int = 0  # optimizer steps taken
    epoch_position: int = 0  # samples of the current epoch's global order already trained on

    def as_dict(self) -> Dict[str, int]:
        return asdict(self)

    def update(self, epoch: int, step: int, epoch_position: int) -> None:
        self.epoch, self.step, self.epoch_position = epoch, step, epoch_position
