import argparse

import pytest

from hvdtrain.config import TrainConfig, add_config_arguments, config_from_args


@pytest.mark.parametrize("field,value", [
    ("epochs", 0), ("batch_size", -4), ("accumulation", 0), ("log_every", 0),
    ("lr", 0.0), ("warmup_epochs", -1.0), ("max_steps", 0), ("num_workers", -1),
    ("batch_size", 2.5),
])
def test_invalid_settings_name_the_field_and_the_value(field, value):
    with pytest.raises(ValueError, match=rf"TrainConfig\.{field} must be .*{value!r}"):
        TrainConfig(**{field: value})


def parse(argv, defaults=TrainConfig()):
    parser = argparse.ArgumentParser()
    add_config_arguments(parser, defaults)
    return config_from_args(parser.parse_args(argv))


def test_every_field_is_a_typed_flag_with_the_given_defaults():
    defaults = TrainConfig(epochs=3, lr=0.5)
    assert parse([], defaults) == defaults
    config = parse(["--batch-size", "16", "--lr", "0.1", "--no-scale-lr", "--fp16-allreduce",
                    "--max-steps", "7", "--warmup-epochs", "0.5"])
    assert (config.batch_size, config.lr, config.scale_lr, config.fp16_allreduce,
            config.max_steps, config.warmup_epochs) == (16, 0.1, False, True, 7, 0.5)


def test_a_mistyped_flag_is_an_error_that_names_it(capsys):
    with pytest.raises(SystemExit):
        parse(["--batch-size", "sixteen"])
    assert "--batch-size: invalid int value: 'sixteen'" in capsys.readouterr().err


def test_a_flag_that_fails_validation_is_an_error():
    with pytest.raises(ValueError, match="TrainConfig.epochs"):
        parse(["--epochs", "0"])
