"""DEQ-LM: token embeddings inject ``x`` into one weight-tied block ``f(z; x)``; the block is solved to its fixed point
``z* = f(z*; x)`` by ``fixed_point`` and ``z*`` is decoded by a tied LM head.

The map is ``h = x + Attn(norm1(z))``, ``f(z; x) = h + MLP(norm2(h))``: the state enters only through normalized
sublayers, so with small weights ``f`` is a contraction and the solve converges from ``z0 = 0``.
"""

from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn
from torch.nn import functional as F
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import ModelOutput
from transformers.utils import can_return_tuple

from .configuration_deq_lm import DEQLMConfig
from .fp_backward import fixed_point
from .fp_engines import EngineGuardMixin
from .fp_registry import check_number  # noqa: F401  (see vendor.direct_import_problems)
from .fp_settings import GenerateKnobsMixin, call_knobs, fixed_point_kwargs
from .fp_solvers import solve  # noqa: F401  (see vendor.direct_import_problems)
from .fp_stats import FixedPointStats


@dataclass
class DEQLMModelOutput(ModelOutput):
    """``last_hidden_state``: normalized fixed point ``(B, T, D)``; ``fp_stats``: the solve's statistics;
    ``hidden_states`` (``output_hidden_states``): the injection ``x`` and ``last_hidden_state``; ``attentions``
    (``output_attentions``): the block's attention weights at the fixed point ``(B, nh, T, T)``."""

    last_hidden_state: Optional[torch.FloatTensor] = None
    fp_stats: Optional[FixedPointStats] = None
    hidden_states: Optional[tuple] = None
    attentions: Optional[tuple] = None


@dataclass
class DEQLMCausalLMOutput(ModelOutput):
    loss: Optional[torch.FloatTensor] = None
    logits: Optional[torch.FloatTensor] = None
    fp_stats: Optional[FixedPointStats] = None
    hidden_states: Optional[tuple] = None
    attentions: Optional[tuple] = None


class DEQLMAttention(nn.Module):
    def __init__(self, config: DEQLMConfig):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.q_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=False)
        self.o_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=False)

    def _split(self, proj, hidden_states):
        B, T, _ = hidden_states.shape
        return proj(hidden_states).view(B, T, self.num_heads, self.head_dim).transpose(1, 2)  # (B, nh, T, hd)

    def forward(self, hidden_states: torch.Tensor, attn_mask: torch.Tensor) -> torch.Tensor:
        q, k, v = (self._split(proj, hidden_states) for proj in (self.q_proj, self.k_proj, self.v_proj))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
        return self.o_proj(out.transpose(1, 2).flatten(2))

    def weights(self, hidden_states: torch.Tensor, attn_mask: torch.Tensor) -> torch.Tensor:
        """The softmax weights ``forward`` uses, ``(B, nh, T, T)`` (for ``output_attentions``)."""
        q, k = self._split(self.q_proj, hidden_states), self._split(self.k_proj, hidden_states)
        scores = (q @ k.transpose(-1, -2)) / self.head_dim**0.5
        return scores.masked_fill(~attn_mask, float("-inf")).softmax(-1)


class DEQLMMLP(nn.Module):
    def __init__(self, config: DEQLMConfig):
        super().__init__()
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.gelu(self.up_proj(x)))


class DEQLMBlock(nn.Module):
    """The fixed-point map ``f(z; x)``."""

    def __init__(self, config: DEQLMConfig):
        super().__init__()
        self.norm1 = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.attn = DEQLMAttention(config)
        self.norm2 = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = DEQLMMLP(config)

    def forward(self, z: torch.Tensor, x: torch.Tensor, attn_mask: torch.Tensor) -> torch.Tensor:
        h = x + self.attn(self.norm1(z), attn_mask)
        return h + self.mlp(self.norm2(h))


class DEQLMPreTrainedModel(EngineGuardMixin, PreTrainedModel):
    # Why vLLM's generic Transformers backend cannot run it (fp_engines): refused with this reason.
    _engine_refusal = ("every step solves one weight-tied block to its fixed point, its attention iterated over the "
                       "new tokens; such a backend calls each attention module once per token and writes its paged "
                       "cache at every call")
    config_class = DEQLMConfig
    base_model_prefix = "model"
    _no_split_modules = ["DEQLMBlock"]
    _supports_sdpa = True


class DEQLMModel(DEQLMPreTrainedModel):
    def __init__(self, config: DEQLMConfig):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.embed_positions = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.block = DEQLMBlock(config)
        self.norm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_init()

    def get_input_embeddings(self):
        return self.embed_tokens

    def set_input_embeddings(self, value):
        self.embed_tokens = value

    @can_return_tuple
    def forward(
        self,
        input_ids: Optional[torch.LongTensor] = None,
        attention_mask: Optional[torch.Tensor] = None,
        position_ids: Optional[torch.LongTensor] = None,
        inputs_embeds: Optional[torch.FloatTensor] = None,
        fp_max_iter: Optional[int] = None,
        fp_tol: Optional[float] = None,
        fp_overrides: Optional[dict] = None,
        output_hidden_states: Optional[bool] = None,
        output_attentions: Optional[bool] = None,
        **kwargs,
    ) -> DEQLMModelOutput:
        """Without ``position_ids``, positions count the unmasked tokens of ``attention_mask`` (left padding gives
        the positions of the unpadded sequence); ``return_dict=False`` gives a tuple. Per-call knobs: ``fp_max_iter``,
        ``fp_tol`` and any other ``fp_*`` setting as keywords, or ``fp_overrides={...}`` (``call_knobs``)."""
        overrides = call_knobs(self.config, kwargs, type(self).__name__, fp_overrides, fp_max_iter, fp_tol)
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("Pass exactly one of input_ids and inputs_embeds.")
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        B, T, _ = inputs_embeds.shape
        if position_ids is None and attention_mask is not None:
            position_ids = (attention_mask.long().cumsum(-1) - 1).clamp_min(0)
        elif position_ids is None:
            position_ids = torch.arange(T, device=inputs_embeds.device)[None]
        limit = self.config.max_position_embeddings  # the position check reads the host: not inside a graph
        if T > limit or (not torch.compiler.is_compiling() and int(position_ids.max()) >= limit):
            raise ValueError(
                f"sequence length {T} exceeds max_position_embeddings={self.config.max_position_embeddings}."
            )
        x = inputs_embeds + self.embed_positions(position_ids)
        # (B, 1, T, T) bool mask: causal, and padded keys masked out (a fully padded row keeps its diagonal).
        mask = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()[None, None].expand(B, 1, T, T)
        if attention_mask is not None:
            mask = mask & attention_mask[:, None, None, :].bool()
            mask = mask | torch.eye(T, dtype=torch.bool, device=x.device)
        kwargs_fp = fixed_point_kwargs(self.config, self.training, overrides)
        z, stats = fixed_point(self.block, torch.zeros_like(x), args=(x, mask), compact=True, **kwargs_fp)
        out = DEQLMModelOutput(last_hidden_state=self.norm(z), fp_stats=stats)
        if self.config.output_hidden_states if output_hidden_states is None else output_hidden_states:
            out.hidden_states = (x, out.last_hidden_state)
        if self.config.output_attentions if output_attentions is None else output_attentions:
            out.attentions = (self.block.attn.weights(self.block.norm1(z), mask),)
        return out


class DEQLMForCausalLM(GenerateKnobsMixin, DEQLMPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: DEQLMConfig):
        super().__init__(config)
        self.model = DEQLMModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    @can_return_tuple
    def forward(
        self,
        input_ids: Optional[torch.LongTensor] = None,
        attention_mask: Optional[torch.Tensor] = None,
        position_ids: Optional[torch.LongTensor] = None,
        inputs_embeds: Optional[torch.FloatTensor] = None,
        labels: Optional[torch.LongTensor] = None,
        fp_max_iter: Optional[int] = None,
        fp_tol: Optional[float] = None,
        fp_overrides: Optional[dict] = None,
        output_hidden_states: Optional[bool] = None,
        output_attentions: Optional[bool] = None,
        **kwargs,
    ) -> DEQLMCausalLMOutput:
        """Per-call knobs as in ``DEQLMModel.forward``; other ``kwargs`` reach the loss (``num_items_in_batch``,
        ``shift_labels``, ``ignore_index``)."""
        overrides = call_knobs(self.config, kwargs, type(self).__name__, fp_overrides, fp_max_iter, fp_tol)
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         inputs_embeds=inputs_embeds, fp_overrides=overrides,
                         output_hidden_states=output_hidden_states, output_attentions=output_attentions)
        logits = self.lm_head(out.last_hidden_state)
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        return DEQLMCausalLMOutput(loss=loss, logits=logits, fp_stats=out.fp_stats, hidden_states=out.hidden_states,
                                   attentions=out.attentions)

    def prepare_inputs_for_generation(self, input_ids, attention_mask=None, fp_max_iter=None, fp_tol=None,
                                      fp_overrides=None, **kwargs):
        # No KV cache: a fixed point is recomputed over the whole prefix at every step (positions from the mask).
        return {"input_ids": input_ids, "attention_mask": attention_mask, "fp_max_iter": fp_max_iter,
                "fp_tol": fp_tol, "fp_overrides": fp_overrides}

    def generate(self, *args, **kwargs):
        """``GenerationMixin.generate``; assisted decoding is refused with the reason (it checks the candidate tokens
        against a KV cache it crops back, and DEQ-LM keeps none)."""
        if kwargs.get("assistant_model") is not None or kwargs.get("prompt_lookup_num_tokens"):
            raise ValueError("DEQ-LM cannot do assisted decoding: it keeps no KV cache (each step solves the fixed "
                             "point over the whole prefix), and assisted decoding crops the cache back to the "
                             "accepted candidate tokens. Generate without assistant_model / prompt_lookup_num_tokens.")
        return super().generate(*args, **kwargs)


__all__ = ["DEQLMForCausalLM", "DEQLMModel", "DEQLMPreTrainedModel"]
