"""What the plugin's native models share: the attention metadata of a layer in the current forward pass, the
projections of their attention layers, and the entry class (a base model, an LM head tied to its embedding where the
config says so, and the weights of a transformers checkpoint loaded through ``hf_to_vllm_mapper``)."""

from collections.abc import Iterable

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.distributed import get_tensor_model_parallel_world_size
from vllm.forward_context import get_forward_context, is_forward_context_available
from vllm.model_executor.layers.linear import QKVParallelLinear, RowParallelLinear
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead
from vllm.model_executor.models.utils import AutoWeightsLoader, WeightsMapper, maybe_prefix


def layer_metadata(layer_name: str):
    """The attention metadata of ``layer_name`` in this forward pass, or None (a dummy or profiling run)."""
    if not is_forward_context_available():
        return None
    metadata = get_forward_context().attn_metadata
    if isinstance(metadata, list):  # one dict per micro-batch
        metadata = metadata[0]
    return metadata.get(layer_name) if isinstance(metadata, dict) else metadata


class AttentionProjections(nn.Module):
    """The fused q/k/v projection and the output projection of a (grouped-query) attention layer of head dim
    ``hidden_size // num_attention_heads``, sharded over the tensor-parallel ranks; a subclass adds the rest."""

    def __init__(self, config, quant_config, prefix: str):
        super().__init__()
        tp = get_tensor_model_parallel_world_size()
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.hidden_size // heads
        self.num_heads, self.num_kv_heads = heads // tp, max(1, kv_heads // tp)
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_proj = QKVParallelLinear(config.hidden_size, self.head_dim, heads, kv_heads, bias=False,
                                          quant_config=quant_config, prefix=f"{prefix}.qkv_proj")
        self.o_proj = RowParallelLinear(heads * self.head_dim, config.hidden_size, bias=False,
                                        quant_config=quant_config, prefix=f"{prefix}.o_proj")

    def qkv(self, hidden_states):
        """``(q, k, v)`` of ``hidden_states`` ``(N, D)``, this rank's heads."""
        qkv, _ = self.qkv_proj(hidden_states)
        return qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)


class CausalLM(nn.Module):
    """vLLM's entry class of a causal LM: a subclass sets ``model_class`` (built with ``vllm_config`` and a prefix,
    with ``embed_tokens`` and ``embed_input_ids``), ``hf_to_vllm_mapper`` and ``packed_modules_mapping``."""

    model_class: type = None
    hf_to_vllm_mapper = WeightsMapper()
    packed_modules_mapping: dict = {}

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        config = vllm_config.model_config.hf_config
        self.config = config
        self.model = self.model_class(vllm_config=vllm_config, prefix=maybe_prefix(prefix, "model"))
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, quant_config=vllm_config.quant_config,
                                      prefix=maybe_prefix(prefix, "lm_head"))
        if config.tie_word_embeddings:
            self.lm_head = self.lm_head.tie_weights(self.model.embed_tokens)
        self.logits_processor = LogitsProcessor(config.vocab_size)

    def embed_input_ids(self, input_ids):
        return self.model.embed_input_ids(input_ids)

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None):
        return self.model(input_ids, positions, intermediate_tensors, inputs_embeds)

    def compute_logits(self, hidden_states):
        return self.logits_processor(self.lm_head, hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        tied = ["lm_head."] if self.config.tie_word_embeddings else None  # the head is the embedding
        loader = AutoWeightsLoader(self, ignore_unexpected_prefixes=tied)
        return loader.load_weights(weights, mapper=self.hf_to_vllm_mapper)


__all__ = ["AttentionProjections", "CausalLM", "layer_metadata"]
