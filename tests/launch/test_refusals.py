"""A refusal (a checkpoint directory resume=false would mix, a missing path, a layout no mesh fits)
reads like a settings error: one line on rank 0, exit status 2, no traceback on any rank."""
import pytest

from tests.launch.helpers import BIN, PYTHON, run

HVDTRAIN = str(BIN / "hvdtrain")

EXPECTED = {
    "resume_false": "holds checkpoints already",
    "missing_pretrained": "the pretrained weights in",
    "bad_layout": "train.tensor_parallel=1 x train.pipeline_parallel=3",
    # Rank 1 refuses first: it must not end the job before rank 0 has said why.
    "bad_layout_late_root": "train.tensor_parallel=1 x train.pipeline_parallel=3",
}


@pytest.mark.parametrize("case", sorted(EXPECTED))
def test_a_refusal_is_one_line_on_rank_zero_and_exit_status_two(case, tmp_path):
    # python directly under mpirun: the exit status is the ranks' own, not hvdtrain launch's summary.
    code, out, err = run(["mpirun", "-np", "2", "--oversubscribe", PYTHON, "tests/launch/signal_job.py", case,
                          str(tmp_path)], timeout=180)
    output = out + err
    assert "Traceback" not in output, output[-4000:]
    refusals = [line for line in err.splitlines() if line.startswith("hvdtrain: ")]
    assert len(refusals) == 1, err[-4000:]
    assert EXPECTED[case] in refusals[0], refusals
    assert code == 2, (code, err[-3000:])
