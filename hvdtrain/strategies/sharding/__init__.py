"""What the sharded strategies share: flat, padded buckets of parameters cut into one slice per
rank (flat_buckets.py), the base classes of the strategies that step slices (sliced.py), and a
rank's own part of a sharded checkpoint, put back together without the model's class
(shard_state.py), and a tensor's memory freed and taken again under its views (storage.py). Internal."""
