"""A full checkpoint's {"model", "optimizer"} state, in memory on every rank, asked as any source is."""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch

from hvdtrain.checkpoint import CheckpointError
from hvdtrain.checkpoint.sources.contract import TensorSource


class FullStateSource(TensorSource):
    """The state a full checkpoint holds (or a strategy's state_dict()): the optimizer's state is
    known by the plain torch optimizer's parameter index, not by name."""

    def __init__(self, state: Dict[str, Any]) -> None:
        self.state = state
        self.model, self.optimizer = state["model"], state["optimizer"]
        self.model_keys = list(self.model)

    def holds(self, name: str) -> bool:
        return name in self.model

    def shape(self, name: str) -> Tuple[int, ...]:
        return tuple(self.model[name].shape)

    def full_tensor(self, name: str) -> torch.Tensor:
        return self.model[name]

    def param_groups(self) -> List[Dict[str, Any]]:
        return self.optimizer["param_groups"]

    def parameter_count(self) -> int:
        return sum(len(group["params"]) for group in self.optimizer["param_groups"])

    def optimizer_state_of(self, index: int, name: str) -> Dict[str, Any]:
        return self.optimizer["state"].get(index, {})

    def full_state(self) -> Dict[str, Any]:
        return self.state

    def held_state(self) -> Optional[Dict[str, Any]]:
        return self.state

    def optimizer_state(self, name: str) -> Dict[str, Any]:
        raise CheckpointError("a full checkpoint knows the optimizer's state by parameter index, not by name: "
                              "a strategy takes it whole (held_state)")
