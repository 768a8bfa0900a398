"""``hvdtrain bench checkpoint``: how long a save stalls training, synchronous against asynchronous
(driver.py, which is also its worker)."""
