"""Data across ranks: the sharded sampler (one global order per epoch, each rank its slice) and the
loaders, global batch and steps per epoch that follow from a data-parallel world.

May import common/, config/ and distributed/. ShardedSampler is public; the rest is internal.
"""
