"""``hvdtrain check-layout``'s arguments: every bad input is refused with exit status 2 and a
message that says what to give, before anything is launched; and how outcomes are reported."""
import pytest

from hvdtrain.cli import build_parser
from hvdtrain.verify.layouts import layout_for
from hvdtrain.verify.outcome import Outcome, refusal_reason
from hvdtrain.verify import table


def check(capsys, *argv):
    args = build_parser().parse_args(["check-layout", *argv])
    status = args.run(args)
    return status, capsys.readouterr().err


def test_the_flags_parse_in_both_spellings():
    args = build_parser().parse_args(["check-layout", "gemma2", "--tensor_parallel=2", "--pipeline-parallel", "2",
                                      "--strategy=fsdp", "--optimizer", "sgd", "--steps", "4"])
    assert (args.model, args.tensor_parallel, args.pipeline_parallel, args.strategy, args.optimizer, args.steps) == \
        ("gemma2", 2, 2, "fsdp", "sgd", 4)


@pytest.mark.parametrize("argv,says", [
    (["lama", "--tensor_parallel=2"], "did you mean llama"),
    (["llama", "--tensor_parallel=0"], "--tensor_parallel must be a whole number >= 1"),
    (["llama", "--strategy=zero9"], "choose one of ddp"),
    (["llama", "--steps=0"], "--steps must be >= 1"),
    (["./no/such/model", "--tensor_parallel=2"], "is not a directory"),
])
def test_bad_input_exits_2_saying_what_to_give(capsys, argv, says):
    status, err = check(capsys, *argv)
    assert status == 2 and says in err, err


def test_a_directory_without_config_json_exits_2(capsys, tmp_path):
    status, err = check(capsys, str(tmp_path), "--tensor_parallel=2")
    assert status == 2 and "has no config.json" in err


def test_without_a_mesh_two_replicas_are_compared():
    assert layout_for(1, 1, "fsdp", meta=True).ranks == 2
    assert layout_for(2, 2).ranks == 4 and layout_for(2, 2).name == "T2xP2"


def test_refusals_are_counted_by_reason():
    assert refusal_reason("tensor plan: 'x.experts.gate_up_proj' matches no module of M") == \
        "tp plan names modules the model lacks"
    assert refusal_reason("train.tensor_parallel=2 needs a tensor plan: ...") == "no tp plan"
    assert refusal_reason("something new") == "other"


def test_a_split_forward_that_fails_at_set_up_is_counted_as_such():
    # doge: its dynamic mask is computed for every key/value head, its split attention holds half of them
    message = ("tensor parallelism would train another model than one process (found at set-up): the split model's "
               "forward failed on a probe: RuntimeError: The size of tensor a (2) must match the size of tensor b (4)")
    assert refusal_reason(message) == "tp: split forward fails (set-up probe)"


def test_the_table_counts_a_pair_by_its_worse_optimizer():
    outcomes = [Outcome("a", "T2", "adamw", "equal", max_diff=1e-14, loss_diff=0.0),
                Outcome("a", "T2", "sgd", "differs", max_diff=3e-3, loss_diff=1e-3, parameter="w",
                        parameter_diff=3e-3, parameter_size=0.1),
                Outcome("b", "T2", "adamw", "refused", message="needs a tensor plan", reason="no tp plan"),
                Outcome("b", "T2", "sgd", "refused", message="needs a tensor plan", reason="no tp plan")]
    assert table.counts(outcomes, ["T2"])["T2"] == {"differs": 1, "refused: no tp plan": 1}
    page = table.markdown(outcomes, ["T2"], {"a": "tp+pp", "b": "no plan"}, {"date": "today"})
    assert "| a | T2 | sgd | differs | 3.0e-03 | `w`" in page and "**differs** 3e-03 (sgd)" in page


def test_every_dimension_has_its_flag_in_both_spellings():
    args = build_parser().parse_args(["check-layout", "qwen3_moe", "--sequence-parallel", "2", "--expert_parallel=2",
                                      "--hsdp-shard-size=2", "--strategy=hsdp"])
    assert (args.sequence_parallel, args.expert_parallel, args.hsdp_shard_size) == (2, 2, 2)


@pytest.mark.parametrize("argv,says", [
    (["llama", "--expert_parallel=2", "--strategy=ps"], "does not work with strategy=ps: its servers step every parameter"),
    (["llama", "--expert_parallel=2", "--tensor_parallel=2"], "expert parallelism does not combine with tensor"),
    (["llama", "--sequence_parallel=2", "--pipeline_parallel=2"], "pass whole micro-batches"),
    (["llama", "--sequence_parallel=2", "--strategy=hsdp"], "does not work with strategy=hsdp"),
    (["llama", "--expert_parallel=3", "--data_parallel=4"], "expert_parallel=3 does not divide the 4 workers"),
    (["llama", "--hsdp_shard_size=2"], "applies to --strategy=hsdp only"),
    (["llama", "--strategy=hsdp", "--hsdp_shard_size=3", "--data_parallel=4"], "divisor of 4"),
    (["llama", "--sequence_parallel=0"], "--sequence_parallel must be a whole number >= 1"),
])
def test_a_layout_the_rules_refuse_exits_2_with_the_reason_before_any_launch(capsys, argv, says):
    status, err = check(capsys, *argv)
    assert status == 2 and says in err, err


def test_each_ranks_coordinates_in_every_dimension_are_printed_before_the_launch(capsys, monkeypatch):
    from hvdtrain.verify import driver

    launched = []
    monkeypatch.setattr(driver, "run", lambda *args, **kwargs: launched.append(kwargs["extra_args"]) or [])
    args = build_parser().parse_args(["check-layout", "llama", "--tensor_parallel=2", "--sequence_parallel=2"])
    assert args.run(args) == 0
    out = capsys.readouterr().out
    assert "llama under T2xS2 (4 ranks" in out
    assert "rank 1: data 0/2, tensor 1/2, sequence 0/2" in out and "rank 2: data 1/2, tensor 0/2, sequence 1/2" in out
    assert launched[0][launched[0].index("--sequence") + 1] == "2"


def test_expert_and_hsdp_layouts_take_as_many_replicas_as_their_groups():
    from hvdtrain.cli.check_layout import coordinate_lines

    experts = layout_for(1, 1, "fsdp", experts=4)
    assert experts.ranks == 4 and experts.settings()["expert_parallel"] == 4 and experts.name == "D4xE4 fsdp"
    assert coordinate_lines(experts)[2] == "rank 2: data 2/4, expert 2/4"
    hsdp = layout_for(1, 1, "hsdp", shard=2, data=4)
    assert coordinate_lines(hsdp)[3] == "rank 3: data 3/4, shard 1/2, replica 1/2"
