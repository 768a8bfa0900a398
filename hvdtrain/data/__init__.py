"""Data across ranks: the sharded sampler (one global order per epoch, each rank its slice) and the
loaders, global batch and steps per epoch that follow from a data-parallel world; streams
(iterable and streaming datasets) sharded the same way by StreamShards.

May import common/, config/ and distributed/. ShardedSampler and StreamShards are public; the rest is internal.
"""
