"""``hvdtrain bench throughput``: training samples/s of one process, hvdtrain, plain Horovod and
PyTorch DDP, and the knobs (driver.py; one measured run: worker.py, which strategies and scaling
run too)."""
