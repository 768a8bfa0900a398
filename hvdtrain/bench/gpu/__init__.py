"""``hvdtrain doctor --gpu``: the GPU self-test of one node (driver.py launches worker.py with a rank
per visible GPU; hvdtrain.launch.gpu_selftest judges the figures). Here beside the benchmarks
because it is one: a measured worker job. Only hvdtrain.cli imports it."""
