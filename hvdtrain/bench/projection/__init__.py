"""``hvdtrain bench project``: the planner's data-parallel projection as tables and plots (driver.py)."""
