"""What a checkpoint is on disk.

    full.py           the full format (one file): a checkpoint directory, listing, ``latest``, pruning
    sharded.py        the sharded format: one file per rank and a manifest, published as a directory
    run_state.py      RunState: where a run is and what it was (one definition, both formats)
    kept.py           the session's keep() objects' states, encoded into the run state
    compatibility.py  whether a checkpoint's settings are this run's
"""
