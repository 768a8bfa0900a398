"""Horovod and the job's processes: start-up (hvdtrain.init: pinning, threads, seeds, Horovod's
settings), the World this process is in, collective helpers, per-rank RNG states and rank-aware
logging; environments/ says who started the process.

The bottom of the stack: imports nothing of hvdtrain but common/. ``init`` and ``World`` are public.
"""
