"""``hvdtrain bench packing``: real tokens/s of packed rows against padded batches of the same documents
(driver.py)."""
