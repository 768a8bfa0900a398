"""Data parallelism over a mesh of model replicas that each span several ranks (tensor x pipeline):
the strategy (strategy.py) and how a model built on the meta device gets its values slice by slice
(initialization.py). Internal; the layers it splits and cuts are hvdtrain.parallel's."""
