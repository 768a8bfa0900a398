"""The parts of a training step: what a step computes (steps.py), mixed precision, the learning
rate's scaling and warm-up, the running metrics and evaluation, torch.compile and SyncBatchNorm,
and the run's position. The loop that composes them is hvdtrain.loop.

May import common/, config/, distributed/ and data/. ``supervised_step`` and ``StepFn`` are public.
"""
