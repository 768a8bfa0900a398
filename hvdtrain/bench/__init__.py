"""``hvdtrain bench``: collective sweeps, training throughput against the peers, scaling, projection.

Layout: ``stats``/``report``/``jobs`` are the shared plumbing (robust statistics, tables/JSON/PNG,
launching a measured worker job with a time limit); each benchmark is one module with a
``add_arguments(parser)`` / ``run(args) -> int`` pair that ``hvdtrain.cli.bench`` registers.
"""
