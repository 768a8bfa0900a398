"""Sequence parallelism (DeepSpeed-Ulysses): the ranks of a sequence group share a batch and each
holds 1/S of every sequence; around attention, an all-to-all turns "my tokens, all heads" into "all
tokens, my heads" and back, so any head-local attention runs unchanged on whole sequences.

    groups.py     which ranks form a sequence group, and what the data sees (one worker per group)
    exchange.py   the two all-to-alls (heads <-> sequence), with their gradients
    attention.py  attention around the exchange: heads divisible by S, key/value heads replicated
    batches.py    a batch cut into this rank's part of every sequence, and the loss's share of it
    hf.py         Hugging Face models: through transformers' attention and mask interfaces
    probe.py      set-up's proof on a probe batch that the split model computes the whole one's loss
"""
