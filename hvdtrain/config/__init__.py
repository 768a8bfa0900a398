"""Settings: TrainConfig (the ``train`` section, validated when created) and the loader that fills a
job's sections from a YAML file and ``--section.key=value`` overrides. Public.

Imports nothing of hvdtrain but common/ at import time (login-node tools read settings); the
strategy-dependent checks read the strategy classes when a TrainConfig is validated.
"""
from hvdtrain.config.loader import job_argument_parser, load_job, parse_job, to_dict
from hvdtrain.config.train import TrainConfig

__all__ = ["TrainConfig", "job_argument_parser", "load_job", "parse_job", "to_dict"]
