"""``hvdtrain bench scaling``: the same job at 1..N workers (driver.py, over the throughput worker)."""
