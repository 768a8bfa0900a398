"""``hvdtrain bench ps``: the parameter server against ddp, bytes per rank counted and samples/s
(driver.py, which is also its worker)."""
