"""train.compile resumes warm on another host: what the first run compiled is saved beside its
checkpoints, signed with the user's key, and a restart with an empty Inductor cache (a new host's
/tmp) compiles nothing; a restart whose key differs (a host without this home directory, another
user) loads none of it, compiles, and signs the file anew."""
import json
import shutil

import pytest

from tests.launch.helpers import PYTHON, run

from hvdtrain.components.compile_cache import CACHE_FILE, key_id, read_key


def counters(directory, inductor_cache, key_file, max_steps):
    """One run of the job from ``directory``'s checkpoints: Inductor's counters and its output."""
    code, out, err = run([PYTHON, "tests/launch/compile_cache_job.py", str(directory), str(max_steps)],
                         timeout=600, extra_env={"TORCHINDUCTOR_CACHE_DIR": str(inductor_cache),
                                                 "HVDTRAIN_COMPILE_CACHE_KEY_FILE": str(key_file)})
    assert code == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1]), out + err


@pytest.fixture(scope="module")
def first_run(tmp_path_factory):
    """A run on host a, two steps: its checkpoints, its compile cache, its counters, its key."""
    base = tmp_path_factory.mktemp("first-run")
    key_file = base / "home-a" / "compile-cache.key"
    first, _ = counters(base / "ckpt", base / "host-a", key_file, max_steps=2)
    return base / "ckpt", first, key_file


def restarted_copy(first_run, tmp_path):
    directory, _, _ = first_run
    shutil.copytree(directory, tmp_path / "ckpt")
    return tmp_path / "ckpt"


def signer(directory):
    """The key id in the cache file's header."""
    header = (directory / CACHE_FILE).read_bytes().split(b"\n", 1)[0].decode()
    assert header.startswith("hvdtrain-compile-cache/1 key="), header
    return header.split("key=")[1].split()[0]


def test_a_restart_on_a_host_with_an_empty_cache_loads_what_the_first_run_compiled(first_run, tmp_path):
    _, first, key_file = first_run
    assert first.get("fxgraph_cache_miss", 0) > 0 and first.get("fxgraph_cache_hit", 0) == 0, first
    directory = restarted_copy(first_run, tmp_path)
    assert signer(directory) == key_id(read_key(key_file))

    # resumes at step 2, from host b's empty cache, with the same key (a shared home directory)
    resumed, output = counters(directory, tmp_path / "host-b", key_file, max_steps=4)
    assert resumed.get("fxgraph_cache_hit", 0) >= first["fxgraph_cache_miss"], resumed
    assert resumed.get("fxgraph_cache_miss", 0) == 0, resumed
    assert "compiled artifacts loaded from" in output


def test_a_restart_with_another_key_loads_nothing_compiles_and_signs_the_file_anew(first_run, tmp_path):
    _, first, _ = first_run
    directory = restarted_copy(first_run, tmp_path)
    other_key = tmp_path / "home-c" / "compile-cache.key"  # a host that does not share the home directory

    resumed, output = counters(directory, tmp_path / "host-c", other_key, max_steps=4)
    assert resumed.get("fxgraph_cache_miss", 0) >= first["fxgraph_cache_miss"], resumed
    assert resumed.get("fxgraph_cache_hit", 0) == 0, resumed
    assert "not loaded: it is signed with another key" in output
    assert signer(directory) == key_id(read_key(other_key))  # replaced after the first step
