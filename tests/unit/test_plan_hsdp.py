"""The planner's hsdp: fsdp's state over a node's K ranks (16 Psi / K for fp32 Adam, plus the largest unit
while it computes), fsdp's exchange within the node and one all-reduce of Psi / K across the nodes per
step; listed by ``hvdtrain plan`` when a node holds more than one worker and fewer than all."""
import pytest

from hvdtrain import cli
from hvdtrain import planner
from hvdtrain.planner.step_time import _gradient_comm_s

SMALL = planner.ModelShape(layers=2, d_model=32, seq_len=8, vocab=11, heads=4)


def setup(**changes):
    return planner.Setup(**{"shape": SMALL, "batch": 32, "memory": 1e9, "workers": 8, "gpus_per_node": 4,
                            "network": "10gbe", **changes})


def test_hsdp_holds_fsdps_share_over_one_node():
    psi = SMALL.total
    hsdp = planner.memory(setup(), planner.Layout("hsdp", 1, 1, 8, shard=4))
    fsdp = planner.memory(setup(), planner.Layout("fsdp", 1, 1, 8))
    # fp32 Adam: parameters 4, gradients 4, moments 8 bytes per element, over K = 4 ranks (fsdp's over all 8).
    assert (hsdp.parameters, hsdp.gradients, hsdp.optimizer_state) == pytest.approx((psi, psi, 2 * psi))
    assert hsdp.states == pytest.approx(16 * psi / 4) and fsdp.states == pytest.approx(16 * psi / 8)
    assert hsdp.gathered == fsdp.gathered > 0  # the largest unit whole while it computes, as under fsdp
    assert sum(planner.sharded_state_bytes("hsdp", psi, 4, 4, 8, 8, shard_ranks=2).values()) == 16 * psi / 2


def test_hsdp_exchanges_within_the_node_and_its_slice_across_nodes():
    plan = setup()
    grads = SMALL.total * 4
    units = SMALL.layers + 1
    hideable, exposed = _gradient_comm_s(plan, planner.Layout("hsdp", 1, 1, 8, shard=4), SMALL.total)
    # fsdp's 1.5 x per unit within the node (stride 1, 4 ranks); then 1/4 of the gradients all-reduced over
    # the 2 ranks holding the same slice, 4 apart: one per node.
    assert hideable == pytest.approx(1.5 * units * planner.allreduce_s(plan, grads / units, 4, 1))
    assert exposed == pytest.approx(planner.allreduce_s(plan, grads / 4, 2, 4)) and exposed > 0
    fsdp_hideable, _ = _gradient_comm_s(plan, planner.Layout("fsdp", 1, 1, 8), SMALL.total)
    # Across the 10 GbE link fsdp's rings carry the whole model 1.5 times; hsdp's only a quarter of it once.
    assert hideable + exposed < fsdp_hideable
    estimate = planner.estimate(plan, planner.Layout("hsdp", 1, 1, 8, shard=4))
    assert estimate.update_s == pytest.approx(SMALL.total / 4 * 28 / planner.DEFAULT_UPDATE_BANDWIDTH)


def test_hsdp_is_a_layout_only_between_ddp_and_fsdp():
    names = {layout.name for layout in planner.layouts(setup())}
    assert "hsdp T=1 P=1 D=8 K=4" in names
    for gpus in (1, 8, 3):  # one worker per node: ddp; one node: fsdp; 3 does not divide 8
        assert not any(layout.strategy == "hsdp" for layout in planner.layouts(setup(gpus_per_node=gpus)))
    with pytest.raises(ValueError, match="hsdp, and only hsdp, has shard groups"):
        planner.Layout("hsdp", 1, 1, 8)
    with pytest.raises(ValueError, match="K > 1 ranks dividing the 8 data ranks"):
        planner.Layout("hsdp", 1, 1, 8, shard=3)


def test_plan_lists_hsdp(capsys):
    assert cli.main(["plan", "--example", "textlm", "--workers", "8", "--gpus-per-node", "4",
                     "--memory", "2GiB"]) == 0
    assert "hsdp K=4" in capsys.readouterr().out
