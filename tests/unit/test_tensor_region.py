"""The split region's rule (hvdtrain.parallel.tensor.region), decided in one process: which whole
parameters meet an activation a colwise layer splits before a layer of the plan makes it whole;
and the first-step audit's view of the parameters it sums (hvdtrain.parallel.tensor.audit)."""
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from hvdtrain.parallel.tensor.audit import PRINTS, SplitAudit, fingerprint
from hvdtrain.parallel.tensor.region import agreed_names, split_region_parameters

CPU = torch.device("cpu")


class ScaledActivation(nn.Module):
    """An activation with a learnable scalar (xIELU's alpha_p in miniature)."""

    def __init__(self):
        super().__init__()
        self.alpha = nn.Parameter(torch.tensor([0.7]))

    def forward(self, x):
        return nn.functional.softplus(self.alpha) * x * x


class Scale(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(0.5, 1.5, width))

    def forward(self, x):
        return x * self.weight


class ToyLM(nn.Module):
    """A causal LM's shape: embedding, a norm before a colwise/rowwise pair of projections with an
    activation and a per-head norm between them, a norm after, a head."""

    def __init__(self, vocabulary=16, width=8):
        super().__init__()
        torch.manual_seed(0)
        self.config = SimpleNamespace(vocab_size=vocabulary, max_position_embeddings=8)
        self.embed = nn.Embedding(vocabulary, width)
        self.input_norm = Scale(width)
        self.up = nn.Linear(width, 2 * width)
        self.act = ScaledActivation()
        self.head_norm = Scale(2 * width)
        self.down = nn.Linear(2 * width, width)
        self.final_norm = Scale(width)
        self.head = nn.Linear(width, vocabulary)

    def get_input_embeddings(self):
        return self.embed

    def forward(self, input_ids, use_cache=False):
        h = self.embed(input_ids)
        h = h + self.down(self.head_norm(self.act(self.up(self.input_norm(h)))))
        return {"logits": self.head(self.final_norm(h))}


PLAN = [("up", "colwise"), ("down", "rowwise")]


def test_a_learnable_activation_and_a_norm_between_a_colwise_and_a_rowwise_layer_are_in_the_region():
    names = split_region_parameters(ToyLM(), PLAN, CPU)
    # Not input_norm (its output enters the colwise layer whole: Megatron's f sums that gradient),
    # not final_norm nor the head (after the rowwise sum), not the embedding.
    assert names == ["act.alpha", "head_norm.weight"]


def test_a_module_the_plan_names_is_not_decided_again():
    names = split_region_parameters(ToyLM(), PLAN + [("head_norm", "replicated_with_grad_allreduce")], CPU)
    assert names == ["act.alpha"]


def test_without_a_colwise_layer_nothing_is_split():
    assert split_region_parameters(ToyLM(), [("head", "colwise_gather_output")], CPU) == []


def test_a_model_without_values_decides_nothing():
    with torch.device("meta"):
        model = ToyLM()
    assert split_region_parameters(model, PLAN, CPU) is None


def test_every_rank_sums_what_any_rank_decided():
    everyone = lambda mine: [mine, ["b", "c"], []]  # noqa: E731
    assert agreed_names(["a", "b"], everyone) == ["a", "b", "c"]
    assert agreed_names(None, lambda mine: [mine, ["a"]]) == ["a"]


transformers = pytest.importorskip("transformers")


def _region(family):
    from hvdtrain.parallel.tensor.plan import check_plan, model_tensor_plan
    from hvdtrain.verify.tiny import build_tiny

    model = build_tiny(family).model
    return split_region_parameters(model, check_plan(model, model_tensor_plan(model), 2), CPU)


@pytest.mark.parametrize("family,expected", [
    ("apertus", ["mlp.act_fn.alpha_p", "mlp.act_fn.alpha_n"]),  # xIELU after the colwise up_proj
    ("sarvam_moe", ["self_attn.q_norm.weight", "self_attn.k_norm.weight"]),  # per-head norms its plan leaves out
    ("qwen3", []),  # the same norms, which its plan sums itself
    ("llama", []),
    # MLA: the whole rotary key is copied into each rank's heads; its projection (mla_kv_a_proj) sums
    # that gradient, so the input norm before it stays out of the region.
    ("deepseek_v2", []),
])
def test_hugging_face_families(family, expected):
    assert _region(family) == [f"model.layers.{i}.{name}" for i in range(2) for name in expected]


def _audit_problems(summed_gradients, parts):
    """The audit's findings for one summed parameter: each rank's gradient once summed and its part."""
    audit = SplitAudit(SimpleNamespace(size=2), ["act.alpha"], CPU)
    loss = torch.tensor(2.0, dtype=torch.float64)
    every = torch.stack([torch.stack([fingerprint(loss, CPU), fingerprint(summed, CPU), fingerprint(part, CPU)])
                         for summed, part in zip(summed_gradients, parts)])
    assert every.shape == (2, 3, PRINTS)
    return audit._problems(every, [("the loss", loss), ("act.alpha", summed_gradients[0])], ["act.alpha"])


def test_the_audit_takes_a_summed_gradient_whose_parts_differ_and_sums_agree():
    t = lambda v: torch.tensor([v], dtype=torch.float64)  # noqa: E731
    assert _audit_problems([t(3.0), t(3.0)], [t(1.0), t(2.0)]) == []


def test_the_audit_refuses_a_summed_gradient_that_differs_once_summed():
    t = lambda v: torch.tensor([v], dtype=torch.float64)  # noqa: E731
    problems = _audit_problems([t(3.0), t(2.0)], [t(1.0), t(2.0)])
    assert len(problems) == 1 and "act.alpha, summed over the tensor group, still differs" in problems[0]


def test_the_audit_refuses_a_summed_gradient_whose_parts_are_all_the_same():
    t = lambda v: torch.tensor([v], dtype=torch.float64)  # noqa: E731
    problems = _audit_problems([t(4.0), t(4.0)], [t(2.0), t(2.0)])
    assert len(problems) == 1 and "counts it 2 times" in problems[0]
