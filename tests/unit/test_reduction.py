"""train.reduction and train.hierarchical_allreduce without MPI: what the settings refuse, the LR rule
under Adasum, which worlds Horovod's Adasum cannot combine, and hierarchical all-reduce set before
hvd.init() (a stand-in Horovod records what it was started with)."""
import re
import types

import pytest
import torch

from hvdtrain.distributed import startup as dist
from hvdtrain.config.train import TrainConfig
from hvdtrain.strategies.reduction import adasum_refusal, combines_updates
from hvdtrain.components.lr import adasum_lr_factor, lr_scale


# ---- settings ------------------------------------------------------------------------------------

def test_an_unknown_reduction_names_the_choices():
    with pytest.raises(ValueError, match=r"TrainConfig\.reduction must be one of average, adasum, got 'median'"):
        TrainConfig(reduction="median")


@pytest.mark.parametrize("strategy", ["zero1", "zero2", "fsdp"])
def test_adasum_with_a_sharded_strategy_is_refused_with_the_reason(strategy):
    with pytest.raises(ValueError) as refused:
        TrainConfig(reduction="adasum", strategy=strategy)
    message = str(refused.value)
    assert f"reduction=adasum works only with strategy=ddp, got strategy={strategy}" in message
    assert "Adasum has no reduce-scatter form" in message
    assert f"Use strategy=ddp with reduction=adasum, or reduction=average with strategy={strategy}" in message


@pytest.mark.parametrize("overrides,reason,way_out", [
    ({"precision": "fp16"}, "before the loop can unscale the loss scale", "Use precision=bf16 (no loss scale) or fp32"),
    ({"max_grad_norm": 1.0}, "no rank ever holds the combined gradient to clip", "Set max_grad_norm to null"),
])
def test_adasum_refuses_what_needs_the_combined_gradient(overrides, reason, way_out):
    with pytest.raises(ValueError) as refused:
        TrainConfig(reduction="adasum", **overrides)
    assert reason in str(refused.value) and way_out in str(refused.value)
    TrainConfig(reduction="average", **overrides)  # averaging takes them


def test_adasum_takes_ddp_bf16_accumulation_and_fp16_compression():
    config = TrainConfig(reduction="adasum", precision="bf16", accumulation=4, fp16_allreduce=True)
    assert (config.reduction, config.strategy, config.hierarchical_allreduce) == ("adasum", "ddp", False)
    assert TrainConfig(hierarchical_allreduce=True, strategy="zero2").hierarchical_allreduce


# ---- the learning rate --------------------------------------------------------------------------

def test_adasum_does_not_scale_the_lr_by_the_workers_only_by_one_workers_samples():
    # 8 workers x batch 32 x 2 micro-batches: averaging scales by 16, Adasum over MPI by 2 (accumulation).
    assert lr_scale(32 * 2 * 8, 32, True) == 16.0
    assert lr_scale(32 * 2 * 8, 32, True, "adasum", workers=8) == 2.0
    assert lr_scale(32 * 1 * 8, 32, True, "adasum", workers=8) == 1.0
    # With NCCL on GPUs (4 per host): one worker's samples x the GPUs per host.
    assert lr_scale(32 * 2 * 8, 32, True, "adasum", workers=8, adasum_factor=4) == 8.0
    assert lr_scale(32 * 2 * 8, 32, False, "adasum", workers=8, adasum_factor=4) == 1.0
    # Resumed on 4 workers with the global batch of 8 x 32: each worker's batch doubled, and so does its lr.
    assert lr_scale(256, 32, True, "adasum", workers=4) == 2.0


@pytest.mark.parametrize("device,nccl,local_size,factor", [
    ("cpu", False, 4, 1), ("cpu", True, 4, 1),   # CPU tensors: Adasum over MPI between every rank
    ("cuda", False, 4, 1),                        # GPU without NCCL: Horovod copies to the CPU, MPI Adasum
    ("cuda", True, 4, 4),                         # NCCL averages a host's 4 GPUs, Adasum across hosts
])
def test_the_adasum_lr_factor_follows_horovods_guide(device, nccl, local_size, factor):
    assert adasum_lr_factor(device, nccl, local_size) == factor


def test_horovods_adasum_optimizer_only_beyond_one_rank():
    assert combines_updates("adasum", 2) and not combines_updates("adasum", 1)
    assert not combines_updates("average", 4)


# ---- worlds Adasum cannot combine ----------------------------------------------------------------

def refusal(size=4, local_size=2, cross_size=2, mpi=True, gpu_nccl=False, homogeneous=True):
    return adasum_refusal(size, local_size, cross_size, mpi, gpu_nccl, homogeneous)


def test_adasum_runs_on_a_power_of_two_number_of_mpi_ranks():
    assert all(refusal(size=n, local_size=n, cross_size=1) is None for n in (1, 2, 4, 8, 64))


@pytest.mark.parametrize("kwargs,expected", [
    ({"mpi": False}, "needs Horovod's MPI operations, and this job runs on Gloo"),
    ({"size": 3}, "needs a power-of-two number of workers .* this job has 3. Launch 1, 2, 4, 8"),
    ({"size": 6, "local_size": 2, "cross_size": 3}, "this job has 6"),
    ({"gpu_nccl": True, "size": 12, "local_size": 4, "cross_size": 3}, "power-of-two number of hosts .* 3 hosts"),
    ({"gpu_nccl": True, "homogeneous": False}, "the same number of ranks on every host"),
])
def test_a_world_adasum_cannot_combine_is_named_with_a_way_out(kwargs, expected):
    message = refusal(**kwargs)
    assert message is not None
    assert re.search(expected, message), message
    assert message.endswith("or use train.reduction=average")


def test_with_nccl_the_hosts_not_the_ranks_must_be_a_power_of_two():
    assert refusal(gpu_nccl=True, size=6, local_size=3, cross_size=2) is None


# ---- hierarchical all-reduce --------------------------------------------------------------------

@pytest.mark.parametrize("value,requested", [
    (None, False), ("0", False), ("1", True), (" 2", True), ("1x", True), ("-1", False), ("yes", False), ("", False),
])
def test_hierarchical_is_read_as_horovod_reads_it(value, requested):
    environ = {} if value is None else {dist.HIERARCHICAL_ALLREDUCE: value}
    assert dist.hierarchical_requested(environ) is requested


def test_the_start_line_says_whether_horovod_applies_it_and_why_not():
    assert dist.hierarchical_effect(False, True, "cuda", 4) == "hierarchical all-reduce off"
    assert dist.hierarchical_effect(True, True, "cuda", 4).startswith("hierarchical all-reduce on")
    here = dist.hierarchical_effect(True, False, "cpu", 1)  # this machine
    assert "not applied by Horovod here (Horovod built without NCCL, CPU tensors, one host)" in here


class StandInHorovod:
    """Just enough of horovod.torch for dist.init: records the environment hvd.init() saw."""

    def __init__(self, initialized=False):
        self.initialized = initialized
        self.seen_at_init = None

    def is_initialized(self):
        return self.initialized

    def init(self):
        self.seen_at_init = dist.hierarchical_requested()
        self.initialized = True

    rank = local_rank = cross_rank = staticmethod(lambda: 0)
    size = local_size = cross_size = staticmethod(lambda: 1)
    gloo_enabled = staticmethod(lambda: False)
    allgather_object = staticmethod(lambda obj, name: [obj])  # the devices' agreement, of one rank


@pytest.fixture
def stand_in(monkeypatch):
    """dist.init against a stand-in Horovod and launcher; every variable it may set is restored."""
    for key in [*dist.ENV_DEFAULTS, dist.HIERARCHICAL_ALLREDUCE, dist.TIMELINE_ARMED[0]]:
        monkeypatch.setenv(key, "")  # recorded as it was, so that teardown removes what dist.init sets
        monkeypatch.delenv(key)
    launcher = types.SimpleNamespace(detect=lambda: types.SimpleNamespace(name="none"),
                                     check_world=lambda *args: None, is_elastic_launch=lambda: False)
    monkeypatch.setattr(dist, "launcher_env", launcher)
    monkeypatch.setattr(dist.torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(dist.rng, "seed_everything", lambda seed: None)  # leave this process's RNGs alone

    def use(horovod):
        monkeypatch.setattr(dist, "hvd", horovod)
        return horovod
    return use


def test_init_sets_hierarchical_allreduce_before_hvd_init(stand_in):
    horovod = stand_in(StandInHorovod())
    world = dist.init(seed=1, threads=torch.get_num_threads(), hierarchical_allreduce=True)
    assert horovod.seen_at_init is True and world.hierarchical_allreduce


@pytest.mark.parametrize("settings,expected", [
    (dict(tensor_parallel=2), dict(process_sets=True, timeline=False, hierarchical=False)),
    (dict(strategy="hsdp"), dict(process_sets=True, timeline=False, hierarchical=False)),
    (dict(sequence_parallel=2), dict(process_sets=True, timeline=False, hierarchical=False)),
    (dict(timeline_steps=3, hierarchical_allreduce=True), dict(process_sets=False, timeline=True, hierarchical=True)),
    (dict(), dict(process_sets=False, timeline=False, hierarchical=False)),
])
def test_init_with_the_runs_config_starts_the_world_its_settings_need(stand_in, monkeypatch, settings, expected):
    """hvdtrain.init(config): Horovod reads these once, at hvd.init(); init(seed=...) before a Trainer
    with tensor parallelism, hsdp or a timeline left them out (the trap of the README's old snippet)."""
    from hvdtrain.config.train import TrainConfig

    monkeypatch.setenv(dist.DYNAMIC_PROCESS_SETS, "")
    monkeypatch.delenv(dist.DYNAMIC_PROCESS_SETS)
    seeds = []
    monkeypatch.setattr(dist.rng, "seed_everything", seeds.append)
    horovod = stand_in(StandInHorovod())
    seen = {}
    original = horovod.init

    def init():
        seen.update(process_sets=dist.dynamic_process_sets_enabled(), timeline=dist.timeline_armed(),
                    hierarchical=dist.hierarchical_requested())
        original()
    horovod.init = init
    config = TrainConfig(seed=7, **settings)
    dist.init(config, threads=1)
    assert seen == expected and seeds == [dist.rng.rank_seed(7, 0)]
    with pytest.raises(TypeError, match=r"give the run's TrainConfig \(job.train\), got dict"):
        dist.init({"seed": 7})


def test_init_leaves_the_launchs_setting_alone_when_not_asked(stand_in, monkeypatch):
    horovod = stand_in(StandInHorovod())
    assert not dist.init(seed=1, threads=torch.get_num_threads()).hierarchical_allreduce
    assert horovod.seen_at_init is False
    monkeypatch.setenv(dist.HIERARCHICAL_ALLREDUCE, "1")  # horovodrun --hierarchical-allreduce
    assert dist.init(seed=1, threads=torch.get_num_threads()).hierarchical_allreduce


def test_asked_for_once_horovod_runs_without_it_is_refused_with_what_to_do(stand_in):
    stand_in(StandInHorovod(initialized=True))
    with pytest.raises(ValueError) as refused:
        dist.init(seed=1, threads=torch.get_num_threads(), hierarchical_allreduce=True)
    message = str(refused.value)
    assert "Horovod was started without HOROVOD_HIERARCHICAL_ALLREDUCE=1" in message
    assert "hvdtrain.init(config) with the run's TrainConfig" in message
    assert "horovodrun --hierarchical-allreduce" in message
    assert not dist.hierarchical_requested()  # nothing set that Horovod would never read
