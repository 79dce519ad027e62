"""SELF-Mistral: transformers' Mistral with every attention layer replaced by causal Fixed-Point Self-Attention
(Mathur et al., "Change of Thought", §4.2 and App. J).

Each decoder layer iterates its attention to a fixed point (``fp_fpsa.fpsa_decoder_attention``): queries and keys
come from the iterate ``Z = input_layernorm(R + W_O O)`` with RoPE, values stay ``V = X W_V``, the causal (and padding)
mask, restricted to Mistral's sliding window when the config sets one, applies in every iteration and grouped-query
attention is kept. With the KV cache the window is that of transformers' sliding-window cache layers.
``q_proj``/``k_proj``/``v_proj``/``o_proj`` and every other module keep Mistral's names, so
``SelfMistralForCausalLM.from_pretrained(<any Mistral checkpoint>)`` loads the weights unchanged, and with
``fp_max_iter=1`` the model computes exactly what the Mistral checkpoint computes.

Generation: with the KV cache, earlier tokens keep their converged keys and static values and only the new tokens
iterate. Per-call knobs are named ``forward`` parameters, so they work through ``generate``:
``model.generate(ids, fp_max_iter=8, fp_tol=1e-4)``; any other ``fp_*`` setting is a ``forward`` keyword too (through
``generate``: ``fp_overrides={...}``), and
``fp_stats_log=[]`` collects the ``FPSAStats`` of every forward call (the prompt, then one entry per generated token).
Outputs carry ``fp_stats`` (iterations per layer, token and head; ``.summary()`` gives median / p90 / cap-hit rate).
"""

from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn
from transformers import MistralForCausalLM, MistralModel, MistralPreTrainedModel
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.models.mistral.modeling_mistral import (
    MistralAttention,
    MistralDecoderLayer,
    MistralMLP,
    MistralRMSNorm,
    MistralRotaryEmbedding,
    eager_attention_forward,
    rotate_half,
)
from transformers.utils.generic import can_return_tuple

from .configuration_self_mistral import SelfMistralConfig
from .fp_backward import fixed_point  # noqa: F401  (see vendor.direct_import_problems)
from .fp_compat import CACHE_NAME, attention_function, pop_cache, require_dynamic_cache
from .fp_engines import EngineGuardMixin
from .fp_fpsa import FPSAOptions, fpsa_decoder_attention
from .fp_fpsa_layers import init_fpsa_weights
from .fp_fpsa_settings import FPSA_DEFAULTS  # noqa: F401  (see vendor.direct_import_problems)
from .fp_fpsa_stats import FPSAStats, FPSAStatsSink, with_jac_penalty
from .fp_halting import ACTAccumulator  # noqa: F401  (see vendor.direct_import_problems)
from .fp_jacobian import jacobian_frobenius  # noqa: F401  (see vendor.direct_import_problems)
from .fp_registry import check_number  # noqa: F401  (see vendor.direct_import_problems)
from .fp_settings import GenerateKnobsMixin, call_knobs, call_max_iter, fixed_point_kwargs
from .fp_solvers import defer_finite_checks
from .fp_speculative import SpeculativeGenerationMixin
from .fp_stats import FixedPointStats  # noqa: F401  (see vendor.direct_import_problems)


def apply_rope(t, cos, sin):
    """RoPE on ``(B, H, T, d)`` heads: the same arithmetic as Mistral's ``apply_rotary_pos_emb``."""
    return (t * cos.unsqueeze(1)) + (rotate_half(t) * sin.unsqueeze(1))


def check_cache(cache) -> None:
    require_dynamic_cache(cache, "SELF models", "after each layer's solve the new tokens' converged keys replace "
                          "placeholders at their slots of the layer's key tensor (fp_fpsa.fpsa_decoder_attention), "
                          "which a sliding-window static layer rolls", static=True)


class SelfMistralAttention(MistralAttention):
    """``MistralAttention`` run as a causal FPSA loop; needs the layer's residual stream and input norm."""

    def __init__(self, config: SelfMistralConfig, layer_idx: int):
        super().__init__(config, layer_idx)
        heads = config.num_attention_heads
        self.fpsa_log_tau = nn.Parameter(torch.zeros(heads)) if config.fpsa_learn_temperature else None

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, past_key_values=None, *,
                fpsa_residual=None, fpsa_norm=None, fpsa_fp_kwargs: Optional[dict] = None,
                fpsa_stats: Optional[FPSAStats] = None, **kwargs):
        config = self.config
        past_key_values = pop_cache(past_key_values, kwargs)
        if fpsa_fp_kwargs is None:
            fpsa_fp_kwargs = fixed_point_kwargs(config, self.training)
        attention_fn = attention_function(config._attn_implementation, eager_attention_forward)
        # Not attention-function arguments here: the solver drops finished rows, so per-row tensors must not ride
        # along in the keyword arguments, and the cache is handled by fpsa_decoder_attention.
        kwargs.pop("position_ids", None)
        kwargs.pop("use_cache", None)
        kwargs["sliding_window"] = getattr(config, "sliding_window", None)  # as MistralAttention does
        output, result = fpsa_decoder_attention(
            self, hidden_states, position_embeddings=position_embeddings, rope=apply_rope, attention_fn=attention_fn,
            fp_kwargs=fpsa_fp_kwargs, attention_mask=attention_mask, cache=past_key_values, residual=fpsa_residual,
            norm=fpsa_norm, log_temperature=self.fpsa_log_tau, attention_kwargs=kwargs,
            options=FPSAOptions.from_config(
                config, return_weights=bool(kwargs.get("output_attentions", config.output_attentions))),
        )
        if fpsa_stats is not None:
            fpsa_stats.add(result, layer=self)
        return output, result.attn_weights


class SelfMistralDecoderLayer(MistralDecoderLayer):
    """``MistralDecoderLayer`` whose attention iterates ``Z = input_layernorm(R + W_O O)`` (same submodule names)."""

    # Copied from transformers.models.mistral.modeling_mistral.MistralDecoderLayer.__init__ with
    #     super().__init__() -> GradientCheckpointingLayer.__init__(self)
    #     MistralAttention -> SelfMistralAttention
    def __init__(self, config: SelfMistralConfig, layer_idx: int):
        GradientCheckpointingLayer.__init__(self)  # not MistralDecoderLayer's: it would build a MistralAttention
        self.hidden_size = config.hidden_size
        self.self_attn = SelfMistralAttention(config=config, layer_idx=layer_idx)
        self.mlp = MistralMLP(config)
        self.input_layernorm = MistralRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = MistralRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    # Copied from transformers.models.mistral.modeling_mistral.MistralDecoderLayer.forward with
    #     use_cache=use_cache, -> use_cache=use_cache, fpsa_residual=residual, fpsa_norm=self.input_layernorm,
    def forward(self, hidden_states, attention_mask=None, position_ids=None, past_key_values=None, use_cache=False,
                position_embeddings=None, **kwargs):
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states, _ = self.self_attn(
            hidden_states=hidden_states, attention_mask=attention_mask, position_ids=position_ids,
            past_key_values=past_key_values, use_cache=use_cache,
            fpsa_residual=residual, fpsa_norm=self.input_layernorm,  # main diff: the FPSA loop's residual and norm
            position_embeddings=position_embeddings, **kwargs,
        )
        hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = self.post_attention_layernorm(hidden_states)
        hidden_states = self.mlp(hidden_states)
        hidden_states = residual + hidden_states
        return hidden_states


class SelfMistralPreTrainedModel(EngineGuardMixin, MistralPreTrainedModel):
    # Why vLLM's generic Transformers backend cannot run it (fp_engines): refused with this reason.
    _engine_refusal = ("each attention layer iterates to a fixed point (FPSA), calling its attention many times per "
                       "token on changing rows, and decoding attends to the converged keys of the earlier tokens; "
                       "such a backend calls each attention module once per token against its paged cache (it fails "
                       "at engine start)")
    config_class = SelfMistralConfig
    _no_split_modules = ["SelfMistralDecoderLayer"]
    # The FPSA loop calls the attention function many times with changing batch rows and has data-dependent stops:
    # only eager and sdpa are tested.
    _supports_flash_attn = False
    _supports_flex_attn = False
    _can_compile_fullgraph = False

    @torch.no_grad()
    def _init_weights(self, module):
        super()._init_weights(module)
        init_fpsa_weights(self, module)


@dataclass
class SelfMistralModelOutputWithPast(BaseModelOutputWithPast):
    """Mistral's output plus ``fp_stats`` (``FPSAStats``)."""

    fp_stats: Optional[FPSAStats] = None


@dataclass
class SelfMistralCausalLMOutputWithPast(CausalLMOutputWithPast):
    """Mistral's LM output plus ``fp_stats`` (``FPSAStats``)."""

    fp_stats: Optional[FPSAStats] = None


class SelfMistralModel(SelfMistralPreTrainedModel, MistralModel):
    """``MistralModel`` with causal FPSA attention; ``forward`` takes ``fp_overrides`` and returns ``fp_stats``."""

    # Copied from transformers.models.mistral.modeling_mistral.MistralModel.__init__ with
    #     super().__init__(config) -> MistralPreTrainedModel.__init__(self, config)
    #     MistralDecoderLayer -> SelfMistralDecoderLayer
    def __init__(self, config: SelfMistralConfig):
        MistralPreTrainedModel.__init__(self, config)  # not MistralModel's: it would build Mistral layers
        self.padding_idx = config.pad_token_id
        self.vocab_size = config.vocab_size
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        self.layers = nn.ModuleList(
            [SelfMistralDecoderLayer(config, layer_idx) for layer_idx in range(config.num_hidden_layers)]
        )
        self.norm = MistralRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = MistralRotaryEmbedding(config=config)
        self.gradient_checkpointing = False
        self.post_init()

    @can_return_tuple
    @defer_finite_checks
    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                inputs_embeds=None, use_cache=None, fp_max_iter: Optional[int] = None, fp_tol: Optional[float] = None,
                fp_overrides: Optional[dict] = None, fpsa_stats: Optional[FPSAStats] = None, **kwargs):
        overrides = call_knobs(self.config, kwargs, type(self).__name__, fp_overrides, fp_max_iter, fp_tol)
        past_key_values = pop_cache(past_key_values, kwargs)
        check_cache(past_key_values)
        stats = FPSAStats() if fpsa_stats is None else fpsa_stats
        if attention_mask is not None and attention_mask.dim() == 2:
            length = (input_ids if input_ids is not None else inputs_embeds).shape[1]
            stats.token_mask = attention_mask[:, -length:].bool()
        out = super().forward(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                              inputs_embeds=inputs_embeds, use_cache=use_cache, return_dict=True,
                              **{CACHE_NAME: past_key_values},
                              fpsa_fp_kwargs=fixed_point_kwargs(self.config, self.training, overrides),
                              fpsa_stats=FPSAStatsSink(stats), **kwargs)
        return SelfMistralModelOutputWithPast(**out, fp_stats=stats)


class SelfMistralForCausalLM(GenerateKnobsMixin, SpeculativeGenerationMixin, SelfMistralPreTrainedModel,
                             MistralForCausalLM):
    """``MistralForCausalLM`` on ``SelfMistralModel``. Per-call knobs: ``fp_max_iter``, ``fp_tol``, ``fp_overrides``;
    ``fp_stats_log`` (a list) receives the ``FPSAStats`` of each call, e.g. of every ``generate`` step.
    ``generate(..., draft_depth=d)`` decodes self-speculatively (``fp_speculative``)."""

    # generate(..., draft_depth=d) (fp_speculative): drafts at fp_max_iter=d (d=1: the base model), verified at the
    # call's cap; fp_eval_max_iter too, so that a call's fp_overrides cannot raise the draft's cap.
    _draft_keywords = ("fp_max_iter", "fp_eval_max_iter")

    # Copied from transformers.models.mistral.modeling_mistral.MistralForCausalLM.__init__ with
    #     super().__init__(config) -> MistralPreTrainedModel.__init__(self, config)
    #     MistralModel -> SelfMistralModel
    def __init__(self, config: SelfMistralConfig):
        MistralPreTrainedModel.__init__(self, config)
        self.model = SelfMistralModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def _full_depth(self, model_kwargs) -> int:
        return call_max_iter(self.config, model_kwargs, "generate")

    @can_return_tuple
    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                inputs_embeds=None, labels=None, use_cache=None, logits_to_keep=0, fp_max_iter: Optional[int] = None,
                fp_tol: Optional[float] = None, fp_overrides: Optional[dict] = None,
                fp_stats_log: Optional[list] = None, **kwargs):
        overrides = call_knobs(self.config, kwargs, type(self).__name__, fp_overrides, fp_max_iter, fp_tol)
        past_key_values = pop_cache(past_key_values, kwargs)
        stats = FPSAStats()
        out = super().forward(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                              inputs_embeds=inputs_embeds, labels=labels, use_cache=use_cache,
                              **{CACHE_NAME: past_key_values}, logits_to_keep=logits_to_keep, return_dict=True,
                              fp_overrides=overrides, fpsa_stats=stats,
                              **kwargs)
        if fp_stats_log is not None:
            fp_stats_log.append(stats)
        out = SelfMistralCausalLMOutputWithPast(**out, fp_stats=stats)
        return with_jac_penalty(out, stats, self.config.fpsa_jac_weight)


__all__ = ["SelfMistralForCausalLM", "SelfMistralModel", "SelfMistralPreTrainedModel"]
