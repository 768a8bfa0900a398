"""Failures a long run survives: a preemption signal (checkpoint at a step boundary, requeue), a rank
that stalls (the watchdog ends the job, naming it), Horovod elastic (lose and regain workers), and an
out-of-memory error that says what would fit. Internal: the Trainer composes these.

May import common/, config/, distributed/, parallel/ (the topology), components/ and planner/.
"""
