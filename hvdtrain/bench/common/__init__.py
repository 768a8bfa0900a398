"""What every benchmark shares: launching a measured worker job with a time limit (jobs.py), robust
summaries (stats.py), results as JSON (report.py), and the workloads they train (workloads.py,
lm_workload.py)."""
