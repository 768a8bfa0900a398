"""train.compile resumes warm on another host: what the first run compiled is saved beside its
checkpoints, and a restart with an empty Inductor cache (a new host's /tmp) compiles nothing."""
import json

from tests.launch.helpers import PYTHON, run

from hvdtrain.components.compile_cache import CACHE_FILE


def counters(tmp_path, cache, max_steps):
    code, out, err = run([PYTHON, "tests/launch/compile_cache_job.py", str(tmp_path / "ckpt"), str(max_steps)],
                         timeout=600, extra_env={"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / cache)})
    assert code == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1]), out + err


def test_a_restart_on_a_host_with_an_empty_cache_loads_what_the_first_run_compiled(tmp_path):
    first, _ = counters(tmp_path, "host-a", max_steps=2)
    assert first.get("fxgraph_cache_miss", 0) > 0 and first.get("fxgraph_cache_hit", 0) == 0, first
    assert (tmp_path / "ckpt" / CACHE_FILE).stat().st_size > 0

    resumed, output = counters(tmp_path, "host-b", max_steps=4)  # resumes at step 2, from host-b's empty cache
    assert resumed.get("fxgraph_cache_hit", 0) >= first["fxgraph_cache_miss"], resumed
    assert resumed.get("fxgraph_cache_miss", 0) == 0, resumed
    assert "compiled artifacts loaded from" in output
