"""Ouro as a native vLLM model: the package's ``OuroForCausalLM`` (``modeling/ouro``) on vLLM's layers and paged cache.

* Loops: the decoder stack runs ``config.total_ut_steps`` times (set it with ``hf_overrides={"total_ut_steps": k}``),
  the final norm after every loop, as in transformers.
* KV cache: one vLLM ``Attention`` per (loop, layer), with the unique layer index ``loop * num_layers + layer`` (the
  layout of transformers' cache), so loop ``t`` of a new token attends to the loop-``t`` keys of the earlier tokens.
* Exit: the config's rule (``early_exit_threshold``, ``early_exit_tol``) picks each token's decoded loop, as
  transformers' ``exit_mode="select"`` does; every loop is computed and the cache of every loop is written.
* Per request (``knobs.OuroRequestKnobs``): ``total_ut_steps`` up to the engine's loops and ``exit_threshold``. Loop
  ``t`` of a token depends only on loops ``< t``, so a request of depth ``k`` decoded from the loops of a deeper batch
  gets exactly its depth-``k`` tokens. The deeper loops are computed for every token while prefix caching is on (a
  later, deeper request may reuse the cached blocks); without it, only up to the deepest request of the batch.
"""

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.model_executor.layers.activation import SiluAndMul
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from vllm.model_executor.layers.rotary_embedding import get_rope
from vllm.model_executor.models.utils import WeightsMapper

from hf_fixedpoint.modeling.ouro.modeling_ouro import ExitRule

from .causal_lm import AttentionProjections, CausalLM, EmbeddedModel, layer_metadata
from .knobs import OuroRequestKnobs


class OuroAttention(AttentionProjections):
    """Fused q/k/v projection, RoPE, and one paged ``Attention`` per loop (its own KV slot)."""

    def __init__(self, config, layer: int, cache_config, quant_config, prefix: str):
        super().__init__(config, quant_config, prefix)
        self.rotary_emb = get_rope(self.head_dim, max_position=config.max_position_embeddings, is_neox_style=True,
                                   rope_parameters=getattr(config, "rope_parameters", None))
        layers = config.num_hidden_layers
        # The slot of loop t is layer t * L + layer of an unrolled L * T stack: a name with that one index.
        self.attn = nn.ModuleList(
            Attention(self.num_heads, self.head_dim, self.head_dim**-0.5, num_kv_heads=self.num_kv_heads,
                      cache_config=cache_config, quant_config=quant_config,
                      prefix=prefix.replace(f"layers.{layer}.", f"layers.{t * layers + layer}.") + ".attn")
            for t in range(config.total_ut_steps))

    def forward(self, positions, hidden_states, loop: int):
        q, k, v = self.qkv(hidden_states)
        q, k = self.rotary_emb(positions, q, k)
        out, _ = self.o_proj(self.attn[loop](q, k, v))
        return out


class OuroMLP(nn.Module):
    def __init__(self, config, quant_config, prefix: str):
        super().__init__()
        if config.hidden_act != "silu":
            raise ValueError(f"hidden_act={config.hidden_act!r} is not served by hf-fixedpoint's vLLM plugin. "
                             "Allowed values: 'silu'.")
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [config.intermediate_size] * 2,
                                                       bias=False, quant_config=quant_config,
                                                       prefix=f"{prefix}.gate_up_proj")
        self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size, bias=False,
                                           quant_config=quant_config, prefix=f"{prefix}.down_proj")
        self.act = SiluAndMul()

    def forward(self, x):
        x, _ = self.gate_up_proj(x)
        x, _ = self.down_proj(self.act(x))
        return x


class OuroDecoderLayer(nn.Module):
    """Ouro's sandwich layer: ``h + norm2(attn(norm1(h)))``, then ``h + norm2'(mlp(norm1'(h)))``."""

    def __init__(self, config, layer: int, cache_config, quant_config, prefix: str):
        super().__init__()
        self.self_attn = OuroAttention(config, layer, cache_config, quant_config, f"{prefix}.self_attn")
        self.mlp = OuroMLP(config, quant_config, f"{prefix}.mlp")
        names = ("input_layernorm", "input_layernorm_2", "post_attention_layernorm", "post_attention_layernorm_2")
        for name in names:
            setattr(self, name, RMSNorm(config.hidden_size, eps=config.rms_norm_eps))

    def forward(self, positions, h, loop: int):
        h = h + self.input_layernorm_2(self.self_attn(positions, self.input_layernorm(h), loop))
        return h + self.post_attention_layernorm_2(self.mlp(self.post_attention_layernorm(h)))


class OuroModel(EmbeddedModel):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        config = self.config
        self.layers = nn.ModuleList(
            OuroDecoderLayer(config, i, vllm_config.cache_config, vllm_config.quant_config, f"{prefix}.layers.{i}")
            for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.early_exit_gate = nn.Linear(config.hidden_size, 1)
        self.all_loops = vllm_config.cache_config.enable_prefix_caching

    def token_settings(self, num_tokens: int, device):
        """Per token: ``(depth, threshold)`` ``(N,)`` tensors from the requests' settings, or None when every token
        has the engine's defaults."""
        knobs, loops = OuroRequestKnobs.current, self.config.total_ut_steps
        if knobs is None or not knobs.rows:
            return None
        metadata = layer_metadata(self.layers[0].self_attn.attn[0].layer_name)
        if metadata is None:  # a dummy (profiling) run
            return None
        starts = metadata.query_start_loc.to("cpu")
        depths, thresholds = knobs.per_row(starts.numel() - 1, loops, self.config.early_exit_threshold)
        # each token's row; padding tokens past the last request take the last row's settings
        row = torch.searchsorted(starts[1:], torch.arange(num_tokens), right=True).clamp_max(starts.numel() - 2)
        return (torch.tensor(depths)[row].to(device), torch.tensor(thresholds, dtype=torch.float32)[row].to(device))

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None):
        h = self.embed_input_ids(input_ids) if inputs_embeds is None else inputs_embeds
        settings = self.token_settings(h.shape[0], h.device)
        loops = self.config.total_ut_steps
        if settings is not None and not self.all_loops:
            loops = int(settings[0].max())
        states = []
        for t in range(loops):
            for layer in self.layers:
                h = layer(positions, h, t)
            h = self.norm(h)
            states.append(h)
        return self.exit_states(states, settings)

    def exit_states(self, states, settings):
        """Each token's decoded state: the first loop (below its depth) where the exit rule fires, else its last."""
        threshold, tol = self.config.early_exit_threshold, getattr(self.config, "early_exit_tol", None)
        if settings is None:
            if (threshold is None and tol is None) or len(states) == 1:
                return states[-1]
            depth = torch.full(states[0].shape[:1], len(states), device=states[0].device)
        else:
            depth, threshold = settings
        stacked = torch.stack(states)  # (T, N, D)
        if tol is None:
            index = self.threshold_exit(stacked, depth, threshold)
        else:  # loop by loop, as transformers' ExitRule
            rule, index = ExitRule(threshold, tol), depth - 1
            decided = torch.zeros_like(index, dtype=torch.bool)
            for t in range(len(states) - 1):
                fire = rule(self.early_exit_gate(states[t]), states[t - 1] if t else None, states[t])
                if fire is not None:
                    fire = fire & ~decided & (t < index)
                    index = torch.where(fire, torch.full_like(index, t), index)
                    decided |= fire
        return stacked.gather(0, index[None, :, None].expand(1, *stacked.shape[1:]))[0]

    def threshold_exit(self, stacked, depth, threshold):
        """``(N,)`` decoded loop under the threshold rule alone: the first ``t`` below the token's last loop whose
        ``cdf_t = sum_{j<=t} lambda_j S_{j-1}`` reaches ``threshold``, else its last loop. The gates of all loops in
        one call; the sums loop by loop in ``ExitRule``'s order of operations (the same floats; ``cumsum`` /
        ``cumprod`` round differently, which matters at ``threshold=1.0``)."""
        if threshold is None or stacked.shape[0] == 1:
            return depth - 1
        lam = torch.sigmoid(self.early_exit_gate(stacked[:-1])[..., 0].float())  # (T - 1, N)
        cdf, survival, fires = lam[0], 1.0 - lam[0], [lam[0] >= threshold]
        for t in range(1, lam.shape[0]):
            cdf = cdf + lam[t] * survival
            survival = survival * (1.0 - lam[t])
            fires.append(cdf >= threshold)
        loop = torch.arange(lam.shape[0], device=lam.device)[:, None]
        fire = torch.stack(fires) & (loop < depth - 1)
        return torch.where(fire.any(0), fire.int().argmax(0), depth - 1)


class OuroForCausalLM(CausalLM):
    """vLLM's entry class for ``OuroForCausalLM`` checkpoints (the package's exports and ``ByteDance/Ouro-*``)."""

    hf_to_vllm_mapper = WeightsMapper(orig_to_new_stacked={
        ".q_proj": (".qkv_proj", "q"), ".k_proj": (".qkv_proj", "k"), ".v_proj": (".qkv_proj", "v"),
        ".gate_proj": (".gate_up_proj", 0), ".up_proj": (".gate_up_proj", 1)})
    packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
    model_class = OuroModel


__all__ = ["OuroForCausalLM", "OuroModel"]
