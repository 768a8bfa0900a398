"""What a run shows and leaves: rank 0's progress, the run directory (config, metrics.jsonl,
TensorBoard, per-rank logs), the start lines and records (reporting.py), what each rank holds, a
Horovod timeline window, and the plots of a run's metrics. Internal, but for ``hvdtrain plot``.

May import common/, config/, distributed/, parallel/ and strategies/ (what a strategy holds);
plots.py and figures.py import neither torch nor Horovod (they run anywhere matplotlib does).
"""
