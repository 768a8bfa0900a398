"""The schedules as action lists (hvdtrain.parallel.pipeline.actions), without MPI: every pass of
every (micro-batch, chunk) exactly once, in an order that runs (the unit-time simulation finds each
pass's input done before it), and the idle fractions of their formulas: the interleaved 1F1B's
(P - 1) / (v·M + P - 1), ZB-H1's a third of 1F1B's idle time at F = B = W."""
import itertools

import pytest

from hvdtrain.parallel.pipeline.actions import (Action, bubble_formula, interleaved_actions, schedule_actions,
                                                simulate, zero_bubble_actions)

LAYOUTS = [(p, v, m) for p, v, m in itertools.product((2, 3, 4), (1, 2, 3), (1, 2, 3, 4, 6, 8, 12))
           if v == 1 or m % p == 0]


def passes(lists, kinds):
    return sorted((a.kind, a.micro_batch, a.chunk) for order in lists for a in order if a.kind in kinds)


@pytest.mark.parametrize("stages,virtual,micro_batches", LAYOUTS)
def test_interleaved_runs_every_pass_once_on_its_chunks_stage(stages, virtual, micro_batches):
    lists = interleaved_actions(stages, virtual, micro_batches)
    chunks = stages * virtual
    expected = sorted((k, i, g) for k in "BF" for i in range(micro_batches) for g in range(chunks))
    assert passes(lists, "FB") == expected
    for stage, order in enumerate(lists):
        assert all(a.chunk % stages == stage for a in order)
        # A chunk's backward of a micro-batch after its forward on the same stage.
        seen = set()
        for a in order:
            if a.kind == "B":
                assert ("F", a.micro_batch, a.chunk) in seen
            seen.add((a.kind, a.micro_batch, a.chunk))
    simulate(lists, stages, chunks)  # raises on a deadlock: some pass's input never comes


@pytest.mark.parametrize("stages,virtual,micro_batches", LAYOUTS)
def test_interleaved_idles_p_minus_1_over_v_m_plus_p_minus_1(stages, virtual, micro_batches):
    """At F = 1, B = 2 (a whole backward) every stage idles exactly the formula's fraction of the step."""
    sim = simulate(interleaved_actions(stages, virtual, micro_batches), stages, stages * virtual, {"B": 2})
    for fraction in sim.idle_fraction():
        assert fraction == pytest.approx(bubble_formula("1f1b", stages, virtual, micro_batches), abs=1e-12)


def test_one_chunk_is_1f1b_and_more_chunks_shrink_the_bubble():
    assert interleaved_actions(2, 1, 3)[0] == [Action("F", 0, 0), Action("F", 1, 0), Action("B", 0, 0),
                                               Action("F", 2, 0), Action("B", 1, 0), Action("B", 2, 0)]
    idle = [simulate(interleaved_actions(4, v, 8), 4, 4 * v, {"B": 2}).idle_fraction()[0] for v in (1, 2, 4)]
    assert idle[0] > idle[1] > idle[2]


@pytest.mark.parametrize("micro_batches", [1, 2, 5, 6])
def test_interleaving_refuses_micro_batches_not_a_multiple_of_p(micro_batches):
    with pytest.raises(ValueError, match="choose micro_batches a multiple of pipeline_parallel=4"):
        interleaved_actions(4, 2, micro_batches)


@pytest.mark.parametrize("stages,micro_batches", list(itertools.product((2, 3, 4, 8), (1, 2, 3, 4, 8, 16))))
def test_zero_bubble_runs_every_f_b_and_w_once_after_its_b(stages, micro_batches):
    lists = zero_bubble_actions(stages, micro_batches)
    expected = sorted((k, i, s) for k in "BFW" for i in range(micro_batches) for s in range(stages))
    assert passes(lists, "FBW") == expected
    for stage, order in enumerate(lists):
        done = set()
        for a in order:
            assert a.chunk == stage
            if a.kind == "W":
                assert ("B", a.micro_batch) in done
            if a.kind == "B":
                assert ("F", a.micro_batch) in done
            done.add((a.kind, a.micro_batch))
    sim = simulate(lists, stages, stages)
    # 1F1B's memory: no stage holds more than P micro-batches (F done, W not yet).
    assert max(sim.held) <= stages


@pytest.mark.parametrize("stages,micro_batches", list(itertools.product((2, 3, 4, 8), (4, 8, 16, 32))))
def test_zero_bubble_idles_a_third_of_1f1b_at_equal_costs(stages, micro_batches):
    """F = B = W = 1 unit (1F1B's whole backward: B + W = 2): ZB-H1 idles P - 1 units per stage, 1F1B 3 (P - 1)."""
    if micro_batches < stages:
        pytest.skip("the steady state needs M >= P")
    zero = simulate(zero_bubble_actions(stages, micro_batches), stages, stages)
    one = simulate(interleaved_actions(stages, 1, micro_batches), stages, stages, {"B": 2})
    for z, o in zip(zero.idle, one.idle):
        assert z == pytest.approx(o / 3)
    for fraction in zero.idle_fraction():
        assert fraction == pytest.approx(bubble_formula("zb-h1", stages, 1, micro_batches))
    assert max(zero.held) <= stages


def test_a_list_that_waits_on_itself_is_found():
    crossed = [[Action("F", 0, 0), Action("B", 0, 0)], [Action("B", 0, 1), Action("F", 0, 1)]]
    with pytest.raises(ValueError, match="deadlocks"):
        simulate(crossed, 2, 2)


def test_schedule_actions_refuses_chunks_beyond_1f1b():
    with pytest.raises(ValueError, match="pipeline_virtual_stages=1"):
        schedule_actions("zb-h1", 2, 2, 4)
    with pytest.raises(ValueError, match="unknown pipeline schedule"):
        schedule_actions("zb-v", 2, 1, 4)
