"""``hvdtrain bench activations``: activation bytes and step time with train.activation_checkpointing
against without it (driver.py)."""
