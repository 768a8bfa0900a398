"""hvdtrain.verify.tiny: a family built from its config class alone has the asked sizes wherever the
family has them (its own names for them included), its per-layer lists sized to the tiny depth, and
every float64 parameter; a family that cannot be built tiny says why."""
import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from hvdtrain.verify import tiny  # noqa: E402


def built(model_type):
    result = tiny.build_tiny(model_type)
    assert result.built, result.reason
    assert all(p.dtype == torch.float64 for p in result.model.parameters() if p.is_floating_point())
    return result


def test_a_llama_has_the_asked_sizes():
    config = built("llama").config
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads,
            config.vocab_size, config.head_dim) == (64, 2, 4, 2, 128, 16)
    assert config.max_position_embeddings >= tiny.SEQUENCE and config.attention_dropout == 0.0


def test_gpt2s_own_names_for_the_sizes_are_set():
    config = built("gpt2").config
    assert (config.n_embd, config.n_layer, config.n_head, config.n_positions) == (64, 2, 4, tiny.POSITIONS)
    assert config.resid_pdrop == config.embd_pdrop == config.attn_pdrop == 0.0


def test_a_mixture_of_experts_gets_four_experts_two_per_token():
    config = built("qwen2_moe").config
    assert (config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size) == (4, 2, 32)


def test_per_layer_types_are_sized_to_the_tiny_depth_and_keep_both_kinds():
    config = built("gemma2").config
    assert len(config.layer_types) == 2 and len(set(config.layer_types)) == 2
    assert config.sliding_window < tiny.SEQUENCE  # the sliding layers' masks do something


def test_a_multimodal_family_is_not_built_and_says_why():
    result = tiny.build_tiny("gemma3")
    assert not result.built and result.model is None
    assert "multimodal" in result.reason and "vision_config" in result.reason


def test_an_unknown_model_type_is_refused_with_the_close_names():
    with pytest.raises(ValueError, match="did you mean llama"):
        tiny.build_tiny("lama")


def test_a_local_config_json_is_shrunk_the_same_way(tmp_path):
    transformers.LlamaConfig(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                             vocab_size=32000).save_pretrained(tmp_path)
    model_type, config = tiny.config_from_directory(str(tmp_path))
    shrunk = tiny.tiny_config(config)
    assert model_type == "llama"
    assert (shrunk.hidden_size, shrunk.num_hidden_layers, shrunk.vocab_size) == (64, 2, 128)
    assert json.loads((tmp_path / "config.json").read_text())["hidden_size"] == 4096  # the user's file untouched


def test_a_directory_without_a_config_is_refused(tmp_path):
    with pytest.raises(ValueError, match="has no config.json"):
        tiny.config_from_directory(str(tmp_path))


def test_the_families_carry_their_plans():
    families = {f.model_type: f for f in tiny.causal_lm_families()}
    assert families["llama"].plans == "tp+pp" and families["gpt2"].plans == "no plan"
    assert len(families) > 100


@pytest.mark.parametrize("model_type", [
    "deepseek_v32", "glm_moe_dsa", "axk2",  # latent attention with an indexer: a key/value head per query head
    "inkling2_text", "inkling2_loop_text",  # a float32 router and expert accumulator, made float64 throughout
    # a block indexer whose sizes have no defaults
    pytest.param("qwen4_exp_text", marks=pytest.mark.skipif(
        torch.__version__ < "2.8",  # TorchVersion compares as a version
        reason="its indexer scatters with int32 indices, which torch before 2.8 refuses "
               "('scatter(): Expected dtype int64 for index', torch 2.7.1 in the torch matrix)")),
    "lfm2_moe",  # layer types its config class leaves None
    "laguna",  # heads given per layer
])
def test_families_whose_defaults_do_not_shrink_alone_are_built(model_type):
    built(model_type)


def test_latent_attention_has_a_key_value_head_per_query_head_and_a_layer_with_experts():
    config = built("deepseek_v32").config
    assert config.num_key_value_heads == config.num_attention_heads
    assert config.first_k_dense_replace < config.num_hidden_layers  # the experts are built and trained


def test_a_per_layer_size_is_made_the_tiny_size_on_every_layer():
    config = built("laguna").config
    assert config.num_attention_heads_per_layer == [config.num_attention_heads] * config.num_hidden_layers == [4, 4]


def test_the_dense_prefix_leaves_a_layer_with_experts():
    config = built("lfm2_moe").config
    assert config.num_dense_layers == 1 and config.layer_types == ["conv", "full_attention"]


def test_layer_counts_that_share_the_depth_share_the_tiny_depth():
    # dory writes a layer as two blocks (attention, mlp) and doubles its counts; its input, recurrent
    # and output sections must still add up to the depth the tiny model has
    config = built("dory").config
    assert config.num_hidden_layers == 2 and len(config.layer_types) == 2
    assert config.n_input_layers + config.n_recurrent_layers + config.n_output_layers == 2
    assert config.n_recurrent_layers == 1


def test_a_count_of_layers_the_tiny_depth_cannot_hold_shrinks_in_proportion():
    config = built("gemma3n_text").config  # 15 of 35 layers share earlier layers' key/value cache
    assert config.num_hidden_layers == 2 and config.num_kv_shared_layers == 0


def test_per_layer_type_rotary_parameters_left_empty_get_the_default_rotary_embedding():
    config = built("cohere_compass_text").config
    assert set(config.rope_parameters) == set(config.layer_types)
    assert all(parameters["rope_type"] == "default" for parameters in config.rope_parameters.values())


def test_a_wrapped_refusal_says_what_was_refused():
    try:
        try:
            raise ValueError("num_key_value_heads must match num_attention_heads")
        except ValueError as cause:
            raise RuntimeError("Class validation error for validator 'validate_architecture':\n    ...") from cause
    except RuntimeError as error:
        line = tiny._first_line(error)
    assert line.endswith("'validate_architecture': ValueError: num_key_value_heads must match num_attention_heads")


def test_dots3s_sliding_layers_are_as_tiny_as_the_others():
    config = built("dots3_note_text").config
    assert config.layer_types == ["indexed_attention", "sliding_attention"]
    sliding = config.per_layer_config[1]
    assert (sliding.num_attention_heads, sliding.num_key_value_heads, sliding.kv_lora_rank) == (4, 4, 16)
    assert sliding.head_dim == sliding.qk_nope_head_dim + sliding.qk_rope_head_dim
