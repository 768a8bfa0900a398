"""A sharded checkpoint made full, in one process (no Horovod, no MPI): every rank's file checked
against the manifest, the slices put back together with the layout the shards carry (the model's
class is not needed). The result is what the strategy's gathered state_dict() would have written;
it needs the memory of the whole model and optimizer state on this machine."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Dict

from hvdtrain.checkpoint import FORMAT_VERSION, CheckpointError
from hvdtrain.checkpoint import sharded_format as sharded
from hvdtrain.strategies.sharding.shard_state import assemble_full_state


def consolidate(path: Path) -> Dict[str, Any]:
    """The full checkpoint (hvdtrain.checkpoint.store's format, which any strategy and worker count
    resumes) from the sharded one at ``path``, in one process: every rank's file is read and checked."""
    manifest = sharded.read_manifest(Path(path))
    shards = [sharded.read_shard(Path(path), manifest, rank) for rank in range(manifest["world_size"])]
    try:
        full = assemble_full_state([shard["strategy"] for shard in shards])
    except (KeyError, ValueError) as error:
        raise CheckpointError(f"{path}: the shards do not fit together: {error}") from None
    return {"format": FORMAT_VERSION, **full, **{key: manifest[key] for key in sharded.RUN_KEYS},
            **{key: manifest[key] for key in sharded.OPTIONAL_RUN_KEYS if key in manifest},
            "world_size": manifest["world_size"], "strategy": manifest["strategy"],
            "rng": [shard["rng"] for shard in shards], "callbacks": [shard.get("callbacks", {}) for shard in shards]}
