"""A model's tensors (and a checkpoint's optimizer state) asked by name, the same way of every source.

    contract.py  TensorSource: the questions every source answers (or says it cannot)
    full.py      a full checkpoint's state, in memory
    sharded.py   a sharded checkpoint of flat buckets, memory-mapped, at any worker count; opening any sharded one
    mesh.py      a sharded checkpoint of a tensor x pipeline mesh, read one whole tensor at a time

A Hugging Face weights directory is one too: hvdtrain.weights.pretrained.
"""
