"""Which dimensions and strategies combine is one table (hvdtrain.common.layout_rules): every pair is in it,
every refusal has a reason and a way out, and the settings' checks, the capabilities, the planner, the
topology and the docs' table agree with it."""
import subprocess
import sys
from pathlib import Path

import pytest

from hvdtrain import planner
from hvdtrain.common import capabilities as caps
from hvdtrain.common import layout_rules as rules
from hvdtrain.common.layout_rules import DIMENSIONS, EXPERT, PIPELINE, SEQUENCE, STRATEGIES, TENSOR
from hvdtrain.config.train import SEQUENCE_STRATEGIES, TrainConfig
from hvdtrain.planner.layout import EXPERT_STRATEGIES

ROOT = Path(__file__).resolve().parents[2]
PAIRS = [(a, b) for i, a in enumerate(DIMENSIONS) for b in DIMENSIONS[i + 1:]] + \
        [(d, s) for d in DIMENSIONS for s in STRATEGIES]


def settings_of(a, b):
    """TrainConfig's fields asking for ``a`` with ``b`` (sizes of 2)."""
    found = {name: 2 for name in (a, b) if name in DIMENSIONS}
    found["strategy"] = next((name for name in (a, b) if name in STRATEGIES), "ddp")
    return found


def test_every_pair_is_in_the_table_once_and_nothing_else():
    assert rules.pairs() == frozenset(frozenset(pair) for pair in PAIRS)
    assert len(rules.RULES) == len(PAIRS)


def test_its_strategies_are_train_strategys_values():
    assert rules.STRATEGIES == caps.STRATEGY_NAMES


@pytest.mark.parametrize("pair", [pair for pair in PAIRS if not rules.combines(*pair)], ids="-".join)
def test_every_refusal_has_a_reason_and_a_way_out_in_either_order(pair):
    a, b = pair
    assert rules.reason(a, b) and rules.way_out(a, b) and "{" not in rules.reason(a, b)
    assert rules.reason(b, a) == rules.reason(a, b) and rules.way_out(b, a) == rules.way_out(a, b)


def test_it_imports_neither_torch_nor_horovod():
    code = "import sys, hvdtrain.common.layout_rules; assert not {'torch', 'horovod'} & set(sys.modules), sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, timeout=60)


@pytest.mark.parametrize("pair", PAIRS, ids="-".join)
def test_the_settings_checks_refuse_exactly_what_it_refuses_with_its_reason_and_way_out(pair):
    settings = settings_of(*pair)
    if rules.combines(*pair):
        TrainConfig(**settings)
    else:
        with pytest.raises(ValueError) as refused:
            TrainConfig(**settings)
        assert rules.reason(*pair) in str(refused.value) and rules.way_out(*pair) in str(refused.value)


def test_the_messages_name_both_settings():
    with pytest.raises(ValueError, match=r"TrainConfig.sequence_parallel=2 does not work with strategy=ps: .*under "
                                         r"ddp, zero1, zero2, fsdp; use strategy=ddp, zero1, zero2 or fsdp"):
        TrainConfig(sequence_parallel=2, strategy="ps")
    with pytest.raises(ValueError, match=r"TrainConfig.tensor_parallel=2 x pipeline_parallel=2 does not work with "
                                         r"strategy=fsdp: .*; use strategy=ddp or zero1"):
        TrainConfig(tensor_parallel=2, pipeline_parallel=2, strategy="fsdp")


def test_the_capabilities_mesh_refusals_and_the_strategy_lists_are_its():
    assert tuple(caps.supporting(caps.MESH)) == rules.strategies_with(TENSOR) == rules.strategies_with(PIPELINE)
    for name in caps.STRATEGY_NAMES:
        if not rules.combines(TENSOR, name):
            assert caps.DECLARED[name].refuses[caps.MESH] == rules.reason(TENSOR, name)
    assert caps.DECLARED[caps.EXPERT_PARALLEL].refuses[caps.MESH] == rules.reason(EXPERT, TENSOR)
    assert SEQUENCE_STRATEGIES == rules.strategies_with(SEQUENCE)
    assert EXPERT_STRATEGIES == rules.strategies_with(EXPERT)


def test_the_planner_enumerates_what_it_combines():
    moe = planner.ModelShape(layers=2, d_model=32, seq_len=8, vocab=11, heads=4, experts=4, top_k=2, moe_layers=2,
                              expert_params=10000.0)
    found = planner.layouts(planner.Setup(moe, batch=16, memory=1e9, workers=4))
    mesh = {l.strategy for l in found if l.tensor * l.pipeline > 1 and l.data > 1}
    assert mesh == set(rules.strategies_with(TENSOR, PIPELINE)) - {"hsdp"}
    alone = {l.strategy for l in found if l.sequence > 1 and l.tensor == 1}
    assert alone == set(rules.strategies_with(SEQUENCE))
    assert {l.strategy for l in found if l.sequence > 1 and l.tensor > 1} == set(rules.strategies_with(SEQUENCE, TENSOR))
    assert {l.strategy for l in found if l.experts > 1} == set(rules.strategies_with(EXPERT))
    for layout in found:
        used = [d for d, size in ((TENSOR, layout.tensor), (PIPELINE, layout.pipeline), (SEQUENCE, layout.sequence),
                                  (EXPERT, layout.experts)) if size > 1]
        assert not rules.refusals({**{d: 2 for d in used}, "strategy": layout.strategy}), layout.name


def test_flipping_one_line_flips_every_reader(monkeypatch):
    assert rules.way_out(EXPERT, "ps") == "use strategy=ddp, zero1, zero2 or fsdp"
    monkeypatch.setitem(rules.RULES, (EXPERT, "hsdp"), rules.COMBINED)
    assert rules.strategies_with(EXPERT) == ("ddp", "zero1", "zero2", "fsdp", "hsdp")
    assert rules.way_out(EXPERT, "ps") == "use strategy=ddp, zero1, zero2, fsdp or hsdp"
    assert rules.check({EXPERT: 2, "strategy": "hsdp"}) is None


def test_the_docs_table_is_generated_from_it():
    page = (ROOT / "docs/concepts/model-parallelism.md").read_text()
    assert rules.table_in(page) == rules.markdown_table(), \
        "regenerate the table: hvdtrain.common.layout_rules.markdown_table()"
    for pair in PAIRS:
        if not rules.combines(*pair):
            assert rules.reason(*pair) in page
