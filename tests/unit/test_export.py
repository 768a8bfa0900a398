"""An exported model loads without hvdtrain, into the user's own module, and computes the same."""
import pytest
import torch
import yaml
from safetensors.torch import load_file
from torch import nn

from hvdtrain.weights import export
from hvdtrain.weights.hf_export import distinct_tensors, shared_names


class TiedLM(nn.Module):
    """An embedding tied to the output layer: two names, one storage (safetensors refuses that as is)."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(11, 6)
        self.mix = nn.Linear(6, 6)
        self.norm = nn.BatchNorm1d(6)  # buffers (running statistics) are part of the state too
        self.head = nn.Linear(6, 11, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens):
        return self.head(self.norm(torch.tanh(self.mix(self.embed(tokens)))))


def save_checkpoint(directory, model_state, step, **run):
    """A full checkpoint of ``model_state`` at ``step`` in ``directory`` (its path), as a run writes one."""
    from hvdtrain.checkpoint.formats.full import FORMAT_VERSION, CheckpointStore

    return CheckpointStore(directory).save({"format": FORMAT_VERSION, "model": model_state, "optimizer": {},
                                            "scheduler": {}, "epoch": 0, "step": step, "epoch_position": 0,
                                            "global_batch": 8, "world_size": 2, **run}, step)


def export_state(state, directory, config=None, metadata=None):
    """A whole state_dict exported as ``hvdtrain export`` exports a full checkpoint's: a tied tensor
    handed once, written under each of its names."""
    return export.export_tensors(distinct_tensors(state), shared_names(state), directory, config, metadata)


def test_exported_weights_load_into_the_users_module_and_compute_the_same(tmp_path):
    trained = TiedLM(seed=0)
    trained.train()
    trained(torch.arange(11))  # moves the BatchNorm statistics away from their initial values
    trained.eval()
    weights = export_state(trained.state_dict(), tmp_path / "out", config={"train": {"lr": 0.1}},
                           metadata={"step": 7, "strategy": "fsdp"})

    fresh = TiedLM(seed=1).eval()
    tokens = torch.tensor([3, 1, 4, 1, 5])
    assert not torch.equal(fresh(tokens), trained(tokens))
    fresh.load_state_dict(load_file(str(weights)))
    assert torch.equal(fresh(tokens), trained(tokens))
    assert export.read_metadata(weights) == {"format": "pt", "step": 7, "strategy": "fsdp"}
    assert yaml.safe_load((tmp_path / "out" / "config.yaml").read_text()) == {"train": {"lr": 0.1}}


def test_a_checkpoint_exports_its_model_and_settings(tmp_path, capsys):
    from hvdtrain.cli import main

    model = TiedLM(seed=2)
    path = save_checkpoint(tmp_path / "ckpt", model.state_dict(), 42, strategy="zero2", world_size=4,
                           config={"train": {"strategy": "zero2"}, "model": {"width": 6}})
    assert main(["export", str(path), "--out", str(tmp_path / "out")]) == 0
    weights = tmp_path / "out" / "model.safetensors"
    loaded = load_file(str(weights))
    assert set(loaded) == set(model.state_dict())
    assert all(torch.equal(loaded[name], value) for name, value in model.state_dict().items())
    assert export.read_metadata(weights)["step"] == 42
    assert yaml.safe_load((tmp_path / "out" / "config.yaml").read_text())["model"] == {"width": 6}


def test_a_failed_export_leaves_the_previous_file_whole(tmp_path, monkeypatch):
    first = export_state(TiedLM(seed=0).state_dict(), tmp_path)
    before = first.read_bytes()

    def half_written(source, out, length=0):
        out.write(b"\x00" * 10)
        raise OSError("disk full")

    from hvdtrain.weights import safetensors_stream
    monkeypatch.setattr(safetensors_stream.shutil, "copyfileobj", half_written)
    with pytest.raises(OSError, match="disk full"):
        export_state(TiedLM(seed=3).state_dict(), tmp_path)
    assert first.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]  # no temporary left


def test_a_state_entry_that_is_not_a_tensor_is_named(tmp_path, capsys):
    from hvdtrain.cli import main

    with pytest.raises(TypeError, match="'extra'"):
        export.export_tensors({"weight": torch.ones(2), "extra": 3}.items(), {}, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no data file left
    path = save_checkpoint(tmp_path / "ckpt", {"weight": torch.ones(2), "extra": 3}, 1)
    assert main(["export", str(path)]) == 1
    assert "model state entry 'extra' is a int, not a tensor" in capsys.readouterr().err


def test_the_export_command_takes_a_checkpoint_file_or_the_newest_in_a_directory(tmp_path, capsys):
    from hvdtrain.cli import main

    models = {step: TiedLM(seed=step).state_dict() for step in (5, 10)}
    for step, state in models.items():
        save_checkpoint(tmp_path / "ckpt", state, step, config={"train": {"seed": step}})

    assert main(["export", str(tmp_path / "ckpt")]) == 0  # the newest: step 10
    written = tmp_path / "ckpt" / "ckpt-000000010-export"
    loaded = load_file(str(written / "model.safetensors"))
    assert all(torch.equal(loaded[k], v) for k, v in models[10].items())
    assert yaml.safe_load((written / "config.yaml").read_text()) == {"train": {"seed": 10}}

    assert main(["export", str(tmp_path / "ckpt" / "ckpt-000000005.pt"), "--out", str(tmp_path / "five")]) == 0
    assert torch.equal(load_file(str(tmp_path / "five" / "model.safetensors"))["mix.weight"], models[5]["mix.weight"])
    assert main(["export", str(tmp_path / "ckpt")]) == 1
    assert "exists: choose another --out, or --force" in capsys.readouterr().err
    assert main(["export", str(tmp_path / "nothing")]) == 1
    assert "does not exist" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main(["export", str(tmp_path / "empty")]) == 1
    assert "holds no valid checkpoint" in capsys.readouterr().err


def test_a_streamed_export_is_the_same_file_content_one_tensor_at_a_time(tmp_path):
    from hvdtrain.strategies.base import tensor_names

    model = TiedLM(seed=3)
    model.mix.to(torch.bfloat16)  # safetensors' own dtype names, a 2-byte float among them
    model.register_buffer("mask", torch.tensor([True, False, True]))
    aliases = {names[0]: names for names, _ in tensor_names(model)}
    handed = []

    def one_at_a_time():
        for names, value in tensor_names(model):
            handed.append(names[0])
            yield names[0], value.detach()

    failure = export.export_model_streamed(one_at_a_time(), aliases, tmp_path, writes=True,
                                           metadata={"step": 3, "strategy": "fsdp"})
    loaded, state = load_file(str(tmp_path / "model.safetensors")), model.state_dict()

    assert failure is None
    assert "head.weight" not in handed and set(loaded) == set(state)  # the tied weight under both names
    assert all(loaded[name].dtype == value.dtype and torch.equal(loaded[name], value) for name, value in state.items())
    assert export.read_metadata(tmp_path / "model.safetensors") == {"format": "pt", "step": 3, "strategy": "fsdp"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]  # no data file left


def test_a_rank_that_does_not_write_only_iterates_and_a_failed_write_is_reported(tmp_path):
    first = export_state(TiedLM(seed=0).state_dict(), tmp_path)
    before = first.read_bytes()
    consumed = []

    def tensors():
        for name, value in TiedLM(seed=1).state_dict().items():
            consumed.append(name)
            yield name, value

    assert export.export_model_streamed(tensors(), {}, tmp_path, writes=False) is None
    assert len(consumed) == len(TiedLM(seed=1).state_dict())  # iterated to the end: they may be collectives
    unsupported = iter([("ok", torch.ones(2)), ("complex", torch.ones(2, dtype=torch.complex64)), ("rest", torch.ones(1))])
    failure = export.export_model_streamed(unsupported, {}, tmp_path, writes=True)
    assert failure is not None and "complex: safetensors has no dtype torch.complex64" in failure
    assert next(unsupported, None) is None
    assert first.read_bytes() == before  # the previous file untouched
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]


@pytest.mark.parametrize("fails", ["config", "interrupted"])
def test_a_failed_or_interrupted_export_into_a_new_directory_leaves_nothing(tmp_path, monkeypatch, fails):
    from hvdtrain.weights.safetensors_stream import StreamedSafetensors

    if fails == "config":  # the weights are written whole, then the settings cannot be
        def no_space(path, text):
            raise OSError(28, "No space left on device")
        monkeypatch.setattr(export, "write_text_atomically", no_space)
        expected = OSError
    else:  # Ctrl-C while the third tensor is written
        add, seen = StreamedSafetensors.add, []

        def interrupted_at_the_third(self, tensor, names):
            seen.append(names)
            if len(seen) == 3:
                raise KeyboardInterrupt
            return add(self, tensor, names)
        monkeypatch.setattr(StreamedSafetensors, "add", interrupted_at_the_third)
        expected = KeyboardInterrupt
    with pytest.raises(expected):
        export_state(TiedLM(seed=0).state_dict(), tmp_path / "new", config={"train": {"lr": 0.1}})
    assert sorted(p.name for p in tmp_path.iterdir()) == []
