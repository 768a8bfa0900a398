"""A model that does not fit: each of 4 ranks may add 13.5 bytes per parameter to what it holds
before training. ddp needs 12 for Adam's gradients and moments alone, plus its buffers (measured
here: it fails below ~16), and fails with hvdtrain's error; zero2 holds a quarter of the
gradients and moments (3 bytes) plus transient buckets and all-gathered parameters (measured: it
needs ~11-12) and trains; fsdp holds a quarter of everything, plus the units it gathers. The bound
sits between the two with ~2 bytes per parameter (50 MB) of margin on each side.

Every run that trains is checked twice more on every rank (tests/launch/oom_job.py reports the
figures): its peak RSS (VmHWM from the moment the cap is set) stays under the cap counted as RSS,
the RSS at that moment plus the same budget (RLIMIT_DATA caps VmData, which counts reserved
pages RSS does not, and RSS counts the libraries' pages VmData does not: both are held to the
budget); and, under fsdp and the meshes, the most bytes the strategy counted in parameters,
gradients and optimizer state (``memory_bytes()``, sampled wherever one of them grows) are within
10% of the formula (below, with each).

Measured (4 ranks on 2 shared cores; torch 2.13, Horovod's fusion buffer at 16 MiB): the baseline,
before the model holds memory, is 533-542 MB of VmData and 342-351 MB of RSS per rank (563 and 367
MB for the 25.2M-parameter model, whose warm-up layer is wider).

- Adam, 25,198,602 parameters (100.8 MB of fp32 weights), cap 13.5 bytes per parameter (340 MB
  beyond the baseline): fsdp's peak counted bytes 151,150,668 on every rank (the formula
  151,150,632), 100,794,444 after the first step (16 Psi / 4); peak RSS 530 MB per rank against
  a cap of 707-708 MB RSS. zero2: peak RSS 618-657 MB against 707 MB.
- Built on meta, plain SGD, 50,391,050 parameters (201.6 MB), cap 3.5 bytes per parameter (176.4 MB
  beyond the baseline): fsdp's peak counted 113,377,304 per rank (formula 113,377,300), peak RSS
  476-477 MB against a cap of 518-520 MB RSS; T=2 x P=2: 100,810,752 (first stage) and 100,892,752 (last,
  with the head) against 100,843,600, peak RSS 452-453 MB against 518-527 MB; T=4: 100,991,056
  against 100,843,600, peak RSS 455-456 MB against 518 MB.
"""
import re

import pytest

from tests.launch.helpers import PYTHON, run

BUDGET = "13.5"
# glibc's default lets its mmap threshold grow, so freed large blocks stay in the heap and count
# against RLIMIT_DATA long after torch freed them; a fixed threshold returns them. The fusion
# buffer is capped so that Horovod's own 128 MiB default does not dominate a 100 MB model.
ENV = {"MALLOC_MMAP_THRESHOLD_": "131072", "HOROVOD_FUSION_THRESHOLD": str(16 * 2**20)}
RANKS = 4


def launch(strategy, budget=BUDGET, *flags):
    return run(["mpirun", "-np", str(RANKS), "--oversubscribe", "-x", "MALLOC_MMAP_THRESHOLD_", "-x",
                "HOROVOD_FUSION_THRESHOLD", PYTHON, "tests/launch/oom_job.py", strategy, budget, *flags],
               timeout=240, extra_env=ENV)


def linear_bytes(width, outputs=None):
    """An fp32 nn.Linear(width, outputs or width): its weight and bias."""
    outputs = outputs or width
    return (width * outputs + outputs) * 4


def check_memory(out, counted_formula=None):
    """Every rank's peak RSS under the cap counted as RSS; with ``counted_formula``, every rank's peak
    counted bytes within 10% of it."""
    ranks = [dict((key, int(value)) for key, value in re.findall(r"(\w+) (\d+)", line))
             for line in re.findall(r"memory of rank \d+: (.*)", out)]
    assert len(ranks) == RANKS, out[-3000:]
    for rank, figures in enumerate(ranks):
        assert figures["peak_rss"] <= figures["rss_cap"], (rank, figures)
        if counted_formula is not None:
            off = abs(figures["peak_counted"] - counted_formula)
            assert off < 0.1 * counted_formula, (rank, figures, counted_formula)


def fsdp_peak(parameters, unit, bytes_per_parameter):
    """fsdp's most counted bytes on a CPU (train.fsdp_overlap auto: gathers): 1/N of every parameter,
    gradient and optimizer state (``bytes_per_parameter``: 16 for fp32 Adam, 8 for plain SGD), plus
    in backward the parameters of the unit computing, its full gradient and the parameters of the
    unit before it, whose gather is prefetched (each reduce-scatter is waited for at once). Units are
    whole layers, fp32."""
    return bytes_per_parameter * parameters / RANKS + 3 * unit


@pytest.mark.timeout(420)
def test_ddp_runs_out_of_memory_with_a_clear_report_and_zero2_and_fsdp_train_the_same_model():
    code, out, err = launch("ddp")
    text = out + err
    assert code != 0, text[-3000:]
    report = re.search(r"rank (\d) on \S+ ran out of memory during (the [a-z ]+) under strategy ddp: it tried to "
                       r"allocate [0-9.]+ MiB while holding parameters 96\.\d MiB, gradients 96\.\d MiB, "
                       r"optimizer_state [0-9.]+ MiB \(counted from tensor storages\)\. Its limit is [0-9.]+ [MG]iB "
                       r"\(RLIMIT_DATA\)\. The model has 25\.2M parameters and Adam keeps 2 state tensor\(s\) "
                       r"per parameter: per rank at 4 workers, ddp 384\.\d MiB; zero1 240\.\d MiB; "
                       r"zero2 168\.\d MiB; fsdp 96\.\d MiB; ps 480\.\d MiB .*try --train\.strategy=fsdp", text)
    assert report, text[-3000:]
    assert "trained 3 steps" not in text

    for strategy in ("zero2", "fsdp"):
        code, out, err = launch(strategy)
        assert code == 0, (out + err)[-3000:]
        assert f"trained 3 steps under {strategy} within 13.5 bytes per parameter (25198602 parameters)" in out
        # The model: 6 hidden Linear(2048, 2048), each an fsdp unit, and the head Linear(2048, 10).
        check_memory(out, fsdp_peak(25198602, linear_bytes(2048), 16) if strategy == "fsdp" else None)


@pytest.mark.timeout(480)
def test_a_model_built_on_meta_trains_under_fsdp_and_a_mesh_in_less_memory_than_its_own_weights():
    """The cap now counts the parameters from their first byte: 3.5 bytes per parameter, less than the
    model's own fp32 weights (4). ddp and zero2 make the model whole on every rank and cannot; fsdp
    gives each rank its quarter, one 4 MB unit in memory at a time while it initializes, and trains
    (plain SGD: weight and gradient, 8 bytes per parameter, a quarter of them per rank, plus the units
    in flight: 113.4 MB counted of the 176 MB allowed); so do a T=2 x P=2 mesh and a T=4 one, each rank
    initializing only its slices with one whole 4 MB linear in memory at a time and then holding a
    quarter of every weight and gradient."""
    for whole in ("ddp", "zero2"):
        code, out, err = launch(whole, "3.5", "--meta")
        text = out + err
        assert code != 0, text[-3000:]
        assert re.search(rf"ran out of memory during set-up \(sharding the model and optimizer\) under strategy "
                         rf"{whole}: it tried to allocate [0-9.]+ MiB\. Its limit is .*try --train\.strategy=fsdp",
                         text), text[-3000:]
    # The model: 48 hidden Linear(1024, 1024) (each an fsdp unit) and the head Linear(1024, 10).
    linear, head, parameters = linear_bytes(1024), linear_bytes(1024, 10), 50391050
    code, out, err = launch("fsdp", "3.5", "--meta")
    assert code == 0, (out + err)[-3000:]
    assert "built on the meta device, initialized by fsdp unit" in out
    assert f"trained 3 steps under fsdp within 3.5 bytes per parameter ({parameters} parameters)" in out
    check_memory(out, fsdp_peak(parameters, linear, 8))

    for tensor, pipeline in ((2, 2), (4, 1)):
        code, out, err = launch("ddp", "3.5", "--meta", f"--tensor={tensor}", f"--pipeline={pipeline}")
        assert code == 0, (out + err)[-3000:]
        assert (f"trained 3 steps under ddp x tensor {tensor} x pipeline {pipeline} within 3.5 bytes per "
                f"parameter") in out
        peak = re.search(r"initialized by tensor slice and pipeline stage \(at most ([0-9.]+) MiB of it at once\)", out)
        # Initializing: a quarter of the 48 hidden linears (T=2 x P=2: each split in two, half of them on
        # this stage; T=4: each split in four) plus one whole linear while it is initialized; the head whole.
        expected = (48 * linear / 4 + linear + head) / 2**20
        assert peak and abs(float(peak.group(1)) - expected) < 0.1 * expected, (peak and peak.group(1), expected)
        # Training (plain SGD): each rank's quarter of the hidden linears' weights and gradients; the
        # head's on the last stage too (0.08%), rowwise biases whole on every tensor rank (0.1%).
        check_memory(out, 2 * (48 * linear / (tensor * pipeline) + head))
