"""A Hugging Face fine-tune with its own loop (examples/finetune/plain.py: dynamic padding, a cosine
schedule with warm-up, clipping, its own evaluation, torch.save), ported both ways: to the library
API (own_loop.py) and to the Trainer (trainer.py). Both keep the padding and the cosine decay, and
at 2 workers they train bitwise the same weights: one code path under both."""
import re

import pytest
import torch

from tests.launch.helpers import PYTHON, ROOT, code_lines, port_diff, run

pytest.importorskip("transformers")

EXAMPLES = ROOT / "examples" / "finetune"


@pytest.mark.parametrize("port,removed_added", [("own_loop.py", (11, 15)), ("trainer.py", (13, 14))])
def test_each_port_changes_this_many_lines(port, removed_added):
    removed, added, diff = port_diff(EXAMPLES / "plain.py", EXAMPLES / port)
    assert (len(removed), len(added)) == removed_added, diff
    # Kept: the collator's dynamic padding and Hugging Face's cosine schedule.
    assert any("DataCollatorWithPadding(tokenizer)" in line for line in code_lines(EXAMPLES / port))
    assert any("get_cosine_schedule_with_warmup(" in line for line in added)


def accuracies(out):
    return [float(value) for value in re.findall(r"validation accuracy ([0-9.]+)", out)]


@pytest.mark.timeout(300)
def test_the_two_ports_train_bitwise_the_same_weights_and_learn(tmp_path):
    code, out, err = run([PYTHON, str(EXAMPLES / "plain.py"), "--save", str(tmp_path / "plain.pt")])
    assert code == 0, err[-3000:]
    plain = accuracies(out)
    weights, printed = {}, {}
    for port in ("own_loop.py", "trainer.py"):
        saved = tmp_path / f"{port}.pt"
        code, out, err = run(["mpirun", "-np", "2", "--oversubscribe", PYTHON, str(EXAMPLES / port), "--save", str(saved)])
        assert code == 0, err[-3000:]
        weights[port], printed[port] = torch.load(saved), accuracies(out)
    # Rank 0 alone prints, once per epoch; the same evaluation of the same weights in both ports.
    assert len(printed["own_loop.py"]) == 3 and printed["own_loop.py"] == printed["trainer.py"], printed
    for key, tensor in weights["own_loop.py"].items():
        assert torch.equal(tensor, weights["trainer.py"][key]), f"{key} differs between the two ports"
    # The four topics' largest holds a third of the sentences: above 0.5 is learning, for every run.
    assert plain[-1] > 0.5 and printed["trainer.py"][-1] > 0.5, (plain, printed)
