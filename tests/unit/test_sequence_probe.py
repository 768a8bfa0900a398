"""The sequence probe's verdict, agreed from every rank's: the same words on every rank, naming the
first rank whose split model differs and its figures (a convolution moves only the later ranks' parts)."""
from hvdtrain.parallel.sequence.probe import agreed_problem

RANK_1 = "on a probe of 8 tokens per sequence, split over 2 ranks, the logits are 0.31 and the loss 2e-17 away"


def test_no_rank_differs_no_problem():
    assert agreed_problem(["", "", ""]) == ""


def test_the_rank_that_differs_is_named_with_its_figures():
    assert agreed_problem(["", RANK_1]) == f"rank 1 of 2: {RANK_1}"


def test_the_first_that_differs_speaks_and_the_others_are_listed():
    assert agreed_problem(["", "first", "", "third"]) == "rank 1 of 4: first (and rank 3 likewise)"
    assert agreed_problem(["zero", "one", "two"]) == "rank 0 of 3: zero (and ranks 1, 2 likewise)"
