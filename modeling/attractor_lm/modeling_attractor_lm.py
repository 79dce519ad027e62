"""Attractor LM: a causal transformer backbone ``T_b`` turns the tied embeddings into a proposal ``y0``; a weight-tied
attractor ``T_a`` refines it, ``y_{t+1} = T_a(y_t, y0)``, to its fixed point ``y*`` (found by ``fixed_point``);
``RMSNorm(y*)`` is decoded with the tied embedding.

With ``u = y + y0`` (``injection="add"``) the attractor map is ``T_a(y, y0) = Blocks(u) - y = y0 + Delta(u)``, where
``Blocks`` are pre-norm layers whose sublayer outputs are scaled by per-channel gates ``gamma`` (``Delta`` is the sum
of those scaled outputs). Small gates keep ``T_a`` a contraction, so the solve converges from ``y0``.

Generation with a KV cache: the backbone layers use the cache as usual; the attractor layers iterate against the
cached keys/values of earlier tokens (read, never written, during the solve) and write the keys/values of the new
tokens once, at their fixed point. With a ``StaticCache`` (``generate(..., cache_implementation="static")``, the cache
of compiled generation) the attractor reads the whole preallocated buffer, with the iterate's keys/values placed at
the new tokens' slots out of place, under the buffer-wide mask generate prepares.
"""

from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.activations import ACT2FN
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer, StaticLayer
from transformers.modeling_outputs import ModelOutput
from transformers.models.llama.modeling_llama import (
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
    eager_attention_forward,
)
from transformers.utils import can_return_tuple

from .configuration_attractor_lm import AttractorConfig
from .fp_backward import fixed_point
from .fp_compat import (
    CACHE_NAME,
    attention_function,
    cache_field,
    create_causal_mask,
    init,
    pop_cache,
)
from .fp_engines import EngineGuardMixin
from .fp_registry import check_number
from .fp_settings import GenerateKnobsMixin, call_knobs, call_max_iter, fixed_point_kwargs, host_reads
from .fp_solvers import solve  # noqa: F401  (see vendor.direct_import_problems)
from .fp_speculative import SpeculativeGenerationMixin
from .fp_stats import FixedPointStats


@dataclass
@cache_field
class AttractorModelOutput(ModelOutput):
    """``last_hidden_state``: ``RMSNorm(y*)`` ``(B, T, D)`` (``RMSNorm(y0)`` for a T=0 readout); ``proposal``: the
    backbone's ``y0``; ``attractor_state``: ``y*``; ``past_key_values``: the cache; ``fp_stats``: per-token solver
    statistics (``nstep``, ``residual``, ``converged`` shaped ``(B, T)``). ``attractor_state`` and ``fp_stats`` are
    ``None`` for a T=0 readout. ``hidden_states`` (``output_hidden_states``): the embeddings, every backbone layer's
    output and every attractor layer's output in one evaluation at the fixed point (the last one replaced by
    ``last_hidden_state``); ``attentions`` (``output_attentions``, with ``attn_implementation="eager"``): the
    layers' attention weights, the attractor's at the fixed point. Both are recorded without gradient through the
    attractor."""

    last_hidden_state: Optional[torch.FloatTensor] = None
    proposal: Optional[torch.FloatTensor] = None
    attractor_state: Optional[torch.FloatTensor] = None
    past_key_values: Optional[Cache] = None
    fp_stats: Optional[FixedPointStats] = None
    hidden_states: Optional[tuple] = None
    attentions: Optional[tuple] = None


@dataclass
@cache_field
class AttractorCausalLMOutput(ModelOutput):
    loss: Optional[torch.FloatTensor] = None
    logits: Optional[torch.FloatTensor] = None
    past_key_values: Optional[Cache] = None
    fp_stats: Optional[FixedPointStats] = None
    hidden_states: Optional[tuple] = None
    attentions: Optional[tuple] = None


class AttractorAttention(nn.Module):
    """Causal self-attention with QK-norm and rotary embeddings (transformers' attention functions).

    ``past_key_values`` (a ``Cache``) is updated with this call's keys/values; ``past_kv`` (a ``(keys, values)``
    pair read from a cache) is only prepended, which is how the attractor iterates without writing. A ``(keys, values,
    start)`` triple is a static cache's whole buffer: this call's keys/values are placed at slots ``start, start + 1,
    ...`` of a copy (``start`` a 0-dim tensor, as ``StaticLayer.update`` places them in place).
    """

    def __init__(self, config: AttractorConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        self.is_causal = True
        D, kv = config.hidden_size, config.num_key_value_heads * self.head_dim
        self.q_proj = nn.Linear(D, config.num_attention_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(D, kv, bias=False)
        self.v_proj = nn.Linear(D, kv, bias=False)
        self.o_proj = nn.Linear(config.num_attention_heads * self.head_dim, D, bias=False)
        self.q_norm = nn.RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = nn.RMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def forward(self, hidden_states, position_embeddings, attention_mask, past_key_values=None, past_kv=None,
                weights: Optional[list] = None):
        """``weights``: a list to append this call's attention weights to (``None`` unless the attention
        implementation returns them: ``attn_implementation="eager"``, as in transformers' models)."""
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        q = self.q_norm(self.q_proj(hidden_states).view(hidden_shape)).transpose(1, 2)  # (B, nh, T, hd)
        k = self.k_norm(self.k_proj(hidden_states).view(hidden_shape)).transpose(1, 2)  # (B, nkv, T, hd)
        v = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        cos, sin = position_embeddings
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        if v.dtype != k.dtype:  # autocast: the normed keys are float32, the values not; a static cache holds one dtype
            v = v.to(k.dtype)
        if past_key_values is not None:
            k, v = past_key_values.update(k, v, self.layer_idx)
        elif past_kv is not None and len(past_kv) == 3:  # static buffer (B, nkv, max_cache_len, hd), not written
            slots = torch.arange(k.shape[-2], device=k.device) + past_kv[2]
            k, v = past_kv[0].index_copy(2, slots, k), past_kv[1].index_copy(2, slots, v)
        elif past_kv is not None:
            k, v = torch.cat([past_kv[0], k], dim=-2), torch.cat([past_kv[1], v], dim=-2)
        attention = attention_function(self.config._attn_implementation, eager_attention_forward)
        out, attn_weights = attention(self, q, k, v, attention_mask, dropout=0.0, scaling=self.scaling)
        if weights is not None:
            weights.append(attn_weights)
        return self.o_proj(out.reshape(*input_shape, -1).contiguous())


class AttractorMLP(nn.Module):
    """ReLU² MLP."""

    def __init__(self, config: AttractorConfig):
        super().__init__()
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.act_fn = ACT2FN["relu2"]

    def forward(self, x):
        return self.down_proj(self.act_fn(self.up_proj(x)))


class AttractorConcatInjection(nn.Linear):
    """``injection="concat"``: ``u = W [y; y0]``, with ``W`` initialised to ``[I, I]`` (so it starts as ``y + y0``)."""

    def __init__(self, config: AttractorConfig):
        super().__init__(2 * config.hidden_size, config.hidden_size, bias=False)


class AttractorDecoderLayer(nn.Module):
    """Pre-norm layer ``h + g_a * Attn(norm(h))`` then ``h + g_m * MLP(norm(h))``.

    Backbone layers have no gates (``g = 1``). Attractor layers have per-channel gates
    ``g = layer_scale_max * sigmoid(raw)``, initialised to ``layer_scale_init``, which bound how far one attractor
    step can move the state.
    """

    def __init__(self, config: AttractorConfig, layer_idx: int, gated: bool):
        super().__init__()
        self.input_layernorm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.self_attn = AttractorAttention(config, layer_idx)
        self.post_attention_layernorm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = AttractorMLP(config)
        self.gamma_max = config.layer_scale_max
        if gated:
            self.raw_gamma_attn = nn.Parameter(torch.empty(config.hidden_size))
            self.raw_gamma_mlp = nn.Parameter(torch.empty(config.hidden_size))
        else:
            self.register_parameter("raw_gamma_attn", None)
            self.register_parameter("raw_gamma_mlp", None)

    def _gate(self, raw, x):
        return x if raw is None else x * (self.gamma_max * torch.sigmoid(raw))

    def forward(self, h, position_embeddings, attention_mask, past_key_values=None, past_kv=None, weights=None):
        a = self.self_attn(self.input_layernorm(h), position_embeddings, attention_mask, past_key_values, past_kv,
                           weights)
        h = h + self._gate(self.raw_gamma_attn, a)
        return h + self._gate(self.raw_gamma_mlp, self.mlp(self.post_attention_layernorm(h)))


class AttractorPreTrainedModel(EngineGuardMixin, PreTrainedModel):
    # Why vLLM's generic Transformers backend cannot run it (fp_engines): refused with this reason.
    _engine_refusal = ("its attractor layers iterate each new token to a fixed point against the cached keys and "
                       "values of the earlier tokens and write the new token's keys once, at the fixed point; such a"
                       " backend calls each attention module once per token and writes its paged cache at every call")
    config_class = AttractorConfig
    base_model_prefix = "model"
    _no_split_modules = ["AttractorDecoderLayer"]
    _skip_keys_device_placement = ["past_key_values", "cache"]
    _supports_sdpa = True

    @torch.no_grad()
    def _init_weights(self, module):
        super()._init_weights(module)
        if isinstance(module, AttractorDecoderLayer) and module.raw_gamma_attn is not None:
            p = self.config.layer_scale_init / self.config.layer_scale_max
            raw = torch.logit(torch.tensor(p)).item()  # sigmoid(raw) * gamma_max == layer_scale_init
            init.constant_(module.raw_gamma_attn, raw)
            init.constant_(module.raw_gamma_mlp, raw)
        elif isinstance(module, AttractorConcatInjection):
            init.copy_(module.weight, torch.eye(module.out_features).repeat(1, 2))


class AttractorModel(AttractorPreTrainedModel):
    """Embedding -> backbone (proposal ``y0``) -> attractor fixed point ``y*`` -> final RMSNorm."""

    def __init__(self, config: AttractorConfig):
        super().__init__(config)
        Lb = config.num_backbone_layers
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.backbone = nn.ModuleList([AttractorDecoderLayer(config, i, gated=False) for i in range(Lb)])
        self.attractor = nn.ModuleList(
            [AttractorDecoderLayer(config, Lb + i, gated=True) for i in range(config.num_attractor_layers)]
        )
        self.inject_proj = AttractorConcatInjection(config) if config.injection == "concat" else None
        self.norm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = LlamaRotaryEmbedding(config=config)
        self.post_init()

    def inject(self, y, y0):
        """The attractor layers' input ``u`` from the iterate ``y`` and the proposal ``y0`` (``config.injection``)."""
        inj = self.config.injection
        if inj == "add":
            return y + y0
        if inj == "initial_only":
            return y
        return self.inject_proj(torch.cat([y, y0], dim=-1))

    def attractor_map(self, y, y0, cos, sin, mask, *past, cache=None, record=None):
        """``T_a(y, y0)``. ``past``: per attractor layer, cached keys then values of earlier tokens (read only; with a
        static cache followed by each layer's 0-dim start slot, see ``AttractorAttention``);
        ``cache``: a ``Cache`` to write this call's keys/values into (used once, at the fixed point); ``record``:
        ``{"hidden_states": [...], "attentions": [...]}`` lists to append the layers' outputs and weights to."""
        n = len(self.attractor)
        h = self.inject(y, y0)
        for i, layer in enumerate(self.attractor):
            past_kv = past[i::n] if past else None  # (keys, values) or (keys, values, start) of layer i
            h = layer(h, (cos, sin), mask, past_key_values=cache, past_kv=past_kv,
                      weights=None if record is None else record["attentions"])
            if record is not None:
                record["hidden_states"].append(h)
        return h - y

    @can_return_tuple
    def forward(
        self,
        input_ids: Optional[torch.LongTensor] = None,
        attention_mask: Optional[torch.Tensor] = None,
        position_ids: Optional[torch.LongTensor] = None,
        past_key_values: Optional[Cache] = None,
        inputs_embeds: Optional[torch.FloatTensor] = None,
        use_cache: Optional[bool] = None,
        fp_max_iter: Optional[int] = None,
        fp_tol: Optional[float] = None,
        fp_overrides: Optional[dict] = None,
        readout_iters: Optional[int] = None,
        unrolled_iters: Optional[int] = None,
        output_hidden_states: Optional[bool] = None,
        output_attentions: Optional[bool] = None,
        **kwargs,
    ) -> AttractorModelOutput:
        """Per-call knobs: ``fp_max_iter``, ``fp_tol`` and any other ``fp_*`` setting as keywords, or
        ``fp_overrides={...}`` (``call_knobs``); ``readout_iters`` (a per-call one wins over a per-call
        ``fp_max_iter``, which wins over ``config.readout_iters``)."""
        past_key_values = pop_cache(past_key_values, kwargs)
        overrides = call_knobs(self.config, kwargs, type(self).__name__, fp_overrides, fp_max_iter, fp_tol)
        if unrolled_iters is not None:
            check_number(unrolled_iters, "unrolled_iters", low=1, integer=True)
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("Pass exactly one of input_ids and inputs_embeds.")
        if readout_iters is None and "fp_max_iter" not in overrides:
            readout_iters = self.config.readout_iters
        if readout_iters is not None:
            check_number(readout_iters, "readout_iters", low=0, integer=True)
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        if use_cache is None:  # by default a cache is built only where no gradient is recorded (generation, eval)
            use_cache = self.config.use_cache and not (self.training and torch.is_grad_enabled())
        if use_cache and past_key_values is None:
            past_key_values = DynamicCache(config=self.config)
        if not use_cache:
            past_key_values = None
        self._check_cache(past_key_values)
        B, T, _ = inputs_embeds.shape
        past_len = past_key_values.get_seq_length() if past_key_values is not None else 0
        if position_ids is None:  # a static cache's length is a tensor: added, never read on the host
            position_ids = torch.arange(T, device=inputs_embeds.device) + past_len
        position_ids = position_ids.expand(B, T)
        if isinstance(attention_mask, dict):  # generate's prepared masks (static cache): one per attention type
            mask = attention_mask["full_attention"]
        else:
            mask = create_causal_mask(config=self.config, inputs_embeds=inputs_embeds,
                                      attention_mask=attention_mask, past_key_values=past_key_values,
                                      position_ids=position_ids, host_reads=host_reads(self.config, overrides))
        cos, sin = self.rotary_emb(inputs_embeds, position_ids)  # (B, T, hd) each

        want_hidden = self.config.output_hidden_states if output_hidden_states is None else output_hidden_states
        want_attn = self.config.output_attentions if output_attentions is None else output_attentions
        record = {"hidden_states": [inputs_embeds], "attentions": []} if want_hidden or want_attn else None

        # Backbone T_b: the proposal y0 (the cache is read and written as in any causal LM).
        h = inputs_embeds
        for layer in self.backbone:
            h = layer(h, (cos, sin), mask, past_key_values=past_key_values,
                      weights=record["attentions"] if want_attn else None)
            if record is not None:
                record["hidden_states"].append(h)
        y0 = h
        if readout_iters == 0:  # T=0 readout: decode the proposal
            return self._output(record, want_hidden, want_attn, last_hidden_state=self.norm(y0), proposal=y0,
                                **{CACHE_NAME: past_key_values})

        # Attractor T_a: per-token fixed point from y0, iterating against the attractor's cached keys/values.
        past = self._attractor_past(past_key_values, past_len, T)
        if unrolled_iters is not None:  # exactly k plain steps, no convergence test: nothing read on the host
            y_star, stats = y0, None
            for _ in range(unrolled_iters):
                y_star = self.attractor_map(y_star, y0, cos, sin, mask, *past)
        else:
            y_star, stats = self._solve(y0, (y0, cos, sin, mask, *past), readout_iters, overrides)
        if past_key_values is not None or record is not None:
            # One evaluation at the fixed point: writes the attractor's keys/values once, records the outputs.
            with torch.no_grad():
                self.attractor_map(y_star.detach(), y0.detach(), cos, sin, mask, cache=past_key_values,
                                   record=record)
        return self._output(record, want_hidden, want_attn, last_hidden_state=self.norm(y_star), proposal=y0,
                            attractor_state=y_star, fp_stats=stats, **{CACHE_NAME: past_key_values})

    def _solve(self, y0, args: tuple, readout_iters: Optional[int], fp_overrides: Optional[dict]):
        """``fixed_point`` of the attractor map from ``y0`` with the config's ``fp_*`` settings (and this call's)."""
        fp_kwargs = fixed_point_kwargs(self.config, self.training, fp_overrides)
        if readout_iters is not None:
            fp_kwargs["max_iter"] = readout_iters
            fp_kwargs["min_iter"] = min(fp_kwargs["min_iter"], readout_iters)
        if fp_kwargs["backward"] == "ift" and self.config.adjoint_clip is not None:
            fp_kwargs["backward_kwargs"]["clip"] = self.config.adjoint_clip
        return fixed_point(self.attractor_map, y0, args=args, batch_dims=2, compact=True, **fp_kwargs)

    def _check_cache(self, cache: Optional[Cache]) -> None:
        """Refuse cache layers the attractor cannot read (a static sliding window...) with a clear error."""
        if cache is None:
            return
        for layer in cache.layers:
            if not isinstance(layer, DynamicLayer) and type(layer) is not StaticLayer:
                raise ValueError(f"Attractor LM supports a DynamicCache or a StaticCache (cache layers DynamicLayer "
                                 f"or StaticLayer); got {type(cache).__name__} with a {type(layer).__name__}: the "
                                 "attractor reads the earlier tokens' keys/values as these layers hold them.")
            if type(layer) is StaticLayer and not hasattr(layer, "cumulative_length"):  # placed by cache_position
                raise ValueError("Attractor LM needs a StaticLayer that tracks its length (cumulative_length: "
                                 "transformers 5.23 has it, 4.57 does not) for a StaticCache; use the default cache "
                                 "(generate(..., cache_implementation=None)) with this transformers release.")

    def _attractor_past(self, cache: Optional[Cache], past_len, T: int) -> tuple:
        """The earlier tokens' attractor keys/values for the solve: ``()`` without a cache or before the first token;
        a dynamic cache's keys then values (exactly ``past_len`` long); a static cache's whole buffers, then each
        layer's start slot (a 0-dim tensor: no host sync, so a compiled decoding step does not break here)."""
        if cache is None or (not isinstance(cache.layers[0], StaticLayer) and past_len == 0):
            return ()
        layers = [cache.layers[layer.self_attn.layer_idx] for layer in self.attractor]
        lagging = ValueError("the cache has no attractor keys/values for the earlier tokens (they were computed with "
                             "readout_iters=0); generate with the same readout_iters throughout.")
        if isinstance(layers[0], StaticLayer):
            # The backbone wrote this call's T tokens already; the attractor's layers must hold the tokens before.
            written = int(cache.layers[0].get_seq_length()) if not torch.compiler.is_compiling() else None
            if written is not None and any(int(c.get_seq_length()) + T != written for c in layers):
                raise lagging
            for c in layers:
                if not c.is_initialized:  # the first tokens: zero buffers shaped like the backbone's (just written)
                    empty = cache.layers[0].keys[:, :, :0]  # (B, nkv, 0, hd), the keys' dtype and device
                    c.lazy_initialization(empty, empty)
            return (tuple(c.keys for c in layers) + tuple(c.values for c in layers)
                    + tuple(c.cumulative_length for c in layers))
        if not all(c.is_initialized and c.get_seq_length() == past_len for c in layers):
            raise lagging
        return tuple(c.keys for c in layers) + tuple(c.values for c in layers)

    @staticmethod
    def _output(record, want_hidden, want_attn, **fields) -> AttractorModelOutput:
        out = AttractorModelOutput(**fields)
        if want_hidden:
            out.hidden_states = (*record["hidden_states"][:-1], out.last_hidden_state)
        if want_attn:
            out.attentions = tuple(record["attentions"])
        return out


class AttractorForCausalLM(GenerateKnobsMixin, SpeculativeGenerationMixin, AttractorPreTrainedModel,
                           GenerationMixin):
    """The Attractor LM with its tied head. ``generate(..., draft_depth=d)`` decodes self-speculatively
    (``fp_speculative``): drafts from a solve capped at ``d`` iterations (``readout_iters=d``), verified at the call's
    depth (its ``readout_iters``, else its solver cap)."""

    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
    _draft_keywords = ("readout_iters",)

    def __init__(self, config: AttractorConfig):
        super().__init__(config)
        self.model = AttractorModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def _full_depth(self, model_kwargs) -> int:
        """The iterations of the call's solve, resolved as ``forward`` does: its ``readout_iters``, else its
        ``fp_max_iter`` (keyword or ``fp_overrides``), else ``config.readout_iters``, else the config's cap."""
        if model_kwargs.get("unrolled_iters") is not None:
            raise ValueError("draft_depth cannot be combined with unrolled_iters (a fixed count of plain steps that "
                             "replaces the capped solve the draft is); use readout_iters for the full depth.")
        readout = model_kwargs.get("readout_iters")
        if readout is None and "fp_max_iter" not in {**(model_kwargs.get("fp_overrides") or {}), **model_kwargs}:
            readout = self.config.readout_iters
        return call_max_iter(self.config, model_kwargs, "generate") if readout is None else readout

    @can_return_tuple
    def forward(
        self,
        input_ids: Optional[torch.LongTensor] = None,
        attention_mask: Optional[torch.Tensor] = None,
        position_ids: Optional[torch.LongTensor] = None,
        past_key_values: Optional[Cache] = None,
        inputs_embeds: Optional[torch.FloatTensor] = None,
        labels: Optional[torch.LongTensor] = None,
        use_cache: Optional[bool] = None,
        logits_to_keep: int = 0,
        fp_max_iter: Optional[int] = None,
        fp_tol: Optional[float] = None,
        fp_overrides: Optional[dict] = None,
        readout_iters: Optional[int] = None,
        unrolled_iters: Optional[int] = None,
        output_hidden_states: Optional[bool] = None,
        output_attentions: Optional[bool] = None,
        **kwargs,
    ) -> AttractorCausalLMOutput:
        """``fp_max_iter=32`` (any ``fp_*`` setting as a keyword, or ``fp_overrides={...}``), ``readout_iters``
        (0: decode the backbone proposal, ``k``: at most ``k`` solver iterations) and ``unrolled_iters`` (``k``:
        exactly ``k`` plain iterations ``y <- T_a(y, y0)`` from ``y0`` instead of the solve, with no convergence test
        and no ``fp_stats``: a compiled decoding step then traces as one graph; ``readout_iters=0`` still wins) change
        this call only; ``generate`` passes them to every step. Other ``kwargs`` reach the loss
        (``num_items_in_batch``, ``shift_labels``, ``ignore_index``)."""
        past_key_values = pop_cache(past_key_values, kwargs)
        overrides = call_knobs(self.config, kwargs, type(self).__name__, fp_overrides, fp_max_iter, fp_tol)
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         past_key_values=past_key_values, inputs_embeds=inputs_embeds, use_cache=use_cache,
                         fp_overrides=overrides, readout_iters=readout_iters, unrolled_iters=unrolled_iters,
                         output_hidden_states=output_hidden_states, output_attentions=output_attentions)
        hidden = out.last_hidden_state
        if logits_to_keep:
            hidden = hidden[:, -logits_to_keep:]
        logits = self.lm_head(hidden)
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        return AttractorCausalLMOutput(loss=loss, logits=logits, **{CACHE_NAME: getattr(out, CACHE_NAME)},
                                       fp_stats=out.fp_stats, hidden_states=out.hidden_states,
                                       attentions=out.attentions)


__all__ = ["AttractorForCausalLM", "AttractorModel", "AttractorPreTrainedModel"]
