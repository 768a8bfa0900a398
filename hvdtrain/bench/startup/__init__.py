"""``hvdtrain bench startup``: seconds from launch to the end of the first step, per phase
(driver.py, which is also its worker)."""
