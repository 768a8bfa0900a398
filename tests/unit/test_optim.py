import pytest

from hvdtrain.training.lr import lr_scale, warmup_factor


def test_scale_is_global_batch_over_one_worker_batch_or_one_when_disabled():
    assert lr_scale(global_batch=32 * 8 * 2, base_batch=32, enabled=True) == 16.0  # 8 workers x 2 micro
    assert lr_scale(global_batch=512, base_batch=32, enabled=False) == 1.0
    # Resumed on 4 workers with the global batch of 8 x 32: the per-worker batch grows, the LR stays.
    assert lr_scale(global_batch=256, base_batch=32, enabled=True) == 8.0


def test_warmup_rises_linearly_from_the_single_worker_rate_to_the_scaled_rate():
    factor = warmup_factor(scale=4.0, warmup_steps=10)
    assert factor(0) == pytest.approx(0.25)   # 4x scaled LR x 0.25 = the one-worker LR
    assert factor(5) == pytest.approx(0.625)
    assert factor(10) == pytest.approx(1.0)
    assert factor(1000) == pytest.approx(1.0)


@pytest.mark.parametrize("scale,steps", [(1.0, 10), (4.0, 0)])
def test_no_warmup_when_nothing_is_scaled_or_no_steps_are_asked(scale, steps):
    assert warmup_factor(scale, steps)(0) == 1.0


def test_a_non_positive_scale_is_refused():
    with pytest.raises(ValueError, match="LR scale must be positive"):
        warmup_factor(0.0, 10)
