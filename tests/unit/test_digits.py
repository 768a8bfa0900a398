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


def test_the_digits_are_scikit_learns_read_without_importing_it():
    import subprocess
    import sys

    import numpy as np
    from sklearn.datasets import load_digits

    from hvdtrain.examples.digits import read_digits

    pixels, labels = read_digits()
    digits = load_digits()
    assert np.array_equal(pixels, digits.data) and np.array_equal(labels, digits.target)
    train, _ = load_digits_datasets()
    order = torch.randperm(1797, generator=torch.Generator().manual_seed(0))[359:]
    assert torch.equal(train.tensors[0], torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1)[order] / 16.0)
    # scikit-learn's import (scipy and all) cost every rank seconds of start-up: the data alone is read.
    imported = subprocess.run([sys.executable, "-c", "import sys\nfrom hvdtrain.examples.digits import "
                               "load_digits_datasets\nload_digits_datasets()\nprint('sklearn' in sys.modules)"],
                              capture_output=True, text=True, timeout=120)
    assert imported.stdout.strip() == "False", imported.stderr[-2000:]
