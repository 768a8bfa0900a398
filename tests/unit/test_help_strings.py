"""Every option's help fits a screen: at most HELP_LIMIT characters (two 80-column lines), over the
``hvdtrain`` command's built parsers (every subcommand, the benchmarks' drivers included) and the
settings dataclasses' ``help`` (a script's --help and the configuration reference's table). A longer
explanation goes to the docs: a setting's ``details`` metadata, which the reference page lists after
its table, or the page the help points to."""
import argparse
import dataclasses
from typing import Iterator, Tuple

from hvdtrain.cli import build_parser
from hvdtrain.config.loader import job_argument_parser, sections
from hvdtrain.config.train import TrainConfig
from hvdtrain.examples.digits import DigitsJob
from hvdtrain.examples.hf_lm import HFLMJob
from hvdtrain.examples.textlm import TextLMJob

HELP_LIMIT = 160


def parser_helps(parser: argparse.ArgumentParser, path: str) -> Iterator[Tuple[str, str]]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for choice in action._choices_actions:
                yield f"{path} {choice.dest}", choice.help or ""
            for name, subparser in action.choices.items():
                yield from parser_helps(subparser, f"{path} {name}")
        elif action.help and action.help is not argparse.SUPPRESS:
            yield f"{path} {'/'.join(action.option_strings) or action.dest}", action.help


def setting_helps() -> Iterator[Tuple[str, str]]:
    for job in (DigitsJob, TextLMJob, HFLMJob):
        for section, cls in sections(job).items():
            for f in dataclasses.fields(cls):
                yield f"{job.__name__} {section}.{f.name}", f.metadata.get("help", "")


def test_cli_help_strings_fit_a_screen():
    helps = list(parser_helps(build_parser(), "hvdtrain"))
    assert len(helps) > 100  # every subcommand's options were walked
    long = [f"{where} ({len(text)}): {text}" for where, text in helps if len(text) > HELP_LIMIT]
    assert not long, "\n".join(long)


def test_script_help_strings_fit_a_screen():
    helps = list(parser_helps(job_argument_parser(DigitsJob, "digits"), "train.py"))
    assert helps
    assert all(len(text) <= HELP_LIMIT for _, text in helps)


def test_setting_help_strings_fit_a_screen():
    helps = dict(setting_helps())
    assert any(where.endswith("train.strategy") for where in helps)
    long = [f"{where} ({len(text)}): {text}" for where, text in helps.items() if len(text) > HELP_LIMIT]
    assert not long, "\n".join(long)


def test_every_train_setting_has_a_help():
    assert all(f.metadata.get("help") for f in dataclasses.fields(TrainConfig))
