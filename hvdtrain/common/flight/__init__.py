"""The flight recorder for hangs: every rank keeps its last collectives and step phases in memory
(recorder.py), writes them with its threads' stacks into the run directory on a stall, on SIGUSR2
or when ``hvdtrain debug dump`` asks (dumps.py), and the analysis aligns the ranks' records to name
the first collective a rank never entered, entered in another order or with another shape, and the
slowest rank per phase (analysis.py).

Pure Python (no torch, no Horovod): ``hvdtrain debug analyze`` runs on a laptop over copied dumps.
What feeds the collectives in is hvdtrain.distributed.flight_hooks; the phases, hvdtrain.loop.
"""
