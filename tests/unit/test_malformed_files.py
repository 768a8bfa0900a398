"""A sharded checkpoint's manifest or a Hugging Face index that parses but has another shape (or an
index that is not JSON) is refused in one line naming the file and the first thing wrong: never an
AttributeError, TypeError or KeyError from deep inside, never a traceback from the CLI. A manifest
of the wrong shape is not corruption (hvdtrain writes it atomically): nothing is set aside for it."""
import json
import re
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import save_file

from hvdtrain import cli
from hvdtrain.checkpoint import CheckpointError, CorruptCheckpoint
from hvdtrain.checkpoint.formats import sharded
from hvdtrain.checkpoint.formats.full import CheckpointStore
from hvdtrain.weights.pretrained import SafetensorsSource
from tests.unit.test_sharded_checkpoint import model, optimizer_for, parts_of, save_sharded

INDEX = "model.safetensors.index.json"


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """A sound sharded checkpoint of 2 ranks (step 30), copied by each test before it damages it."""
    net = model()
    directory = tmp_path_factory.mktemp("written")
    save_sharded(directory, 30, parts_of({"model": net.state_dict(), "optimizer": optimizer_for(net).state_dict()}))
    return directory


@pytest.fixture
def checkpoint_dir(tmp_path, written):
    """A checkpoint_dir of its own holding the sound checkpoint ckpt-000000030/."""
    shutil.copytree(written, tmp_path / "ckpt")
    return tmp_path / "ckpt"


def rewrite_manifest(path, change):
    """The manifest of the checkpoint ``path`` replaced by ``change(manifest)`` (JSON that parses)."""
    manifest = json.loads((path / sharded.MANIFEST).read_text())
    (path / sharded.MANIFEST).write_text(json.dumps(change(manifest)))


def changed(manifest, **keys):
    return {**manifest, **keys}


def entry_changed(manifest, index, drop=(), **keys):
    """``manifest`` with files[index] changed: the keys ``drop`` removed, ``keys`` set."""
    files = [dict(entry) for entry in manifest["files"]]
    files[index] = {**{key: value for key, value in files[index].items() if key not in drop}, **keys}
    return changed(manifest, files=files)


# Each malformed manifest, and what its one line says is wrong.
MALFORMED_MANIFESTS = {
    "entries are strings": (lambda m: changed(m, files=[entry["name"] for entry in m["files"]]),
                            "files[0] is 'rank-00000-of-00002.pt', an entry must be an object with name, rank, "
                            "bytes and a checksum"),
    "files is a dict": (lambda m: changed(m, files={entry["name"]: entry for entry in m["files"]}),
                        "files is {'rank-00000-of-00002.pt': {", "it must be a list"),
    "world_size is a string": (lambda m: changed(m, world_size="2"), "world_size is '2', it must be an integer"),
    "world_size is true": (lambda m: changed(m, world_size=True), "world_size is True, it must be an integer"),
    "an entry lacks bytes": (lambda m: entry_changed(m, 1, drop=("bytes",)), "files[1] has no bytes: an entry must"),
    "bytes is a string": (lambda m: entry_changed(m, 0, bytes=str(m["files"][0]["bytes"])),
                          "files[0].bytes is '", "', it must be an integer"),
    "a checksum is a number": (lambda m: entry_changed(m, 1, xxh3_128=12345),
                               "files[1].xxh3_128 is 12345, a checksum must be a hex string"),
    "an entry has no checksum": (lambda m: entry_changed(m, 0, drop=("xxh3_128",)),
                                 "files[0] has no checksum (xxh3_128 or sha256)"),
    "a rank is a string": (lambda m: entry_changed(m, 1, rank="1"), "files[1].rank is '1', it must be an integer"),
    "the entries swapped": (lambda m: changed(m, files=m["files"][::-1]),
                            "files[0] is rank-00001-of-00002.pt of rank 1, expected one file per rank: "
                            "rank-00000-of-00002.pt of rank 0"),
    "the scheduler is a list": (lambda m: changed(m, scheduler=[1, 2]), "scheduler is [1, 2], it must be an object"),
    "the manifest is a list": (lambda m: [m], "holds [{", "not an object: not an hvdtrain manifest"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED_MANIFESTS))
def test_a_malformed_manifest_is_one_line_naming_it_and_what_is_wrong(checkpoint_dir, case):
    change, *said = MALFORMED_MANIFESTS[case]
    path = checkpoint_dir / "ckpt-000000030"
    rewrite_manifest(path, change)
    with pytest.raises(CheckpointError) as refused:
        sharded.read_manifest(path)
    message = str(refused.value)
    assert not isinstance(refused.value, CorruptCheckpoint), message  # parsed JSON: as written, not corrupt
    assert message.startswith(f"{path / sharded.MANIFEST}") and "\n" not in message
    assert all(part in message for part in said), message
    assert f"move {path.name} out of the checkpoint directory" in message  # what to do


def test_a_malformed_manifest_is_never_set_aside_as_corrupt_at_start(checkpoint_dir):
    """Training start reads the newest checkpoint through the store: a manifest of another shape is
    refused or passed over by name, and the checkpoint stays where it is."""
    path = checkpoint_dir / "ckpt-000000030"
    rewrite_manifest(path, MALFORMED_MANIFESTS["entries are strings"][0])
    try:
        CheckpointStore(checkpoint_dir).read_newest_valid(set_aside=True, verify_shards=True)
    except CheckpointError as error:
        assert not isinstance(error, CorruptCheckpoint) and str(path / sharded.MANIFEST) in str(error)
    assert path.is_dir() and not list(checkpoint_dir.glob("*.corrupt*"))


def test_a_manifest_that_is_not_json_is_still_corrupt(checkpoint_dir):
    """JSON that does not parse is garbled bytes (the manifest is written atomically): corruption."""
    path = checkpoint_dir / "ckpt-000000030"
    (path / sharded.MANIFEST).write_text('{"format": 1, "files": [')
    with pytest.raises(CorruptCheckpoint, match=f"^{re.escape(str(path / sharded.MANIFEST))} .*JSONDecodeError"):
        sharded.read_manifest(path)


@pytest.mark.parametrize("command", [["checkpoint", "verify"], ["checkpoint", "consolidate"], ["export"]])
@pytest.mark.parametrize("case", ["entries are strings", "files is a dict", "bytes is a string"])
def test_every_command_reading_a_malformed_manifest_fails_in_one_line(checkpoint_dir, capsys, command, case):
    path = checkpoint_dir / "ckpt-000000030"
    rewrite_manifest(path, MALFORMED_MANIFESTS[case][0])
    assert cli.main(command + [str(path)]) == 1
    printed = capsys.readouterr()
    lines = [line for line in (printed.out + printed.err).splitlines() if str(path / sharded.MANIFEST) in line]
    assert len(lines) == 1 and all(part in lines[0] for part in MALFORMED_MANIFESTS[case][1:]), printed


def hf_directory(directory):
    """A Hugging Face weights directory of one numbered file and its index, as save_pretrained writes it."""
    directory.mkdir()
    save_file({"weight": torch.ones(2, 3), "bias": torch.zeros(2)}, str(directory / "model-00001-of-00001.safetensors"))
    (directory / INDEX).write_text(json.dumps({"metadata": {"total_size": 32}, "weight_map": {
        "weight": "model-00001-of-00001.safetensors", "bias": "model-00001-of-00001.safetensors"}}))
    return directory


# Each malformed index (its text), and what its one line says is wrong.
MALFORMED_INDICES = {
    "not JSON": ('{"weight_map": {"weight": ', "is not JSON (Expecting value"),
    "a list": ('[{"weight_map": {}}]', "holds a list, not an object"),
    "no weight_map": ('{"metadata": {"total_size": 32}}', "has no weight_map"),
    "weight_map a list": ('{"weight_map": ["model-00001-of-00001.safetensors"]}',
                          "its weight_map is a list, not an object of tensor names to file names"),
    "a file name a number": ('{"weight_map": {"weight": "model-00001-of-00001.safetensors", "bias": 1}}',
                             "weight_map['bias'] is a number, it must be the name of the file holding it"),
    "a file name an object": ('{"weight_map": {"weight": {"file": "model-00001-of-00001.safetensors"}}}',
                              "weight_map['weight'] is an object, it must be the name of the file holding it"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED_INDICES))
def test_a_malformed_index_is_one_line_naming_it_and_what_is_wrong(tmp_path, case):
    text, said = MALFORMED_INDICES[case]
    directory = hf_directory(tmp_path / "hf")
    (directory / INDEX).write_text(text)
    with pytest.raises(CheckpointError) as refused:
        SafetensorsSource(directory)
    message = str(refused.value)
    assert message.startswith(str(directory / INDEX)) and "\n" not in message
    assert said in message and message.endswith("not the index save_pretrained writes: fix or replace it"), message


def test_a_sound_index_still_reads(tmp_path):
    source = SafetensorsSource(hf_directory(tmp_path / "hf"))
    assert sorted(source.model_keys) == ["bias", "weight"] and source.shape("weight") == (2, 3)


@pytest.mark.parametrize("case", ["not JSON", "a file name a number"])
def test_verify_of_a_weights_directory_with_a_malformed_index_fails_in_one_line(tmp_path, capsys, case):
    directory = hf_directory(tmp_path / "hf")
    (directory / INDEX).write_text(MALFORMED_INDICES[case][0])
    assert cli.main(["checkpoint", "verify", str(directory)]) == 1
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(f"hvdtrain checkpoint verify: {directory / INDEX}"), err
    assert MALFORMED_INDICES[case][1] in err[0]


def run_cli(*argv):
    return subprocess.run([sys.executable, "-m", "hvdtrain.cli", *map(str, argv)],
                          capture_output=True, text=True, timeout=120)


def test_the_command_line_prints_no_traceback_for_a_malformed_manifest_or_index(checkpoint_dir, tmp_path):
    """As an operator runs it: exit status 1, one line naming the file, no traceback."""
    path = checkpoint_dir / "ckpt-000000030"
    rewrite_manifest(path, MALFORMED_MANIFESTS["entries are strings"][0])
    directory = hf_directory(tmp_path / "hf")
    (directory / INDEX).write_text(MALFORMED_INDICES["not JSON"][0])
    for given, named in ((path, path / sharded.MANIFEST), (checkpoint_dir, path / sharded.MANIFEST),
                         (directory, directory / INDEX)):
        result = run_cli("checkpoint", "verify", given)
        assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
        assert len([line for line in (result.stdout + result.stderr).splitlines() if str(named) in line]) == 1
