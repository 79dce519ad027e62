"""Attractor LM as a native vLLM model: the package's ``AttractorForCausalLM`` (``modeling/attractor_lm``) on vLLM's
layers and paged cache.

* Backbone: one vLLM ``Attention`` per layer, as in any causal LM; its output is the proposal ``y0``.
* Attractor: the fixed point ``y* = T_a(y*, y0)`` per token, found by the package's own solve (``fixed_point`` with
  the config's ``fp_*`` settings and ``readout_iters``, as transformers runs it in eval mode), with a map ``T_a`` whose
  attention is vLLM's. Each evaluation of ``T_a`` writes the iterate's keys/values of this step's tokens into their
  paged slots and attends to them and to the earlier tokens' cached ones; a last evaluation at ``y*`` leaves the fixed
  point's keys in the cache, as transformers' cache holds them. A new token is thus solved against the earlier tokens'
  converged keys, and the tokens of one prompt are solved together.
* Every token is an entry of one solve (convergence, freezing and the solver's history are per token), so a request's
  tokens do not depend on the other requests of the batch; ``fp_stop_fraction`` (a rule over the whole batch) is
  refused at engine start (``knobs.AttractorConfigHook``).
* A prompt split across forward passes (chunked prefill, a prefix-cache hit) is solved in parts, the later part
  against the earlier part's converged keys: the states then agree with transformers' one-pass prefill to the
  solver's tolerance, not bit for bit.
"""

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import ColumnParallelLinear, RowParallelLinear
from vllm.model_executor.layers.rotary_embedding import get_rope

from hf_fixedpoint.modeling.attractor_lm.modeling_attractor_lm import AttractorModel as _Reference

from .causal_lm import AttentionProjections, CausalLM, EmbeddedModel, step_tokens


class AttractorAttention(AttentionProjections):
    """Fused q/k/v projection, per-head QK RMSNorm, RoPE and one paged ``Attention`` (its cache slot named by
    ``attn_prefix``)."""

    def __init__(self, config, cache_config, quant_config, prefix: str, attn_prefix: str):
        super().__init__(config, quant_config, prefix)
        self.q_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.rotary_emb = get_rope(self.head_dim, max_position=config.max_position_embeddings, is_neox_style=True,
                                   rope_parameters=config.rope_parameters)
        self.attn = Attention(self.num_heads, self.head_dim, self.head_dim**-0.5, num_kv_heads=self.num_kv_heads,
                              cache_config=cache_config, quant_config=quant_config, prefix=attn_prefix)

    def _normed(self, x, norm):
        return norm(x.view(*x.shape[:-1], -1, self.head_dim)).view(x.shape)

    def forward(self, positions, hidden_states):
        q, k, v = self.qkv(hidden_states)
        q, k = self.rotary_emb(positions, self._normed(q, self.q_norm), self._normed(k, self.k_norm))
        out, _ = self.o_proj(self.attn(q, k, v))
        return out


class AttractorMLP(nn.Module):
    """ReLU² MLP (``act``: a subclass sets another activation)."""

    act = staticmethod(lambda x: torch.relu(x).square())

    def __init__(self, config, quant_config, prefix: str):
        super().__init__()
        self.up_proj = ColumnParallelLinear(config.hidden_size, config.intermediate_size, bias=False,
                                            quant_config=quant_config, prefix=f"{prefix}.up_proj")
        self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size, bias=False,
                                           quant_config=quant_config, prefix=f"{prefix}.down_proj")

    def forward(self, x):
        x, _ = self.up_proj(x)
        x, _ = self.down_proj(self.act(x))
        return x


class AttractorDecoderLayer(nn.Module):
    """Pre-norm layer ``h + g_a * Attn(norm(h))``, then ``h + g_m * MLP(norm(h))``; the gates
    ``g = layer_scale_max * sigmoid(raw)`` on attractor layers, none (``g = 1``) on backbone layers."""

    def __init__(self, config, gated: bool, vllm_config: VllmConfig, prefix: str, attn_prefix: str):
        super().__init__()
        quant_config = vllm_config.quant_config
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.self_attn = AttractorAttention(config, vllm_config.cache_config, quant_config, f"{prefix}.self_attn",
                                            attn_prefix)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = AttractorMLP(config, quant_config, f"{prefix}.mlp")
        self.gamma_max = config.layer_scale_max
        if gated:
            self.raw_gamma_attn = nn.Parameter(torch.empty(config.hidden_size))
            self.raw_gamma_mlp = nn.Parameter(torch.empty(config.hidden_size))
        else:
            self.raw_gamma_attn = self.raw_gamma_mlp = None

    def _gate(self, raw, x):
        return x if raw is None else x * (self.gamma_max * torch.sigmoid(raw))

    def forward(self, positions, h):
        h = h + self._gate(self.raw_gamma_attn, self.self_attn(positions, self.input_layernorm(h)))
        return h + self._gate(self.raw_gamma_mlp, self.mlp(self.post_attention_layernorm(h)))


class AttractorModel(EmbeddedModel):
    """Embedding -> backbone (proposal ``y0``) -> attractor fixed point ``y*`` -> final RMSNorm."""

    # The package's solve of the attractor map (fixed_point with the config's fp_* settings and readout_iters), and its
    # input injection.
    _solve = _Reference._solve
    inject = _Reference.inject

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        config = self.config
        backbone = config.num_backbone_layers
        # Cache slots: layer i of the backbone is slot i, layer i of the attractor slot backbone + i (a name with that
        # one index), the layout of transformers' cache.
        self.backbone = nn.ModuleList(
            AttractorDecoderLayer(config, False, vllm_config, f"{prefix}.backbone.{i}",
                                  f"{prefix}.layers.{i}.self_attn.attn") for i in range(backbone))
        self.attractor = nn.ModuleList(
            AttractorDecoderLayer(config, True, vllm_config, f"{prefix}.attractor.{i}",
                                  f"{prefix}.layers.{backbone + i}.self_attn.attn")
            for i in range(config.num_attractor_layers))
        self.inject_proj = (nn.Linear(2 * config.hidden_size, config.hidden_size, bias=False)
                            if config.injection == "concat" else None)
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.train(False)  # the solve's eval-mode settings (fp_eval_max_iter), as transformers serves the model

    def attractor_map(self, y, y0, positions, tail):
        """``T_a(y, y0)`` on the ``(1, n, D)`` states of this step's ``n`` tokens; ``tail``: the rows of the
        engine's padding tokens past them (``(N - n, D)``, usually none), which the attention layers take along."""
        u = self.inject(y, y0)
        h = u[0] if tail.shape[0] == 0 else torch.cat([u[0], tail])
        for layer in self.attractor:
            h = layer(positions, h)
        return h[None, :y.shape[1]] - y

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None):
        h = self.embed_input_ids(input_ids) if inputs_embeds is None else inputs_embeds
        for layer in self.backbone:
            h = layer(positions, h)
        readout = self.config.readout_iters
        n = step_tokens(self.attractor[0].self_attn.attn.layer_name, h.shape[0])
        if readout == 0 or n is None:  # T=0 readout: decode the proposal (a dummy run has nothing to solve)
            return self.norm(h)
        y0, tail = h[None, :n], h[n:]
        y_star, _ = self._solve(y0, (y0, positions, tail), readout, None)
        self.attractor_map(y_star, y0, positions, tail)  # leaves the fixed point's keys/values in the cache
        return self.norm(y_star[0] if tail.shape[0] == 0 else torch.cat([y_star[0], tail]))


class AttractorForCausalLM(CausalLM):
    """vLLM's entry class for ``AttractorForCausalLM`` checkpoints (the package's exports)."""

    model_class = AttractorModel


__all__ = ["AttractorForCausalLM", "AttractorModel"]
