"""``hvdtrain bench``: measurements that put figures beside the peers' and the models'.

One package per benchmark: its driver (``add_arguments(parser)`` / ``run(args) -> int``, registered
by hvdtrain.cli.bench) and, where it launches measured jobs, its worker; common/ is the shared
plumbing. A leaf: it may import anything in hvdtrain, and nothing but hvdtrain.cli imports it
(tests/unit/test_architecture.py checks it).
"""
