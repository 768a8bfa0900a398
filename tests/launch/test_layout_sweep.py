"""The layout checks for real, on a fixed slice of Hugging Face families across the tp plan styles:
one launch of 2 ranks runs every family at T=2, at P=2 and at S=2 (sequence parallelism;
hvdtrain.verify.driver), and none ends
``differs`` or ``error`` (refused before the first step is an answer; trained and different never
is); and ``hvdtrain check-layout`` answers equal with exit 0 and a refusal with exit 2 and its reason.

The whole sweep (every family, T2xP2 and fsdp-meta too) is scripts/sweep_hf_layouts.py, not CI.
"""
import pytest

from hvdtrain import cli
from hvdtrain.verify import driver
from hvdtrain.verify.layouts import named
from hvdtrain.verify.reference import OPTIMIZERS
from tests.launch.helpers import launch_env

pytest.importorskip("transformers")

# One family per tp plan style (and families without a plan): colwise/rowwise with a tied head
# (llama); soft-capping and scaled embeddings (gemma2); per-head q/k norms (qwen3); norms over whole
# projections, colwise_gather_output / rowwise_split_input (olmo2); sliding layers (cohere2);
# embedding_rowwise and a fused qkv (gpt_neox); replicated_with_grad_allreduce (gemma3_text);
# local_params (granite_swa); moe_tp_experts / packed_colwise (qwen2_moe); no plan (gpt2).
SLICE = ["llama", "gemma2", "qwen3", "olmo2", "cohere2", "gpt_neox", "gemma3_text", "granite_swa", "qwen2_moe",
         "gpt2"]
LAYOUTS = ("T2", "P2", "S2")
TIMEOUT = 600  # a launch of 10 families at 3 layouts (~3 minutes alone on 2 cores) and two check-layout runs


@pytest.fixture(scope="module", autouse=True)
def launchable():
    """This venv's horovodrun first on PATH, root allowed to launch (as tests.launch.helpers.run gives)."""
    with pytest.MonkeyPatch.context() as patch:
        for name, value in launch_env().items():
            patch.setenv(name, value)
        yield


@pytest.fixture(scope="module")
def slice_outcomes(tmp_path_factory):
    return driver.run(SLICE, named(",".join(LAYOUTS)), list(OPTIMIZERS), steps=3, family_timeout=200,
                      log_dir=tmp_path_factory.mktemp("sweep-logs"))


@pytest.mark.timeout(TIMEOUT)
def test_no_family_of_the_slice_trains_and_differs_or_fails(slice_outcomes):
    seen = {(o.family, o.layout, o.optimizer) for o in slice_outcomes}
    assert seen == {(f, layout, opt) for f in SLICE for layout in LAYOUTS for opt in OPTIMIZERS}
    wrong = [f"{o.family} {o.layout} {o.optimizer}: {o.summary()}" for o in slice_outcomes
             if o.result not in ("equal", "refused")]
    assert not wrong, "\n".join(wrong)


@pytest.mark.timeout(TIMEOUT)
def test_llama_and_gemma2_are_equal_under_every_layout(slice_outcomes):
    # Gemma2 trained 6e-2 away from one process at T=2 before its scaled embedding kept its forward.
    for family in ("llama", "gemma2"):
        cases = [o for o in slice_outcomes if o.family == family]
        assert [o.result for o in cases] == ["equal"] * 2 * len(LAYOUTS), [o.summary() for o in cases]
        assert all(o.max_diff < 1e-10 and o.moved > 1e-3 for o in cases)  # it trained, and stayed equal


# In this process (the command's own start, importing transformers, is paid once); the ranks are
# launched as the command launches them, with its time limit.
@pytest.mark.timeout(TIMEOUT)
def test_check_layout_says_equal_and_exits_0(capsys):
    code = cli.main(["check-layout", "llama", "--tensor_parallel=2", "--timeout=200"])
    out, err = capsys.readouterr()
    assert code == 0, f"exit {code}\n{out}\n{err[-2000:]}"
    assert out.count(": equal (max |diff| = ") == len(OPTIMIZERS), out


@pytest.mark.timeout(TIMEOUT)
def test_check_layout_names_a_refusal_and_exits_2(capsys):
    code = cli.main(["check-layout", "gpt2", "--tensor_parallel=2", "--optimizer=sgd", "--timeout=200"])
    out, err = capsys.readouterr()
    assert code == 2, f"exit {code}\n{out}\n{err[-2000:]}"
    assert "refused (no tp plan): train.tensor_parallel=2 needs a tensor plan" in out, out
