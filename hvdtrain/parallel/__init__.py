"""Model parallelism on Horovod process sets: the mesh (data x pipeline x tensor), tensor-parallel
layers, and pipeline stages with their schedules."""
