"""strategy=ps in the settings: ps_servers belongs to it, and what it does not combine with is refused
with the reason, before any process starts training."""
import pytest

from hvdtrain.config.train import TrainConfig


@pytest.mark.parametrize("settings,says", [
    ({"checkpoint_format": "sharded"}, "optimizer state lives on the servers only"),
    ({"compile": True}, "torch.compile is not tested with it"),
    ({"reduction": "adasum"}, "Adasum .* has no form on a slice"),
])
def test_ps_refuses_what_it_cannot_do_with_the_reason(settings, says):
    with pytest.raises(ValueError, match=f"strategy=ps does not work with .*{says}"):
        TrainConfig(strategy="ps", **settings)


def test_ps_servers_belongs_to_ps():
    assert TrainConfig(strategy="ps", ps_servers=3).ps_servers == 3
    with pytest.raises(ValueError, match="ps_servers=2 applies to strategy=ps only"):
        TrainConfig(strategy="ddp", ps_servers=2)
    for wrong in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="ps_servers must be a whole number >= 1"):
            TrainConfig(strategy="ps", ps_servers=wrong)
