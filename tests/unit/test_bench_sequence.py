"""hvdtrain bench sequence's driver: each ladder climbed until a step runs out of memory, the table and
the ratio of the longest lengths, the activation formula; a failure that is not out of memory is not
taken for one. The jobs are stood in for (their worker is tests/mpi/test_sequence_parallel.py's
activation count and a real launch in the bench itself)."""
import argparse
import re

import pytest

from hvdtrain.bench.common import jobs
from hvdtrain.bench.sequence import driver


def options(tmp_path):
    parser = argparse.ArgumentParser()
    driver.add_arguments(parser)
    return parser.parse_args(["--workers", "4", "--lengths-ddp", "1000,2000,3000", "--lengths-split",
                              "4000,8000,12000", "--out", str(tmp_path)])


def fake_jobs(fits, per_token):
    """Each job trains when its length fits under its layout's cap, keeping per_token bytes per token."""
    def run_job(module, args, np, launcher, timeout, env=None, hosts=()):
        sequence, length = int(args[args.index("--sequence") + 1]), int(args[args.index("--length") + 1])
        if length > fits[sequence]:
            raise jobs.JobFailed("rank 0 on vm ran out of memory during the forward and backward pass")
        return {"steps": 1, "ranks": [{"activations": per_token[sequence] * length, "peak_rss_growth": 1}] * np}
    return run_job


def test_the_ladders_stop_at_the_first_step_that_does_not_fit(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(jobs, "run_job", fake_jobs({1: 2500, 4: 9000}, {1: 34400, 4: 9112}))
    assert driver.run(options(tmp_path)) == 0
    out = capsys.readouterr().out
    assert "longest trained: ddp 2000, S=4 8000: 4.00x (ddp's first that did not fit: 3000)" in out
    assert re.search(r"S=4\s+12000\s+out of memory", out) and re.search(r"ddp\s+3000\s+out of memory", out)
    # (34400 + 4 layers x 128 x 4 bytes) / 4 = 9112 per token: the formula met exactly.
    assert "formula (ddp's + layers x d_model x 4) / S = 9112 (+0.00%)" in out
    assert (tmp_path / "results.json").exists()


def test_a_job_that_fails_otherwise_is_an_error_not_a_length_that_did_not_fit(tmp_path, monkeypatch):
    def broken(*args, **kwargs):
        raise jobs.JobFailed("exited 1: ImportError")
    monkeypatch.setattr(jobs, "run_job", broken)
    with pytest.raises(jobs.JobFailed, match="ImportError"):
        driver.run(options(tmp_path))
