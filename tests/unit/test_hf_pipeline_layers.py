"""A Hugging Face causal LM as pipeline layers, in one process: run one after another they compute
the model's own logits, bit for bit (the mask and rotary embeddings each layer gets are the model's);
a family whose forward does more than embed -> layers -> norm -> head is refused by name."""
import pytest
import torch

from hvdtrain.parallel.pipeline.hf_layers import DecoderLayer, NormAndHead, TokenEmbedding, hf_pipeline_layers

transformers = pytest.importorskip("transformers")

SHAPE = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=16)


@pytest.mark.parametrize("config", [transformers.LlamaConfig(**SHAPE),
                                    transformers.Qwen2Config(**SHAPE, use_sliding_window=True, sliding_window=4,
                                                             max_window_layers=1),
                                    transformers.MistralConfig(**SHAPE, sliding_window=4)],
                         ids=["llama", "qwen2-sliding", "mistral-sliding"])
def test_the_layers_in_a_row_are_the_model(config):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).double().eval()
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    layers = hf_pipeline_layers(model)
    with torch.no_grad():
        expected = model(input_ids=ids).logits
        x = ids
        for layer in layers:
            x = layer(x)

    assert [type(layer) for layer in layers] == [TokenEmbedding, DecoderLayer, DecoderLayer, DecoderLayer, NormAndHead]
    assert torch.equal(x, expected)


def test_a_family_with_more_in_its_forward_is_refused_by_name():
    config = transformers.GemmaConfig(**SHAPE, head_dim=8)
    with pytest.raises(ValueError, match="its family \\('gemma'\\) is not one whose forward is embed -> decoder "
                                         "layers -> norm -> head"):
        hf_pipeline_layers(transformers.AutoModelForCausalLM.from_config(config))
