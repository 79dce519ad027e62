"""Every FPSA family's Jacobian penalties reach the loss when an engine rebuilds the dataclasses in each layer's
inputs, as FSDP2 does to hook the tensors inside them (``torch.distributed.fsdp`` rebuilds them with
``dataclasses.replace``): the layers record through ``FPSAStatsSink``, not through the model's ``FPSAStats``."""

import dataclasses

import pytest
import torch

from hf_fixedpoint.modeling import (
    FPSABertConfig,
    FPSABertForSequenceClassification,
    FPSAViTConfig,
    FPSAViTForImageClassification,
    SelfLlamaConfig,
    SelfLlamaForCausalLM,
    SelfMistralConfig,
    SelfMistralForCausalLM,
)

LM = {"vocab_size": 99, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
      "num_key_value_heads": 2, "max_position_embeddings": 64, "pad_token_id": 0}
IDS = torch.randint(1, 99, (2, 7), generator=torch.Generator().manual_seed(0))
CASES = {
    "fpsa_bert": (FPSABertForSequenceClassification, FPSABertConfig(
        vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37,
        num_labels=2), {"input_ids": IDS, "labels": torch.tensor([0, 1])}),
    "fpsa_vit": (FPSAViTForImageClassification, FPSAViTConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37, image_size=16,
        patch_size=4, num_labels=3), {"pixel_values": torch.randn(2, 3, 16, 16, generator=torch.Generator()
                                                                  .manual_seed(1)), "labels": torch.tensor([0, 2])}),
    "self_llama": (SelfLlamaForCausalLM, SelfLlamaConfig(**LM), {"input_ids": IDS, "labels": IDS}),
    "self_mistral": (SelfMistralForCausalLM, SelfMistralConfig(**LM, sliding_window=4),
                     {"input_ids": IDS, "labels": IDS}),
}


def _rebuild_dataclass_inputs(module, args, kwargs):
    """What FSDP2's pre-forward does to a sharded module's inputs: a dataclass holding a tensor that requires grad is
    rebuilt (new object, new containers for those tensors)."""
    def rebuild(x):
        if dataclasses.is_dataclass(x) and not isinstance(x, type):
            changes = {f.name: rebuild(getattr(x, f.name)) for f in dataclasses.fields(x) if f.init}
            return dataclasses.replace(x, **changes)
        if isinstance(x, list) and any(torch.is_tensor(t) and t.requires_grad for t in x):
            return list(x)
        return x

    return args, {k: rebuild(v) for k, v in kwargs.items()}


@pytest.mark.parametrize("family", sorted(CASES))
def test_every_layer_penalty_reaches_the_loss_when_layer_inputs_are_rebuilt(family):
    model_class, config, inputs = CASES[family]
    config.fp_max_iter, config.fpsa_jac_weight = 4, 0.5
    torch.manual_seed(0)
    model = model_class(config).train()
    layers = [m for m in model.modules() if type(m).__name__.endswith("Layer") and hasattr(m, "attention")
              or type(m).__name__.endswith("DecoderLayer")]
    assert len(layers) == 2
    for layer in layers:
        layer.register_forward_pre_hook(_rebuild_dataclass_inputs, with_kwargs=True)
    out = model(**inputs)
    assert len(out.fp_stats.iterations_per_layer) == 2 and len(out.fp_stats.jac_penalty_per_layer) == 2
