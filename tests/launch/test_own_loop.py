"""Horovod's pytorch_mnist.py shape, ported to hvdtrain's library API (examples/own_loop): the port
changes a handful of lines, keeps its loop and its own evaluation, and a run of it killed with
SIGKILL and started again ends bitwise where the uninterrupted run ends (hvdtrain resumes the model,
the optimizer, the RNG and the position in the epoch's order; the rank-0 save is the user's own)."""
import difflib
import re

import pytest
import torch

from tests.launch.helpers import PYTHON, ROOT, kill_when, run

EXAMPLES = ROOT / "examples" / "own_loop"
EPOCHS = 3  # 1,438 training digits in global batches of 32 at 2 workers: 44 steps each
STEPS_PER_EPOCH = 1438 // 32


def code_lines(path):
    """The script's lines after its docstring (which says what the script is, not what it does)."""
    text = path.read_text()
    return text[text.index('"""', 3) + 3:].splitlines()


def test_the_port_takes_thirteen_lines_out_and_puts_eight_in():
    diff = list(difflib.unified_diff(code_lines(EXAMPLES / "horovod_digits.py"),
                                     code_lines(EXAMPLES / "hvdtrain_digits.py"), lineterm="", n=0))
    removed = [line for line in diff if line.startswith("-") and not line.startswith("---")]
    added = [line for line in diff if line.startswith("+") and not line.startswith("+++")]
    # What goes: the sampler and loader, the broadcasts and the DistributedOptimizer, the lr x size,
    # set_epoch, zero_grad, backward and step. What comes: the import, setup, and the loop's calls.
    assert (len(removed), len(added)) == (13, 8), "\n".join(diff)
    assert any("hvdtrain.setup(" in line for line in added)


def argv(script, *extra):
    return ["mpirun", "-np", "2", "--oversubscribe", PYTHON, str(EXAMPLES / script), "--epochs", str(EPOCHS), *extra]


def accuracy(out):
    found = re.findall(r"accuracy ([0-9.]+)%", out)
    assert len(found) == EPOCHS, out[-2000:]
    return float(found[-1])


@pytest.mark.timeout(400)
def test_the_port_learns_as_the_original_and_resumes_bitwise_after_sigkill(tmp_path):
    code, out, err = run(argv("horovod_digits.py"))
    assert code == 0, err[-3000:]
    original = accuracy(out)

    whole, killed = tmp_path / "whole", tmp_path / "killed"
    code, out, err = run(argv("hvdtrain_digits.py", "--checkpoint-dir", str(whole), "--save", str(tmp_path / "whole.pt")))
    assert code == 0, err[-3000:]
    # Both learn the digits (~94% after 3 epochs here, the port's first epoch a warm-up; chance is 10%).
    assert original > 80 and accuracy(out) > 80, (original, out[-2000:])

    kill_when(argv("hvdtrain_digits.py", "--checkpoint-dir", str(killed)),
              killed / f"ckpt-{STEPS_PER_EPOCH:09d}.pt")
    assert not list(killed.glob(f"ckpt-{EPOCHS * STEPS_PER_EPOCH:09d}*")), "the kill came too late to prove anything"
    code, out, err = run(argv("hvdtrain_digits.py", "--checkpoint-dir", str(killed), "--save", str(tmp_path / "resumed.pt")))
    assert code == 0, err[-3000:]
    assert len(re.findall(r"accuracy", out)) == EPOCHS - 1, f"the resumed run trains the epochs left:\n{out[-2000:]}"
    expected, resumed = torch.load(tmp_path / "whole.pt"), torch.load(tmp_path / "resumed.pt")
    for key, tensor in expected.items():
        assert torch.equal(tensor, resumed[key]), f"{key} differs after the resume"
