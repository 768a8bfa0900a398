"""Hostfiles and launch commands. Runs on login nodes: imports neither torch nor Horovod."""
