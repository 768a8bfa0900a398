"""The full state of a strategy that keeps its parameters in flat buckets and its optimizer
state in slices (zero1, zero2, ps): the same as one process's, whatever the strategy that reads it.

A mixin, listed before Strategy. The strategy provides ``_gather_optimizer_state()`` (a
collective: the user's optimizer's state_dict, whole on every rank), ``_load_optimizer_state``
(each rank keeps its slices of a full one) and ``_carried_state`` (the user's optimizer's state
as it was built, until a step or a load makes it stale); the model's own state_dict reads and
writes the buckets in place.
"""
from __future__ import annotations

from typing import Any, Dict

import horovod.torch as hvd

from hvdtrain.distributed import startup as dist


class SlicedOptimizerFullState:
    def broadcast_from_root(self) -> None:
        hvd.broadcast_parameters(self.model.state_dict(), root_rank=0)  # in place: into the buckets
        full = self._carried_state if self._carried_state is not None else self._gather_optimizer_state()
        self._load_optimizer_state(dist.broadcast_state(full, root_rank=0, name=f"{self.name}.optimizer"))
        self._carried_state = None

    def state_dict(self) -> Dict[str, Any]:
        return {"model": self.model.state_dict(), "optimizer": self._gather_optimizer_state()}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])  # copies into the buckets in place
        self._load_optimizer_state(state["optimizer"])
        self._carried_state = None
