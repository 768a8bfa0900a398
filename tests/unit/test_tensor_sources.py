"""Every source of a model's tensors answers the same questions (hvdtrain.checkpoint.sources.contract),
and one that cannot answer says so; a strategy's read of a weights-only source keeps its optimizer."""
import json
import re

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from hvdtrain.checkpoint import CheckpointError
from hvdtrain.checkpoint.sources.contract import TensorSource
from hvdtrain.checkpoint.sources.full import FullStateSource
from hvdtrain.checkpoint.sources.mesh import MeshSource
from hvdtrain.checkpoint.sources.sharded import ShardedSource
from hvdtrain.weights.pretrained import SafetensorsSource


def test_every_source_is_one_of_the_contract():
    for cls in (FullStateSource, ShardedSource, MeshSource, SafetensorsSource):
        assert issubclass(cls, TensorSource), cls
        assert not getattr(cls, "__abstractmethods__", None), cls


def full_state():
    model = nn.Linear(4, 3)
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict()}


def test_a_full_checkpoint_answers_by_name_and_by_index():
    state = full_state()
    source = FullStateSource(state)
    assert source.model_keys == ["weight", "bias"]
    assert source.holds("weight") and not source.holds("other")
    assert source.shape("weight") == (3, 4)
    assert torch.equal(source.read("weight", 2, 7), state["model"]["weight"].reshape(-1)[2:7])
    assert source.parameter_count() == 2 and source.param_groups() == state["optimizer"]["param_groups"]
    assert torch.equal(source.optimizer_state_of(0, "weight")["exp_avg"], state["optimizer"]["state"][0]["exp_avg"])
    assert source.held_state() is state
    with pytest.raises(CheckpointError, match="by parameter index"):
        source.optimizer_state("weight")


def test_a_weights_directory_answers_the_model_and_says_it_has_no_optimizer_state(tmp_path):
    weights = {"weight": torch.arange(12.0).reshape(3, 4), "bias": torch.zeros(3)}
    save_file(weights, str(tmp_path / "model.safetensors"))
    source = SafetensorsSource(tmp_path)
    assert sorted(source.model_keys) == ["bias", "weight"]
    assert source.first_held(["lm_head.weight", "weight"]) == "weight"
    assert torch.equal(source.full_tensor("weight"), weights["weight"])
    assert torch.equal(source.read("weight", 5, 10), torch.arange(5.0, 10.0))
    assert source.param_groups() is None and source.parameter_count() is None
    assert source.optimizer_state("weight") is None and source.optimizer_state_of(0, "weight") is None
    assert source.full_state()["optimizer"] is None
    with pytest.raises(CheckpointError, match="no optimizer state"):
        source.read("weight", 0, 4, "exp_avg")
    with pytest.raises(CheckpointError, match="has shape"):
        source.check_shape("weight", (4, 3))
    with pytest.raises(CheckpointError, match="no weights for"):
        source.first_held(["missing"])


def test_a_tensors_dtype_is_checked_with_its_shape_and_pretrained_weights_may_be_cast(tmp_path):
    """A resumed checkpoint has the model's dtypes exactly; pretrained weights of another floating
    point precision (bf16 into an fp32 model) are accepted when asked (cast=True), an integer one never."""
    save_file({"weight": torch.ones(3, 4, dtype=torch.bfloat16), "steps": torch.zeros(2, dtype=torch.int64)},
              str(tmp_path / "model.safetensors"))
    source = SafetensorsSource(tmp_path)
    assert source.dtype("weight") == torch.bfloat16 and source.numel("weight") == 12
    source.check_tensor("weight", (3, 4), torch.bfloat16)
    source.check_tensor("weight", (3, 4), torch.float32, cast=True)
    with pytest.raises(CheckpointError, match=r"weight in .* is bfloat16 of shape \[3, 4\], this model's float32"):
        source.check_tensor("weight", (3, 4), torch.float32)
    with pytest.raises(CheckpointError, match=r"this model's float32 of shape \[3, 4\]"):
        source.check_tensor("steps", (3, 4), torch.float32, cast=True)
    full = FullStateSource(full_state())
    full.check_tensor("weight", (3, 4), "float32")
    with pytest.raises(CheckpointError, match="start from a fresh checkpoint_dir"):
        full.check_tensor("weight", (3, 5), torch.float32)


def test_every_source_refuses_a_range_outside_the_tensor(tmp_path):
    save_file({"weight": torch.arange(12.0).reshape(3, 4)}, str(tmp_path / "model.safetensors"))
    for source in (SafetensorsSource(tmp_path), FullStateSource(full_state())):
        assert source.read("weight", 12, 12).numel() == 0
        with pytest.raises(CheckpointError, match=r"elements \[10, 13\) of weight"):
            source.read("weight", 10, 13)


def test_a_source_implements_the_reading_not_the_range_check():
    with pytest.raises(TypeError, match="implements _read"):
        type("Unchecked", (FullStateSource,), {"read": lambda self, name, start, stop, key="": None})


@pytest.mark.parametrize("entry", ["../../../etc/passwd", "/etc/passwd", "..", "sub/../../model.safetensors", ""])
def test_an_index_naming_a_file_outside_the_model_directory_is_refused_before_any_read(tmp_path, entry):
    """An index is data: a weight_map entry that is not a plain file name of the directory is never opened."""
    model = tmp_path / "model"
    model.mkdir()
    save_file({"weight": torch.ones(2)}, str(model / "model-00001-of-00001.safetensors"))
    (model / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"weight": "model-00001-of-00001.safetensors", "bias": entry}}))
    with pytest.raises(CheckpointError, match=rf"weight_map names the file {re.escape(repr(entry))}, which is not a "
                                              rf"plain file name in {re.escape(str(model))}"):
        SafetensorsSource(model)


def test_a_corrupt_weights_file_is_a_checkpoint_error_naming_it(tmp_path):
    """safetensors' own error is not one the ranks agree on (load_pretrained shares CheckpointError,
    OSError, ValueError, RuntimeError): it is raised as a CheckpointError naming the file."""
    save_file({"weight": torch.ones(2)}, str(tmp_path / "model.safetensors"))
    source = SafetensorsSource(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"\x10" + b"\x00" * 7 + b"not a safetensors header")
    with pytest.raises(CheckpointError, match=rf"{re.escape(str(tmp_path / 'model.safetensors'))} is not a "
                                              r"readable safetensors file: .*header"):
        source.shape("weight")


def flat_range_files(ranges):
    """Every rank's part of a mesh checkpoint holding a [3, 4] weight and its exp_avg as flat ranges
    (fsdp x experts' pieces), rank r the elements ``ranges[r]``."""
    weight, moment = torch.arange(12.0).reshape(3, 4), -torch.arange(12.0).reshape(3, 4)
    layout = {"kind": "mesh", "mesh": [len(ranges), 1, 1], "model_keys": ["weight"], "tied": [],
              "optimizer_names": [["weight"]]}
    files = []
    for start, stop in ranges:
        spec = {"start": start, "stop": stop, "shape": [3, 4]}
        files.append({"strategy": {
            "layout": layout, "model": {"weight": weight.reshape(-1)[start:stop].clone()},
            "model_shards": {"weight": spec},
            "optimizer": {"state": {0: {"step": torch.tensor(3.0), "exp_avg": moment.reshape(-1)[start:stop].clone()}},
                          "shards": {0: {"exp_avg": spec}}, "param_groups": [{"lr": 0.1}]}}})
    return weight, moment, files


def test_a_mesh_checkpoint_of_flat_ranges_is_put_together_and_read_by_range(tmp_path):
    weight, moment, files = flat_range_files([(5, 12), (0, 5)])
    source = MeshSource(tmp_path, files)
    assert source.shape("weight") == (3, 4) and source.dtype("weight") == torch.float32
    assert torch.equal(source.full_tensor("weight"), weight)
    assert torch.equal(source.read("weight", 3, 7), weight.reshape(-1)[3:7])  # across both files' ranges
    assert torch.equal(source.read("weight", 3, 7, "exp_avg"), moment.reshape(-1)[3:7])
    state = source.full_state()["optimizer"]["state"][0]
    assert torch.equal(state["exp_avg"], moment) and state["step"] == 3.0
    # a flat strategy learns the entries from one piece and reads its own range: nothing assembled whole
    assert source.optimizer_state("weight")["exp_avg"].numel() < 12


@pytest.mark.parametrize("ranges, held", [([(0, 5)], r"\[\(0, 5\)\] of 12"),  # a file missing
                                          ([(0, 5), (4, 12)], r"\[\(0, 5\), \(4, 12\)\] of 12")])  # overlapping
def test_flat_ranges_that_do_not_tile_the_tensor_are_refused_naming_them(tmp_path, ranges, held):
    _, _, files = flat_range_files(ranges)
    with pytest.raises(CheckpointError, match=f"weight: the files hold elements {held}.*a file is missing"):
        MeshSource(tmp_path, files).full_tensor("weight")
