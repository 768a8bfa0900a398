"""Data across ranks: the sharded sampler (one global order per epoch, each rank its slice) and the
loaders, global batch and steps per epoch that follow from a data-parallel world; streams
(iterable and streaming datasets) sharded the same way by StreamShards; documents packed into rows of
one length (packing.py).

May import common/, config/ and distributed/. ShardedSampler, StreamShards, packed and packed_lm_step are public; the rest is internal.
"""
