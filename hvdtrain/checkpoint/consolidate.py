"""A sharded checkpoint made full, in one process (no Horovod, no MPI): every rank's file checked
against the manifest, the slices put back together with the layout the shards carry (the model's
class is not needed), of flat buckets or of a tensor x pipeline mesh. The result is what the
strategy's gathered state_dict() would have written; it needs the memory of the whole model and
optimizer state on this machine (``hvdtrain export`` reads one tensor at a time instead)."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Dict

from hvdtrain.checkpoint import FORMAT_VERSION, CheckpointError
from hvdtrain.checkpoint.sources import sharded as sources
from hvdtrain.checkpoint.formats import sharded


def consolidate(path: Path) -> Dict[str, Any]:
    """The full checkpoint (hvdtrain.checkpoint.formats.full's format, which any strategy and worker count
    resumes) from the sharded one at ``path``, in one process: every rank's file is read and checked."""
    manifest = sharded.read_manifest(Path(path))
    sources.verify(Path(path), manifest, range(manifest["world_size"]))
    try:
        source = sources.open_source(Path(path), manifest)
        full = source.full_state()
    except (KeyError, ValueError, TypeError) as error:
        raise CheckpointError(f"{path}: the shards do not fit together: {type(error).__name__}: {error}") from None
    files = source.files
    return {"format": FORMAT_VERSION, **full, **{key: manifest[key] for key in sharded.RUN_KEYS},
            **{key: manifest[key] for key in sharded.OPTIONAL_RUN_KEYS if key in manifest},
            "world_size": manifest["world_size"], "strategy": manifest["strategy"],
            "rng": [file["rng"] for file in files], "callbacks": [file.get("callbacks", {}) for file in files]}
