"""`hvdtrain export --format hf`: a checkpoint of a Hugging Face model as a directory transformers'
from_pretrained loads to the same logits, in one file or numbered ones with an index; a failed
export leaves the previous one whole."""
import json

import pytest
import torch

from hvdtrain.weights import hf_export
from hvdtrain.checkpoint.formats.full import FORMAT_VERSION, CheckpointStore
from hvdtrain.cli import main

transformers = pytest.importorskip("transformers")


def tiny_llama(seed):
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8,
                                      tie_word_embeddings=True)
    return transformers.LlamaForCausalLM(config)


def checkpoint_of(model, directory):
    store = CheckpointStore(directory)
    store.save({"format": FORMAT_VERSION, "model": model.state_dict(), "optimizer": {}, "scheduler": {}, "epoch": 0,
                "step": 9, "epoch_position": 0, "global_batch": 8, "world_size": 2, "config": {}}, 9)
    model.config.save_pretrained(directory.parent / "pretrained")  # as a downloaded model's config.json
    return directory.parent / "pretrained"


@pytest.mark.parametrize("max_shard_mb,files", [(5000, ["config.json", "model.safetensors"]),
                                                 (0.004, None)])  # 4 KB: one or two tensors a file
def test_a_checkpoint_exports_to_what_from_pretrained_loads(tmp_path, capsys, max_shard_mb, files):
    trained = tiny_llama(seed=1)
    config = checkpoint_of(trained, tmp_path / "ckpt")
    out = tmp_path / "hf"

    assert main(["export", str(tmp_path / "ckpt"), "--format", "hf", "--hf-config", str(config), "--out", str(out),
                 "--max-shard-mb", str(max_shard_mb)]) == 0
    written = sorted(p.name for p in out.iterdir())
    if files is not None:
        assert written == files
    else:
        index = json.loads((out / hf_export.INDEX).read_text())
        assert set(index["weight_map"].values()) == set(written) - {"config.json", hf_export.INDEX}
        assert len(written) > 5 and "lm_head.weight" not in index["weight_map"]  # the tied head once
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out)
    ids = torch.tensor([[1, 5, 9, 2, 7]])
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, trained(ids).logits)
    assert "Hugging Face format" in capsys.readouterr().out


def test_wrong_uses_are_refused_and_a_failed_export_keeps_the_previous_one(tmp_path, capsys, monkeypatch):
    config = checkpoint_of(tiny_llama(seed=2), tmp_path / "ckpt")
    out = tmp_path / "hf"
    assert main(["export", str(tmp_path / "ckpt"), "--format", "hf", "--out", str(out)]) == 2
    assert "--format hf needs --hf-config" in capsys.readouterr().err
    assert main(["export", str(tmp_path / "ckpt"), "--format", "hf", "--hf-config", str(tmp_path), "--out", str(out)]) == 1
    assert "no config.json there" in capsys.readouterr().err
    assert main(["export", str(tmp_path / "ckpt"), "--format", "hf", "--hf-config", str(config), "--out", str(out)]) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    assert main(["export", str(tmp_path / "ckpt"), "--format", "hf", "--hf-config", str(config), "--out", str(out)]) == 1
    assert "exists: choose another --out, or --force" in capsys.readouterr().err

    from hvdtrain.weights.safetensors_stream import StreamedSafetensors

    written = []
    add = StreamedSafetensors.add

    def disk_full_at_the_third_tensor(self, tensor, names):
        if len(written) == 2:
            raise OSError(28, "No space left on device")
        written.append(names)
        return add(self, tensor, names)
    monkeypatch.setattr(StreamedSafetensors, "add", disk_full_at_the_third_tensor)
    assert main(["export", str(tmp_path / "ckpt"), "--format", "hf", "--hf-config", str(config), "--out", str(out),
                 "--force"]) == 1
    assert "No space left on device" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "hf", "pretrained"]  # no staging left


def test_an_export_that_fails_after_its_weights_leaves_no_staging_and_keeps_the_previous(tmp_path, capsys,
                                                                                         monkeypatch):
    config = checkpoint_of(tiny_llama(seed=2), tmp_path / "ckpt")
    out = tmp_path / "hf"
    assert main(["export", str(tmp_path / "ckpt"), "--format", "hf", "--hf-config", str(config), "--out", str(out)]) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    def no_space(path, text):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(hf_export, "write_text_atomically", no_space)  # every weight written, then config.json
    assert main(["export", str(tmp_path / "ckpt"), "--format", "hf", "--hf-config", str(config), "--out", str(out),
                 "--force"]) == 1
    assert "No space left on device" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "hf", "pretrained"]  # no staging left
