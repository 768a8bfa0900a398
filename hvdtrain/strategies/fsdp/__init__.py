"""ZeRO stage 3 (fully sharded data parallel): the strategy (strategy.py), its units of gathered
parameters (units.py), and their gathers, reduce-scatters and prefetch (communication.py). Internal."""
