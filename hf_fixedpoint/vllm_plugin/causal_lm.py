"""What the plugin's native models share: the attention metadata of a layer in the current forward pass (and the
number of tokens it says the step has), the projections of their attention layers, the start of their base models (the
config and the token embedding), and the entry class (a base model, an LM head tied to its embedding where the config
says so, and the weights of a transformers checkpoint loaded through ``hf_to_vllm_mapper``)."""

from collections.abc import Iterable

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.distributed import get_tensor_model_parallel_world_size
from vllm.forward_context import get_forward_context, is_forward_context_available
from vllm.model_executor.layers.linear import QKVParallelLinear, RowParallelLinear
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from vllm.model_executor.models.utils import AutoWeightsLoader, WeightsMapper, maybe_prefix


def layer_metadata(layer_name: str):
    """The attention metadata of ``layer_name`` in this forward pass, or None (a dummy or profiling run)."""
    if not is_forward_context_available():
        return None
    metadata = get_forward_context().attn_metadata
    if isinstance(metadata, list):  # one dict per micro-batch
        metadata = metadata[0]
    return metadata.get(layer_name) if isinstance(metadata, dict) else metadata


def step_tokens(layer_name: str, num_rows: int):
    """This step's tokens among the ``num_rows`` rows of the batch (the rows past them pad it), from the attention
    metadata of ``layer_name``; None in a dummy run (no metadata)."""
    metadata = layer_metadata(layer_name)
    return None if metadata is None else min(int(metadata.num_actual_tokens), num_rows)


class AttentionProjections(nn.Module):
    """The fused q/k/v projection and the output projection of a (grouped-query) attention layer of head dim
    ``hidden_size // num_attention_heads``, sharded over the tensor-parallel ranks; a subclass adds the rest. A config
    without ``num_key_value_heads`` has as many key/value heads as query heads."""

    def __init__(self, config, quant_config, prefix: str):
        super().__init__()
        tp = get_tensor_model_parallel_world_size()
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", heads)
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


class EmbeddedModel(nn.Module):
    """The start of a native base model: ``config`` (the checkpoint's config) and the token embedding ``embed_tokens``
    (``embed_input_ids``); a subclass builds the rest after ``super().__init__``."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        config = vllm_config.model_config.hf_config
        self.config = config
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size,
                                                   prefix=f"{prefix}.embed_tokens")

    def embed_input_ids(self, input_ids):
        return self.embed_tokens(input_ids)


class CausalLM(nn.Module):
    """vLLM's entry class of a causal LM: a subclass sets ``model_class`` (an ``EmbeddedModel``); ``hf_to_vllm_mapper``
    and ``packed_modules_mapping`` load a checkpoint's ``q_proj`` / ``k_proj`` / ``v_proj`` into
    ``AttentionProjections``' fused ``qkv_proj`` (a subclass with more fused weights sets its own)."""

    model_class: type = None
    hf_to_vllm_mapper = WeightsMapper(orig_to_new_stacked={
        ".q_proj": (".qkv_proj", "q"), ".k_proj": (".qkv_proj", "k"), ".v_proj": (".qkv_proj", "v")})
    packed_modules_mapping: dict = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}

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


__all__ = ["AttentionProjections", "CausalLM", "EmbeddedModel", "layer_metadata", "step_tokens"]
