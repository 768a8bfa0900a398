"""``hvdtrain bench strategies``: ddp, zero1, zero2 and fsdp through the Trainer, samples/s and bytes
per rank (driver.py, over the throughput worker)."""
