"""Apertus' xIELU activation built on the meta device (hvdtrain.strategies.deferred_init): its alpha_p,
alpha_n, beta and eps are computed in its __init__ from the constructor's floats, which no init pass
writes; replaying its MLP's construction gives them the values of the model built whole (before,
"meta-device initialization": nothing initialized them)."""
import pytest
import torch

from hvdtrain.strategies.deferred_init import DeferredInit
from hvdtrain.verify.tiny import build_tiny, make_model

pytest.importorskip("transformers")


@pytest.mark.parametrize("family", ["apertus", "apertus1p5_text"])
def test_a_model_built_on_the_meta_device_gets_the_values_of_one_built_whole(family):
    config = build_tiny(family).config
    whole = make_model(config, seed=5)
    deferred = make_model(config, seed=0, device="meta")
    DeferredInit.of(deferred, torch.optim.SGD(deferred.parameters(), lr=0.1), torch.device("cpu"), seed=5).make_whole()
    expected, got = whole.state_dict(), deferred.state_dict()
    assert set(got) == set(expected) and any(".act_fn.alpha_p" in name for name in got)
    assert all(torch.equal(got[name], expected[name]) for name in expected)
