"""SELF-LLaMA and SELF-Mistral as native vLLM models: vLLM's own Llama (``vllm.model_executor.models.llama``: fused
projections, RoPE, MLP, norms, weight loading) with each layer's attention solved to a fixed point by the package's
FPSA operator (``core.fp_fpsa.fpsa_attention``: the same solver, tolerance, cap, per-(token, head) halting, update
form and temperature as ``modeling/self_llama``; ``fp_max_iter=1`` is the base model).

* Every evaluation of the map calls the layer's paged vLLM ``Attention`` with the queries and keys of the current
  iterate and the static values: the call writes the batch's tokens' keys into their cache slots, and each token
  attends to the earlier tokens of its request (its own new tokens at their current keys, tokens of earlier steps or
  prefill chunks at their stored, converged keys). After the solve the keys of the final iterate overwrite the slots,
  as the package's cache stores them, so decoding attends to converged keys.
* The solve treats the whole batch (every request's new tokens) as one sample of ``(1, tokens, heads, head_dim)``
  entries. Every solver keeps its state per entry and freezes an entry once it converges, so a token's result does not
  depend on its batch-mates: the same tokens as transformers' ``generate`` per request (to float rounding).
  ``fp_stop_fraction`` (a share of the whole batch) is refused at engine start (``settings.check_engine``).
* Where a prompt's tokens are split over steps (chunked prefill, or a prefix-cache hit), the later chunk is solved
  against the converged keys of the earlier one, where transformers solves the prompt at once: the two agree within
  the solver tolerance where the solves converge (``fpsa_decoder_attention``'s cache has the same property), not
  bit for bit.
* SELF-Mistral's ``sliding_window`` applies to every layer, as in transformers' Mistral.
* Runs eagerly (the number of evaluations depends on the data); tensor parallelism is refused.
"""

import torch
from torch import nn
from vllm.compilation.decorators import ignore_torch_compile
from vllm.model_executor.layers.attention.attention import unified_kv_cache_update
from vllm.model_executor.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel

from hf_fixedpoint.core.fp_fpsa import FPSAOptions, fpsa_attention
from hf_fixedpoint.core.fp_settings import fixed_point_kwargs

from .causal_lm import layer_metadata


class SelfFPSAAttention(LlamaAttention):
    """``LlamaAttention`` solved as causal FPSA: queries and keys from the iterate ``Z = input_layernorm(R + W_O O)``,
    values ``V = X W_V``; ``fpsa_log_tau`` is the learned per-head temperature (``fpsa_learn_temperature``)."""

    def __init__(self, config, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        self.fpsa_log_tau = nn.Parameter(torch.zeros(self.num_heads)) if config.fpsa_learn_temperature else None
        self.fp_kwargs = fixed_point_kwargs(config, training=False)
        self.options = FPSAOptions.from_config(config, return_state=True)

    def heads(self, t, count):  # (N, count * d) -> (1, count, N, d), the package's layout
        return t.view(t.shape[0], count, self.head_dim).transpose(0, 1)[None]

    def flat(self, t):  # (1, count, N, d) -> (N, count * d), vLLM's layout
        return t[0].transpose(0, 1).reshape(t.shape[2], -1)

    def forward(self, positions, hidden_states, residual, norm):
        n, width = hidden_states.shape
        qkv, _ = self.qkv_proj(hidden_states)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        x = hidden_states[None]
        memo = {"z": x, "qk": self.rotary_emb(positions, q, k)}

        def queries_keys(z):  # (q, k) of an iterate (1, N, D), RoPE applied; the last one is kept for key()
            if memo["z"] is not z:
                q_z, k_z, _ = self.qkv_proj(z.view(n, width))[0].split([self.q_size, self.kv_size, self.kv_size], -1)
                memo["z"], memo["qk"] = z, self.rotary_emb(positions, q_z, k_z)
            return memo["qk"]

        metadata = layer_metadata(self.attn.layer_name)
        actual = getattr(metadata, "num_actual_tokens", n)

        def attend(module, q_h, k_h, v_h, mask, dropout=0.0, scaling=None, **_):
            out = self.attn(self.flat(q_h), self.flat(k_h), self.flat(v_h))
            if actual < n:  # padding rows: no attention output to iterate on
                out[actual:] = 0.0
            return out.view(1, n, self.num_heads, self.head_dim), None

        # Without metadata (vLLM's dummy runs) the attention writes nothing and returns no values: one exact step.
        fp_kwargs = self.fp_kwargs if metadata is not None else {**self.fp_kwargs, "max_iter": 1}
        result = fpsa_attention(
            self, x, query=lambda z: self.heads(queries_keys(z)[0], self.num_heads),
            key=lambda z: self.heads(queries_keys(z)[1], self.num_kv_heads), value=self.heads(v, self.num_kv_heads),
            out_proj=lambda o: self.o_proj(o.reshape(n, -1))[0].view(1, n, -1), attention_fn=attend,
            scaling=self.scaling, fp_kwargs=fp_kwargs, residual=residual[None],
            norm=lambda z: norm(z.reshape(n, width)).view(1, n, width), log_temperature=self.fpsa_log_tau,
            options=self.options)
        if fp_kwargs["max_iter"] > 1:  # the final iterate's keys replace the last evaluation's in the cache
            q_final, k_final = queries_keys(result.state)
            self.store(q_final, k_final, v)
        out, _ = self.o_proj(result.output.view(n, -1))
        return out

    def store(self, q, k, v):
        """Write ``k``, ``v`` into the batch's cache slots of this layer."""
        attn = self.attn
        if attn.attn_backend.forward_includes_kv_cache_update:  # such a backend writes only inside its forward
            attn(q, k, v)
            return
        unified_kv_cache_update(k.view(-1, attn.num_kv_heads, attn.head_size),
                                v.view(-1, attn.num_kv_heads, attn.head_size), attn.layer_name)


class SelfFPSADecoderLayer(LlamaDecoderLayer):
    """``LlamaDecoderLayer`` whose attention gets the residual stream and the input norm of the FPSA iterate."""

    def __init__(self, vllm_config, prefix: str = "", config=None):
        super().__init__(vllm_config, prefix, config, attn_layer_type=SelfFPSAAttention)

    def forward(self, positions, hidden_states, residual):
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states, residual, self.input_layernorm)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


@ignore_torch_compile  # data-dependent solve loops: not a graph
class SelfFPSAModel(LlamaModel):
    def __init__(self, *, vllm_config, prefix: str = ""):
        super().__init__(vllm_config=vllm_config, prefix=prefix, layer_type=SelfFPSADecoderLayer)


class SelfFPSAForCausalLM(LlamaForCausalLM):
    """vLLM's entry class for ``SelfLlamaForCausalLM`` and ``SelfMistralForCausalLM`` exports."""

    def __init__(self, *, vllm_config, prefix: str = ""):
        config = vllm_config.model_config.hf_config
        if config.model_type == "self_mistral" and getattr(config, "sliding_window", None) is not None:
            # transformers' Mistral windows every layer; vLLM's Llama layers read the window from layer_types
            config.layer_types = ["sliding_attention"] * config.num_hidden_layers
        super().__init__(vllm_config=vllm_config, prefix=prefix, layer_type=SelfFPSADecoderLayer)

    def _init_model(self, vllm_config, prefix: str = "", layer_type=SelfFPSADecoderLayer):
        return SelfFPSAModel(vllm_config=vllm_config, prefix=prefix)


__all__ = ["SelfFPSAAttention", "SelfFPSADecoderLayer", "SelfFPSAForCausalLM", "SelfFPSAModel"]
