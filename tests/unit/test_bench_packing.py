"""``hvdtrain bench packing`` runs for real, tiny: the same documents both ways, every field of its
table and file, and padded batches carrying more padding than packed rows (counted); never speed."""
import json

import pytest

from hvdtrain.cli import main

pytest.importorskip("transformers")


def test_the_bench_trains_the_same_tokens_packed_and_padded_and_counts_their_padding(tmp_path, capsys):
    code = main(["bench", "packing", "--documents", "12", "--median-length", "6", "--row-length", "16", "--batch", "2",
                 "--hidden", "16", "--layers", "1", "--heads", "2", "--vocab", "32", "--passes", "1",
                 "--out", str(tmp_path)])
    result = json.loads((tmp_path / "packing.json").read_text())
    packed, padded = result["ways"]["packed"], result["ways"]["padded"]
    out = capsys.readouterr().out

    assert code == 0
    assert packed["real_tokens"] == padded["real_tokens"] > 12  # the same documents, at least 2 tokens each
    assert padded["padding_share"] > packed["padding_share"] >= 0
    assert packed["steps"] < padded["steps"] >= 6  # 12 documents or more pieces of them, 2 a step
    for way in (packed, padded):
        assert way["padding_share"] == pytest.approx(1 - way["real_tokens"] / way["token_slots"])
        assert way["tokens_per_s"]["repeats"] == 1 and way["tokens_per_s"]["median"] > 0
    # One round: the speed-up is that round's pair of passes.
    assert result["packed_over_padded"]["median"] == pytest.approx(packed["tokens_per_s"]["median"]
                                                                   / padded["tokens_per_s"]["median"])
    assert "real tokens/s" in out and "x padded" in out
