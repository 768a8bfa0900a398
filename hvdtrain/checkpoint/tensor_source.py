"""What a sharded checkpoint's reader (flat buckets: hvdtrain.checkpoint.resharding.ShardedSource;
a tensor x pipeline mesh: hvdtrain.checkpoint.mesh_source.MeshSource) answers the same way, from
its own ``model_keys``, ``aliases()`` and ``full_tensor()``."""
from __future__ import annotations

from typing import Dict, Iterator, List, Tuple

import torch


class WholeTensorSource:
    model_keys: List[str]

    def aliases(self) -> Dict[str, List[str]]:
        """A tied tensor's first state_dict name -> all its names."""
        raise NotImplementedError

    def full_tensor(self, name: str) -> torch.Tensor:
        """The model's tensor ``name``, whole."""
        raise NotImplementedError

    def model_tensors(self) -> Iterator[Tuple[str, torch.Tensor]]:
        """(first name, whole tensor) of every distinct tensor, in state_dict order, one at a time
        (an export: a tied weight once)."""
        later = {name for names in self.aliases().values() for name in names[1:]}
        for name in self.model_keys:
            if name not in later:
                yield name, self.full_tensor(name)
