"""``hvdtrain bench plan``: hvdtrain plan's modelled step times against measured ones (driver.py; the
measuring job: worker.py)."""
