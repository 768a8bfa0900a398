"""A Hugging Face causal LM as pipeline layers, in one process: run one after another they compute
the model's own logits, bit for bit (what the family does around its layers is its own forward's:
Gemma2's scaled embeddings and soft-capped logits, Granite's multipliers; the mask and rotary
embeddings each layer gets are the model's, per layer). What a pipeline cannot reproduce is refused
by name: a family transformers describes no pipeline for, work between decoder layers."""
import pytest
import torch

from hvdtrain.parallel.pipeline.hf_layers import DecoderLayer, ModelEntry, ModelExit, hf_pipeline_layers
from hvdtrain.parallel.pipeline.hf_plan import hf_pipeline_plan

transformers = pytest.importorskip("transformers")

SHAPE = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=16)

CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(**SHAPE),
    "qwen2-sliding": lambda: transformers.Qwen2Config(**SHAPE, use_sliding_window=True, sliding_window=4,
                                                      max_window_layers=1),
    "mistral-sliding": lambda: transformers.MistralConfig(**SHAPE, sliding_window=4),
    "gemma2": lambda: transformers.Gemma2Config(**SHAPE, head_dim=8, sliding_window=4, final_logit_softcapping=3.0,
                                                attn_logit_softcapping=5.0),
    "granite": lambda: transformers.GraniteConfig(**SHAPE, embedding_multiplier=3.0, logits_scaling=2.5,
                                                  residual_multiplier=0.5, attention_multiplier=0.3),
    "gpt_neox": lambda: transformers.GPTNeoXConfig(**SHAPE),
    "olmo2": lambda: transformers.Olmo2Config(**SHAPE),
    # No base_model_pp_plan: its one list of identical blocks is found, and verified by the probe.
    "stablelm": lambda: transformers.StableLmConfig(**SHAPE),
    # Scales inputs_embeds in place: each stage's recording must not scale the layer's own input.
    "ctrl": lambda: transformers.CTRLConfig(vocab_size=64, n_positions=16, n_embd=32, n_layer=3, n_head=4, dff=48),
}


@pytest.mark.parametrize("family", list(CONFIGS))
def test_the_layers_in_a_row_are_the_model(family):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(CONFIGS[family]()).double().eval()
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding in one row
    layers = hf_pipeline_layers(model)
    with torch.no_grad():
        expected = model(input_ids=ids, attention_mask=mask).logits
        x = ids
        for layer in layers:
            x = layer(x, {"attention_mask": mask})

    assert [type(layer) for layer in layers] == [ModelEntry, DecoderLayer, DecoderLayer, DecoderLayer, ModelExit]
    # Bit for bit (padding rows are NaN in some families' eager attention, in the model alike).
    torch.testing.assert_close(x, expected, rtol=0, atol=0, equal_nan=True)


def test_the_first_and_last_layers_hold_what_the_forward_calls_around_the_layers():
    model = transformers.AutoModelForCausalLM.from_config(CONFIGS["gpt_neox"]())
    plan = hf_pipeline_plan(model)

    assert plan.layers == "gpt_neox.layers"  # not .model.layers: found from the model's own pp plan
    assert plan.entry == ("gpt_neox.embed_in",) and set(plan.exit) == {"gpt_neox.final_layer_norm", "lm_head"}


def test_position_embeddings_added_to_inputs_embeds_are_refused_by_name():
    """GPT-2 has no pp plan; its blocks are found, but its forward adds wpe even to inputs_embeds,
    which the last stage does not hold."""
    config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=4)
    with pytest.raises(ValueError, match=r"cannot cut a 'gpt2' model by itself: given inputs_embeds, its forward still "
                                         r"calls transformer.wpe before the first decoder layer.*ModelPlan\(pipeline_layers"):
        hf_pipeline_layers(transformers.AutoModelForCausalLM.from_config(config))


def test_a_layer_protocol_the_stand_ins_cannot_follow_is_refused_by_name():
    """Bloom unpacks each layer's output as a tuple: refused before any step, not met on a stage."""
    config = transformers.BloomConfig(vocab_size=64, hidden_size=32, n_layer=2, n_head=4)
    with pytest.raises(ValueError, match=r"cannot cut a 'bloom' model by itself: its forward could not be followed "
                                         r"with its decoder layers stood in for"):
        hf_pipeline_plan(transformers.AutoModelForCausalLM.from_config(config))


class HalvedBetweenLayers(torch.nn.Module):
    """A base model whose forward halves the hidden states between its decoder layers."""

    def __init__(self, base):
        super().__init__()
        self.embed_tokens, self.layers, self.norm, self.rotary_emb = base.embed_tokens, base.layers, base.norm, base.rotary_emb

    def forward(self, input_ids=None, inputs_embeds=None, attention_mask=None, **kwargs):
        hidden = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        position_ids = torch.arange(hidden.shape[1], device=hidden.device)[None]
        embeddings = self.rotary_emb(hidden, position_ids)
        for layer in self.layers:
            hidden = layer(hidden, position_embeddings=embeddings, position_ids=position_ids) * 0.5
        return transformers.modeling_outputs.BaseModelOutputWithPast(last_hidden_state=self.norm(hidden))


def test_work_between_decoder_layers_is_refused_by_name():
    model = transformers.AutoModelForCausalLM.from_config(CONFIGS["llama"]())
    model.model = HalvedBetweenLayers(model.model)
    with pytest.raises(ValueError, match=r"cannot cut a 'llama' model by itself: it does work between decoder layers "
                                         r"0 and 1 \(the input of layer 1 is not what layer 0 returned\)"):
        hf_pipeline_plan(model)
