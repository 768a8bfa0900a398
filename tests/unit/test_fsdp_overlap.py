"""train.fsdp_overlap: its choices, refused where it means nothing, and auto resolved by the device
(what each mode holds and that each takes one process's steps: tests/mpi/test_fsdp.py)."""
import argparse

import pytest
import torch

from hvdtrain import cli, planner
from hvdtrain.cli.plan import add_arguments, setup_from
from hvdtrain.config.train import FSDP_OVERLAPS, TrainConfig
from hvdtrain.planner.layout import FSDP_UNITS_HELD
from hvdtrain.strategies.fsdp.communication import UnitCommunication
from hvdtrain.strategies.fsdp.strategy import OVERLAPS, resolve_overlap


def test_auto_is_full_on_a_gpu_and_gathers_on_a_cpu():
    assert resolve_overlap("auto", torch.device("cuda", 0)) == "full"
    assert resolve_overlap("auto", torch.device("cpu")) == "gathers"
    assert [resolve_overlap(mode, torch.device("cpu")) for mode in ("full", "gathers", "forward", "none")] == \
        ["full", "gathers", "forward", "none"]
    with pytest.raises(ValueError, match=r"train.fsdp_overlap='both': choose one of auto, full, gathers, forward, none"):
        resolve_overlap("both", torch.device("cpu"))


def test_the_settings_layer_and_the_planner_know_the_same_modes():
    assert FSDP_OVERLAPS == OVERLAPS  # the settings' layer keeps its own copy
    assert set(FSDP_UNITS_HELD) == set(OVERLAPS) - {"auto"}


def test_the_setting_is_checked_and_refused_outside_fsdp_and_hsdp():
    assert TrainConfig(strategy="fsdp", fsdp_overlap="full").fsdp_overlap == "full"
    assert TrainConfig(strategy="hsdp", fsdp_overlap="none").fsdp_overlap == "none"
    assert TrainConfig(strategy="ddp").fsdp_overlap == "auto"
    with pytest.raises(ValueError, match=r"fsdp_overlap=full applies to strategy=fsdp or hsdp only, got strategy=zero2"):
        TrainConfig(strategy="zero2", fsdp_overlap="full")
    with pytest.raises(ValueError, match=r"fsdp_overlap"):
        TrainConfig(strategy="fsdp", fsdp_overlap="both")


def test_at_most_one_reduce_scatter_may_run_behind():
    with pytest.raises(ValueError, match=r"reductions_behind must be 0 or 1, got 2"):
        UnitCommunication([], reductions_behind=2)


def test_hvdtrain_plan_models_the_overlap_it_is_given():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    base = ["--example", "textlm", "--workers", "4", "--memory", "2GiB"]
    setups = {mode: setup_from(parser.parse_args(base + ["--fsdp-overlap", mode])) for mode in FSDP_UNITS_HELD}
    assert setup_from(parser.parse_args(base)).fsdp_overlap == "full"  # what plans are for: auto on GPUs
    fsdp = planner.Layout("fsdp", 1, 1, 4)
    held = {mode: planner.memory(setup, fsdp).total for mode, setup in setups.items()}
    unit = held["full"] - held["gathers"]
    assert unit > 0 and held["forward"] == held["none"] == pytest.approx(held["full"] - 2 * unit)  # 4, 3, 2, 2 units
    with pytest.raises(SystemExit):
        parser.parse_args(base + ["--fsdp-overlap", "auto"])  # a plan is for a device kind: say which mode
    assert cli.main(["plan", *base, "--fsdp-overlap", "forward"]) == 0
