"""DEQ-LM as a native vLLM model: the package's ``DEQLMForCausalLM`` (``modeling/deq_lm``) on vLLM's layers and paged
cache.

* The map ``f(z; x) = h + MLP(norm2(h))``, ``h = x + Attn(norm1(z))``, with ``x`` the token embedding plus the learned
  position embedding of vLLM's position, and a causal vLLM ``Attention`` whose queries, keys and values all come from
  ``norm1(z)``.
* The attention is causal, so the prefix of the sequence's joint fixed point is the fixed point of the prefix:
  transformers solves the whole sequence again at every step (it keeps no cache); here a new token is solved alone
  against the earlier tokens' keys/values at their fixed point, held in the paged cache. As in ``attractor.py``, each
  evaluation of ``f`` writes this step's tokens' keys/values into their slots and attends to them and to the earlier
  tokens' cached ones, and a last evaluation at ``z*`` leaves the fixed point's keys/values in the cache; the tokens of
  one prompt attend to each other's current iterate: the joint solve of transformers.
* The solve is the package's ``fixed_point`` from ``z0 = 0`` with the config's ``fp_*`` settings in eval mode
  (``fixed_point_kwargs``, as transformers serves the model), every token an entry (convergence, freezing and the
  solver's history are per token), so a request's tokens do not depend on its batch-mates. Transformers judges
  convergence per sequence: the two stop within the solver's tolerance of the same fixed point, so they give the same
  tokens where the solves converge, not bit for bit. A NaN / Inf iterate raises (``NonFiniteError``) as in
  transformers; a token still open at the iteration cap gets the best iterate, as in transformers, and a warning
  (once): a capped solve is not the fixed point, so the per-token solve against cached keys and transformers' solve of
  the whole sequence give different states, and possibly tokens.
* ``fp_stop_fraction`` (a share of the whole batch) and tensor parallelism are refused at engine start, and the model
  runs eagerly (``knobs.SolveConfigHook``). A prompt split across forward passes (chunked prefill, a prefix-cache hit)
  is solved in parts, the later part against the earlier part's converged keys: the same fixed point, to the
  solver's tolerance.
"""

import torch
from torch import nn
from torch.nn import functional as F
from vllm.config import VllmConfig
from vllm.logger import init_logger
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

from hf_fixedpoint.core.fp_backward import fixed_point
from hf_fixedpoint.core.fp_settings import fixed_point_kwargs

from .attractor import AttractorMLP
from .causal_lm import AttentionProjections, CausalLM, EmbeddedModel, step_tokens

logger = init_logger(__name__)


class DEQLMAttention(AttentionProjections):
    """Fused q/k/v projection and one paged ``Attention`` (no rotary embedding: DEQ-LM's positions are learned and
    added to the injection); its cache slot is named by ``attn_prefix``."""

    def __init__(self, config, cache_config, quant_config, prefix: str, attn_prefix: str):
        super().__init__(config, quant_config, prefix)
        self.attn = Attention(self.num_heads, self.head_dim, self.head_dim**-0.5, num_kv_heads=self.num_kv_heads,
                              cache_config=cache_config, quant_config=quant_config, prefix=attn_prefix)

    def forward(self, hidden_states):
        out, _ = self.o_proj(self.attn(*self.qkv(hidden_states)))
        return out


class DEQLMMLP(AttractorMLP):
    """GELU MLP."""

    act = staticmethod(F.gelu)


class DEQLMBlock(nn.Module):
    """The fixed-point map ``f(z; x)`` on ``(N, D)`` rows."""

    def __init__(self, config, vllm_config: VllmConfig, prefix: str, attn_prefix: str):
        super().__init__()
        quant_config = vllm_config.quant_config
        self.norm1 = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.attn = DEQLMAttention(config, vllm_config.cache_config, quant_config, f"{prefix}.attn", attn_prefix)
        self.norm2 = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = DEQLMMLP(config, quant_config, f"{prefix}.mlp")

    def forward(self, z, x):
        h = x + self.attn(self.norm1(z))
        return h + self.mlp(self.norm2(h))


class DEQLMModel(EmbeddedModel):
    """Token + position embedding ``x`` -> the block's fixed point ``z*`` per token -> final RMSNorm."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        config = self.config
        self.embed_positions = VocabParallelEmbedding(config.max_position_embeddings, config.hidden_size,
                                                      prefix=f"{prefix}.embed_positions")
        # The cache slot's name carries one layer index, as vLLM's cache layout reads it from the name.
        self.block = DEQLMBlock(config, vllm_config, f"{prefix}.block", f"{prefix}.layers.0.self_attn.attn")
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.fp_kwargs = fixed_point_kwargs(config, False)  # eval mode, as transformers serves the model

    def rows(self, z, x):
        """The ``(N, D)`` rows of the iterate ``z`` ``(1, n, D)`` of this step's ``n`` tokens, then zero rows for the
        engine's padding tokens past them (usually none)."""
        pad = x.shape[0] - z.shape[1]
        return z[0] if pad == 0 else torch.cat([z[0], z.new_zeros(pad, z.shape[-1])])

    def block_map(self, z, x):
        """``f(z; x)`` on the ``(1, n, D)`` iterate of this step's tokens; ``x``: the injection of every row."""
        return self.block(self.rows(z, x), x)[None, :z.shape[1]]

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None):
        x = self.embed_input_ids(input_ids) if inputs_embeds is None else inputs_embeds
        x = x + self.embed_positions(positions)
        n = step_tokens(self.block.attn.attn.layer_name, x.shape[0])
        if n is None:  # a dummy run (no attention metadata): one evaluation from z0 = 0, nothing to solve
            return self.norm(self.block(torch.zeros_like(x), x))
        z_star, stats = fixed_point(self.block_map, x.new_zeros(1, n, x.shape[-1]), args=(x,), batch_dims=2,
                                    compact=True, **self.fp_kwargs)
        if not bool(stats.converged.all()):  # warned once per engine (the cap and tolerance are the engine's)
            logger.warning_once("hf-fixedpoint's vLLM plugin: DEQ-LM's fixed-point solve reached its iteration cap "
                                "(%d) with tokens above fp_tol=%g: they are decoded from the best iterate, as "
                                "transformers does, and their tokens may differ from transformers' (which solves the "
                                "whole sequence again at every step).", stats.nfe, stats.tol)
        z = self.rows(z_star, x)
        self.block(z, x)  # leaves the fixed point's keys/values in the cache
        return self.norm(z)


class DEQLMForCausalLM(CausalLM):
    """vLLM's entry class for ``DEQLMForCausalLM`` checkpoints (the package's exports)."""

    model_class = DEQLMModel


__all__ = ["DEQLMForCausalLM", "DEQLMModel"]
