"""``hvdtrain bench activations`` runs for real, tiny: complete output, and the counted bytes (exact
on any CPU) fall with the blocks checkpointed; never speed."""
import json

from hvdtrain.cli import main


def test_the_bench_counts_what_each_mode_keeps_and_times_every_step(tmp_path, capsys):
    code = main(["bench", "activations", "--d-model", "32", "--layers", "4", "--seq-len", "16", "--vocab", "37",
                 "--batch", "4", "--steps", "2", "--out", str(tmp_path)])
    result = json.loads((tmp_path / "activations.json").read_text())
    modes = result["modes"]

    assert code == 0
    assert [modes[m]["blocks"] for m in ("none", "every_k", "full")] == [0, 2, 4]
    saved = {m: modes[m]["activation_bytes"] for m in modes}
    # 2 of 4 identical blocks checkpointed save exactly half of what all 4 save.
    assert saved["none"] - saved["every_k"] == saved["every_k"] - saved["full"] > 0
    assert modes["none"]["bytes_ratio"] == 1.0 and modes["full"]["bytes_ratio"] == saved["full"] / saved["none"]
    assert all(modes[m]["step_s"]["repeats"] == 2 and modes[m]["step_s"]["median"] > 0 for m in modes)
    assert "time x none" in capsys.readouterr().out
