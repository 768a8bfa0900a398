"""Pipeline parallelism: stages and their schedules, gpipe and 1f1b (schedule.py), the exchanges
between neighbouring stages (p2p.py), and a batch through the stages for the Trainer (stage.py).
Internal."""
