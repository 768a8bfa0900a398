"""``hvdtrain bench collectives``: all-reduce, broadcast and all-gather sweeps (driver.py; the
measuring job: worker.py)."""
