import torch

from hvdtrain.examples.digits import DigitsCNN, load_digits_datasets


def test_digits_split_is_fixed_disjoint_and_complete():
    train, val = load_digits_datasets(val_fraction=0.2, split_seed=0)
    again, _ = load_digits_datasets(val_fraction=0.2, split_seed=0)
    assert (len(train), len(val)) == (1438, 359)
    assert torch.equal(train.tensors[0], again.tensors[0])
    images = torch.cat([train.tensors[0], val.tensors[0]]).reshape(1797, -1)
    assert images.min() >= 0 and images.max() <= 1
    assert set(val.tensors[1].tolist()) == set(range(10))


def test_the_cnn_maps_a_batch_of_digits_to_ten_logits():
    model = DigitsCNN()
    assert model(torch.zeros(5, 1, 8, 8)).shape == (5, 10)
    assert 100_000 < sum(p.numel() for p in model.parameters()) < 300_000
