"""Ouro: a looped language model. One stack of ``num_hidden_layers`` decoder layers is applied ``total_ut_steps``
times (weights tied across loops); the final norm follows every loop, and an early-exit gate scores every loop.

Semantics and state-dict names follow the released ``ByteDance/Ouro-*`` checkpoints (their remote code does not run
on transformers >= 4.56):

* layer ("sandwich" norms inside the residual branches)::

      h = h + input_layernorm_2(self_attn(input_layernorm(h)))
      h = h + post_attention_layernorm_2(mlp(post_attention_layernorm(h)))

* loop: ``h_0 = embed(x)``, ``h_t = norm(layers(h_{t-1}))`` for ``t = 1..T``; rotary embeddings and the mask are
  computed once and shared by all loops;
* exit distribution per token: ``lambda_t = sigmoid(early_exit_gate(h_t))``, ``p_t = lambda_t * prod_{j<t}(1 -
  lambda_j)`` for ``t < T`` and ``p_T = prod_{j<T}(1 - lambda_j)``;
* KV cache: loop ``t`` of layer ``l`` uses cache slot ``t * num_hidden_layers + l`` (``L * T`` slots), so loop ``t`` of
  a new token attends to loop-``t`` keys and values of the earlier tokens. A transformers ``DynamicCache`` is grown to
  that many slots, which keeps left-padded batched generation exact (the upstream cache's mask sizes were wrong); a
  ``StaticCache`` (``generate(..., cache_implementation="static")``, the cache of compiled generation) is grown to
  that many static slots of its length, and generates the same tokens.

Differences from the upstream code: the loop count is read per call (``total_ut_steps=``) instead of being frozen at
``__init__``; ``OuroModel`` returns an ``OuroModelOutput`` instead of a 3-tuple; a checkpoint with missing weights is
an error instead of a warning and a random initialization.
"""

import copy
import warnings
from dataclasses import dataclass
from functools import partial
from typing import Callable, Optional

import torch
from torch import nn
from torch.nn import functional as F
from transformers import GenerationMixin, PreTrainedModel
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer, StaticLayer
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import ModelOutput
from transformers.models.llama.modeling_llama import (
    LlamaAttention,
    LlamaMLP,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
    repeat_kv,
)
from transformers.utils import can_return_tuple

from .configuration_ouro import EXIT_MODES, OuroConfig
from .fp_compat import (
    CACHE_NAME,
    cache_field,
    capture_outputs,
    create_causal_mask,
    pop_cache,
    require_dynamic_cache,
)
from .fp_engines import EngineGuardMixin
from .fp_registry import check_choice, check_number, reject_prefixed_keywords
from .fp_speculative import Speculation, generate_speculative, rollback


@dataclass
@cache_field
class OuroModelOutput(ModelOutput):
    """
    Attributes:
        last_hidden_state: state after the last loop (normalized), ``(B, S, D)``.
        past_key_values: the cache (``L * T`` slots) when ``use_cache``.
        loop_hidden_states: the state after every loop, a tuple of ``T`` tensors ``(B, S, D)``.
        gate_logits: early-exit gate logits of every loop, ``(B, S, T)``.
        loop_change: relative change of each sequence's state from one loop to the next, ``(B, T - 1)`` (float32 at
            least): ``||h_t - h_{t-1}|| / ||h_{t-1}||`` over the sequence's tokens of this call (padding excluded).
            A model that extrapolates in depth settles (the change shrinks towards 0); see ``config.loop_guard_tol``.
        loop_attention_mask, loop_position_ids: the 2-D attention mask (None when not given as a tensor) and the
            positions of this call: ``model.loop_function(outputs)`` is one loop of this call as a function of the
            state, for regularizers such as STARS' Jacobian penalty (outputs hold tensors only, so they pickle, gather
            and convert with ``to_tuple``).
        exit_loop: ``(B, S)`` 0-based loop at which each token stopped (``exit_mode="skip"``; the head also fills it
            with the decoded loop of the threshold / tolerance rule in ``"select"`` mode).
        flops: ``(B, S)`` float32, matrix-multiply FLOPs spent on each token in this call (multiply-add = 2): q/k/v/o
            projections, attention products over every key position of the call, MLP, exit gate (and, from the
            head, ``lm_head``). Norms, RoPE and the padding of gathered queries are not counted.
    """

    last_hidden_state: Optional[torch.FloatTensor] = None
    past_key_values: Optional[Cache] = None
    loop_hidden_states: Optional[tuple] = None
    gate_logits: Optional[torch.FloatTensor] = None
    loop_attention_mask: Optional[torch.Tensor] = None
    loop_position_ids: Optional[torch.LongTensor] = None
    hidden_states: Optional[tuple] = None
    attentions: Optional[tuple] = None
    loop_change: Optional[torch.FloatTensor] = None
    exit_loop: Optional[torch.LongTensor] = None
    flops: Optional[torch.FloatTensor] = None


@dataclass
@cache_field
class OuroCausalLMOutput(ModelOutput):
    """
    Attributes:
        loss: training loss (``config.exit_loss``) when ``labels`` are given.
        logits: decoded logits: the exit-weighted mixture when training, else the loop chosen by the exit rule.
        past_key_values, loop_hidden_states, gate_logits, loop_attention_mask, loop_position_ids, loop_change: as in
            ``OuroModelOutput``.
        exit_pdf: exit distribution over loops per token, ``(B, S, T)`` (at least float32).
        loop_logits: logits of every loop (tuple of ``T``) when ``output_loop_logits=True``.
        exit_loop, flops: as in ``OuroModelOutput``; ``flops`` includes the ``lm_head`` products.
    """

    loss: Optional[torch.FloatTensor] = None
    logits: Optional[torch.FloatTensor] = None
    past_key_values: Optional[Cache] = None
    loop_hidden_states: Optional[tuple] = None
    gate_logits: Optional[torch.FloatTensor] = None
    exit_pdf: Optional[torch.FloatTensor] = None
    loop_logits: Optional[tuple] = None
    loop_attention_mask: Optional[torch.Tensor] = None
    loop_position_ids: Optional[torch.LongTensor] = None
    hidden_states: Optional[tuple] = None
    attentions: Optional[tuple] = None
    loop_change: Optional[torch.FloatTensor] = None
    exit_loop: Optional[torch.LongTensor] = None
    flops: Optional[torch.FloatTensor] = None


class LoopDepthWarning(UserWarning):
    """A call ran more loops than the model was trained with, and its state is not settling."""


# loop_change stacks the loop states (one copy of every loop) when they hold at most this many elements in all
# (decoding: one batched norm instead of a norm per loop pair); larger states go pair by pair, without the copy.
LOOP_CHANGE_STACK_LIMIT = 1 << 22


@torch.no_grad()
def loop_change(states, attention_mask=None) -> Optional[torch.Tensor]:
    """``(B, T - 1)`` relative change of each sequence's state between consecutive loops over its valid tokens (the
    last ``S`` columns of a 2-d ``attention_mask``); None for one loop. A diagnostic: no graph; all loops in one
    stacked copy when it is small (``LOOP_CHANGE_STACK_LIMIT`` elements), else one pair of loop states at a time.
    Trailing loops that repeat the same state object (those ``exit_mode="skip"`` ran on no token) change nothing: 0,
    not computed."""
    if len(states) < 2:
        return None
    ran = len(states)
    while ran > 1 and states[ran - 1] is states[ran - 2]:
        ran -= 1
    dtype = torch.promote_types(states[0].dtype, torch.float32)
    if ran == 1:
        return torch.zeros(states[0].shape[0], len(states) - 1, dtype=dtype, device=states[0].device)
    keep = None
    if isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 2:  # not generate's prepared mask dict
        keep = attention_mask[:, -states[0].shape[1]:, None].to(dtype)
    tiny = torch.finfo(dtype).tiny

    def valid(x):  # in at least float32, padding zeroed
        return x.to(dtype) if keep is None else x.to(dtype) * keep

    if ran * states[0].numel() <= LOOP_CHANGE_STACK_LIMIT:
        x = valid(torch.stack(states[:ran])).flatten(2)  # (ran, B, S * D)
        norm = partial(torch.linalg.vector_norm, dim=-1)
        change = (norm(x[1:] - x[:-1]) / norm(x[:-1]).clamp_min(tiny)).T
    else:
        def norm(x):
            return torch.linalg.vector_norm(x.flatten(1), dim=-1)

        change = torch.stack([norm(valid(b) - valid(a)) / norm(valid(a)).clamp_min(tiny)
                              for a, b in zip(states[:ran - 1], states[1:ran])], dim=1)
    return F.pad(change, (0, len(states) - ran))


def exit_distribution(gate_logits: torch.Tensor) -> torch.Tensor:
    """Exit pdf ``(..., T)`` from gate logits ``(..., T)``: ``p_t = lambda_t * S_{t-1}``, ``p_T = S_{T-1}``."""
    lam = torch.sigmoid(gate_logits.to(torch.promote_types(gate_logits.dtype, torch.float32)))
    survival = torch.cumprod(1.0 - lam, dim=-1)  # S_t
    before = torch.cat([torch.ones_like(survival[..., :1]), survival[..., :-1]], dim=-1)  # S_{t-1}
    return torch.cat([lam[..., :-1] * before[..., :-1], before[..., -1:]], dim=-1)


def adaptive_gate_loss(gate_logits, loop_losses, valid=None, k: float = 50.0, gamma: float = 0.005) -> torch.Tensor:
    """Ouro's stage-II gate loss (LM frozen, gate only), from the per-token LM losses of every loop.

    With ``L^(t)`` the loss of stopping at loop ``t`` (``loop_losses[..., t - 1]``, 1-based ``t``), the improvement of
    loop ``t`` is ``I^(t) = max(0, L^(t-1) - L^(t))`` and the target continuation probability ``w^(t) = sigmoid(k *
    (I^(t) - gamma))``: a loop that still improved the loss by more than ``gamma`` says "continue". The gate's exit
    probability at loop ``t``, ``lambda^(t) = sigmoid(gate_logits[..., t - 1])``, is trained by ``BCE(1 - lambda^(t),
    w^(t))``, averaged over ``t = 2..T`` and the ``valid`` tokens. The losses are targets, not differentiated.

    Args:
        gate_logits: ``(..., T)`` gate logits of the loops.
        loop_losses: ``(..., T)`` per-token LM loss of decoding each loop (e.g. cross-entropy of the next token).
        valid: ``(...)`` bool, the tokens that count (default all).
        k, gamma: sharpness and improvement threshold of the target (the paper's, as reimplemented: 50 and 0.005).
    """
    if gate_logits.shape != loop_losses.shape or gate_logits.shape[-1] < 2:
        raise ValueError(f"gate_logits {tuple(gate_logits.shape)} and loop_losses {tuple(loop_losses.shape)} must "
                         "have the same shape (..., T) with T >= 2 loops.")
    losses = loop_losses.detach().to(gate_logits.dtype)
    improvement = (losses[..., :-1] - losses[..., 1:]).clamp_min(0.0)  # I^(t), t = 2..T
    target = torch.sigmoid(k * (improvement - gamma))
    # BCE(1 - lambda, w) with 1 - lambda = sigmoid(-g), in the logits form (stable for saturated gates)
    bce = F.binary_cross_entropy_with_logits(-gate_logits[..., 1:], target, reduction="none").mean(-1)
    if valid is None:
        return bce.mean()
    valid = valid.to(bce.device)
    return (bce * valid).sum() / valid.sum().clamp_min(1)


def _at_least_float32(x: torch.Tensor) -> torch.Tensor:
    """``x`` in at least float32; itself, with no call, when it is (the exit rules run every loop)."""
    return x if x.dtype in (torch.float32, torch.float64) else x.to(torch.promote_types(x.dtype, torch.float32))


class ExitRule:
    """Ouro's exit rules, applied loop by loop: ``rule(gate, previous, current)`` after loop ``t`` (0-based) gives the
    ``(B, S)`` tokens whose rule fires there (None when no rule is set), from the loop's gate logits ``(B, S, 1)``
    and the states of loops ``t - 1`` (None at ``t = 0``) and ``t``:

    * ``threshold``: the cumulative exit probability ``sum_{j<=t} p_j`` reaches it (Ouro's Q-exit; ``p_j`` as in
      ``exit_distribution``, accumulated in the same order);
    * ``tol``: the relative state change ``||h_t - h_{t-1}|| / ||h_{t-1}||`` per token is below it.

    Only meaningful before the last loop (where every token exits)."""

    def __init__(self, threshold=None, tol=None):
        self.threshold, self.tol, self.cdf, self.survival = threshold, tol, None, None

    def __call__(self, gate, previous, current) -> Optional[torch.Tensor]:
        fire = None
        if self.threshold is not None:
            lam = torch.sigmoid(_at_least_float32(gate[..., 0]))
            p = lam if self.survival is None else lam * self.survival  # p_t = lambda_t * S_{t-1}
            self.cdf = p if self.cdf is None else self.cdf + p
            self.survival = 1.0 - lam if self.survival is None else self.survival * (1.0 - lam)
            fire = self.cdf >= self.threshold
        if self.tol is not None and previous is not None:
            prev = _at_least_float32(previous)
            change = torch.linalg.vector_norm(_at_least_float32(current) - prev, dim=-1) / torch.linalg.vector_norm(
                prev, dim=-1).clamp_min(torch.finfo(prev.dtype).tiny)
            fire = change < self.tol if fire is None else fire | (change < self.tol)
        return fire


def exit_loops(gate_logits, states, threshold=None, tol=None) -> torch.Tensor:
    """``(B, S)`` 0-based exit loop of each token under ``ExitRule`` (the last loop where no rule fires), from the
    gate logits ``(B, S, T)`` (None where no ``threshold`` reads them) and the ``T`` loop states of a call that ran
    every loop."""
    loops, rule = len(states), ExitRule(threshold, tol)
    index = torch.full(states[0].shape[:2], loops - 1, dtype=torch.long, device=states[0].device)
    for t in range(loops - 1):
        gate = None if gate_logits is None else gate_logits[..., t : t + 1]
        fire = rule(gate, states[t - 1] if t else None, states[t])
        if fire is not None:
            index = torch.where(fire & (index == loops - 1), torch.full_like(index, t), index)
    return index


def _put_running(target, flat, values):
    """``target`` ``(B, S, ...)`` with the entries of the running tokens (``flat``, their ``(N,)`` places among the
    ``B * S``) replaced by ``values`` ``(N, ...)`` (out of place, one ``index_copy``)."""
    if values.dtype != target.dtype:
        values = values.to(target.dtype)
    return target.reshape(-1, *target.shape[2:]).index_copy(0, flat, values).view(target.shape)


class _RunningSet:
    """The running tokens of ``active`` ``(B, S)`` (``exit_mode="skip"``), gathered once per change of the set:
    ``flat``, their ``(N,)`` places among the ``B * S`` (row-major); their rotary embeddings ``rope`` (``(N,
    head_dim)`` each, or ``(1, head_dim)`` when decoding without padding); ``rows``, the rows with a running token
    (None when every row has one: the cache is attended without a gather); ``valid`` ``(R, width)``, the queries
    packed per row (None when decoding: one query per running row) and ``slots``, the places of the valid ones among
    the ``R * width``; ``allowed``, the attention's key mask (None: every key). Gathers and puts go through
    ``index_select`` / ``index_copy`` on the flat places (cheaper than indexing with ``(b, s)``)."""

    def __init__(self, active, position_embeddings, keymask):
        batch, seq = active.shape
        self.flat = active.flatten().nonzero().squeeze(-1)
        if seq == 1:  # decoding: one query per running row, no packing
            self.rows = self.flat
            self.valid = self.slots = None
            self.allowed = None if keymask is None else keymask.index_select(0, self.flat)[:, None]
            # shared by every row when the positions are (no padding)
            self.rope = tuple(x[:, 0] if x.shape[0] == 1 else x[:, 0].index_select(0, self.flat)
                              for x in position_embeddings)
            return
        counts = active.sum(-1)
        rows = counts.nonzero().squeeze(-1)  # (R,) rows with a running token
        self.rows = None if rows.shape[0] == batch else rows
        if self.rows is not None:
            active, keymask, counts = (x.index_select(0, rows) for x in (active, keymask, counts))
        width = int(counts.max())
        # queries packed per row, (R, width): the positions of its running tokens first, in order
        order = torch.sort((~active).to(torch.uint8), dim=-1, stable=True).indices[:, :width]
        self.valid = torch.arange(width, device=active.device) < counts[:, None]
        self.slots = self.valid.flatten().nonzero().squeeze(-1)  # (N,) the valid places of the (R * width) queries
        allowed = keymask.gather(1, order[..., None].expand(-1, -1, keymask.shape[-1])) | ~self.valid[..., None]
        self.allowed = allowed[:, None]
        self.rope = tuple(x.expand(batch, seq, -1).reshape(batch * seq, -1).index_select(0, self.flat)
                          for x in position_embeddings)

    def gather(self, hidden_states):
        """The running tokens' states ``(N, D)`` of ``(B, S, D)``."""
        return hidden_states.reshape(-1, hidden_states.shape[-1]).index_select(0, self.flat)


def _mixture(loop_logits, pdf):
    """Exit-probability-weighted mixture of the per-loop logits."""
    return sum(pdf[..., t, None].to(logits.dtype) * logits for t, logits in enumerate(loop_logits))


def running_key_mask(attention_mask, batch: int, seq: int, past: int, device) -> torch.Tensor:
    """``(B, S, past + S)`` bool: the keys query ``s`` (cache position ``past + s``) attends to: causal, minus the
    padding of a 2-d ``attention_mask``; its own key always, so that a padding query has one key (no NaN)."""
    if attention_mask is not None and not (isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 2):
        raise ValueError("exit_mode='skip' needs a 2-d attention_mask (batch, keys) or None.")
    keys = torch.arange(past + seq, device=device)
    query = past + torch.arange(seq, device=device)
    allowed = (keys[None, :] <= query[:, None])[None].expand(batch, -1, -1)
    if attention_mask is not None:
        allowed = allowed & attention_mask[:, None, -(past + seq):].to(device=device, dtype=torch.bool)
    return allowed | (keys[None, None, :] == query[None, :, None])


class OuroRMSNorm(LlamaRMSNorm):
    """Llama's RMS norm (``weight * x / rms(x)``, weight initialized to ones) computed in at least float32:
    half-precision inputs get float32 statistics as upstream, float64 inputs stay in float64."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        dtype = hidden_states.dtype
        x = hidden_states.to(torch.promote_types(dtype, torch.float32))
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * x.to(dtype)


class _LoopSlots:
    """A cache seen by loop ``t``: layer ``l`` reads and writes slot ``t * num_hidden_layers + l``."""

    def __init__(self, cache: Cache, offset: int):
        self.cache, self.offset = cache, offset

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        return self.cache.update(key_states, value_states, layer_idx + self.offset, *args, **kwargs)


class OuroDecoderLayer(GradientCheckpointingLayer):
    """Llama attention and SwiGLU MLP with Ouro's four RMS norms (pre and post each sublayer, inside the branch)."""

    def __init__(self, config: OuroConfig, layer_idx: int):
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_idx)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = OuroRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.input_layernorm_2 = OuroRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = OuroRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm_2 = OuroRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states, attention_mask=None, position_embeddings=None, past_key_values=None, attend=None,
                **kwargs):
        """``attend(self_attn, x)``, if given, replaces the attention call (the running tokens of an early exit)."""
        if attend is not None:
            attn = attend(self.self_attn, self.input_layernorm(hidden_states))
        else:
            attn, _ = self.self_attn(self.input_layernorm(hidden_states), position_embeddings=position_embeddings,
                                     attention_mask=attention_mask, **{CACHE_NAME: past_key_values}, **kwargs)
        hidden_states = hidden_states + self.input_layernorm_2(attn)
        mlp = self.mlp(self.post_attention_layernorm(hidden_states))
        return hidden_states + self.post_attention_layernorm_2(mlp)


class OuroPreTrainedModel(EngineGuardMixin, PreTrainedModel):
    # Why vLLM's generic Transformers backend cannot run it (fp_engines): refused with this reason.
    _engine_refusal = ("it applies its decoder layers once per loop (total_ut_steps) and needs one KV-cache slot per"
                       " (loop, layer), where such a backend keeps one per attention module: the loops would "
                       "overwrite each other's keys and values and the tokens would be wrong from the third "
                       "generated one")
    config_class = OuroConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["OuroDecoderLayer"]
    _skip_keys_device_placement = ["past_key_values", "cache"]
    _supports_sdpa = True
    _supports_flash_attn = True
    _supports_flex_attn = True
    _supports_attention_backend = True
    # output_hidden_states / output_attentions: every (loop, layer) application, in order (transformers' capture).
    _can_record_outputs = {"hidden_states": OuroDecoderLayer, "attentions": LlamaAttention}

    @classmethod
    def from_pretrained(cls, *args, **kwargs):
        """``PreTrainedModel.from_pretrained``, but weights missing from the checkpoint are an error (upstream
        transformers would initialize them randomly with only a warning)."""
        want_info = kwargs.pop("output_loading_info", False)
        model, info = super().from_pretrained(*args, output_loading_info=True, **kwargs)
        missing = sorted(info.get("missing_keys") or [])
        if missing:
            raise ValueError(f"The checkpoint lacks {len(missing)} Ouro weight(s): {missing[:8]}"
                             f"{' ...' if len(missing) > 8 else ''}. Expected the ByteDance/Ouro state-dict names "
                             "(model.layers.{i}.self_attn.q_proj.weight, model.early_exit_gate.weight, ...).")
        return (model, info) if want_info else model


def _resolve_loops(total_ut_steps, config) -> int:
    loops = config.total_ut_steps if total_ut_steps is None else total_ut_steps
    check_number(loops, "total_ut_steps", low=1, integer=True)
    return loops


def _resolve_exit(exit_mode, exit_threshold, exit_tol, config):
    """The per-call exit settings (``None``: the config's), validated: ``(mode, threshold, tol)``."""
    mode = getattr(config, "early_exit_mode", "select") if exit_mode is None else exit_mode
    check_choice(mode, "exit_mode", EXIT_MODES)
    threshold = config.early_exit_threshold if exit_threshold is None else exit_threshold
    if threshold is not None:
        check_number(threshold, "exit_threshold", low=0.0, high=1.0)
    tol = getattr(config, "early_exit_tol", None) if exit_tol is None else exit_tol
    if tol is not None:
        check_number(tol, "exit_tol", low=0.0)
    return mode, threshold, tol


class OuroModel(OuroPreTrainedModel):
    def __init__(self, config: OuroConfig):
        super().__init__(config)
        self.padding_idx = config.pad_token_id
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        self.layers = nn.ModuleList([OuroDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = OuroRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = LlamaRotaryEmbedding(config)
        self.early_exit_gate = nn.Linear(config.hidden_size, 1)
        self.gradient_checkpointing = False
        self.post_init()

    def _prepare_cache(self, cache: Cache, loops: int) -> None:
        """Make room for one slot per (loop, layer); refuse a cache filled with another loop count."""
        slots = loops * self.config.num_hidden_layers
        if len(cache.layers) == slots:  # the decoding steps: no look at the (for a static cache: tensor) length
            return
        if cache.get_seq_length() > 0:
            raise ValueError(f"The cache holds {len(cache.layers)} (loop, layer) slots but total_ut_steps={loops} "
                             f"needs {slots}: keep total_ut_steps fixed while reusing a cache.")
        if cache.layer_class_to_replicate is None and len(cache.layers) < slots:
            # A cache built from the config (e.g. by generate) has one slot per layer only; a static one
            # (cache_implementation="static", what compiled generation uses) gets static slots of its length.
            first = cache.layers[0]
            if isinstance(first, StaticLayer):
                cache.layers.extend(StaticLayer(max_cache_len=first.max_cache_len)
                                    for _ in range(slots - len(cache.layers)))
            else:
                cache.layers.extend(DynamicLayer() for _ in range(slots - len(cache.layers)))

    def loop(self, hidden_states, mask, position_embeddings, past_key_values=None, offset: int = 0, **kwargs):
        """One loop: every layer once (cache slots ``offset + l``), then the final norm."""
        cache = None if past_key_values is None else _LoopSlots(past_key_values, offset)
        for layer in self.layers:
            hidden_states = layer(hidden_states, attention_mask=mask, position_embeddings=position_embeddings,
                                  past_key_values=cache, **kwargs)
        return self.norm(hidden_states)

    def loop_flops(self, keys: int) -> int:
        """Matrix-multiply FLOPs of one loop for one token whose attention spans ``keys`` positions (gate
        included)."""
        c, attn = self.config, self.layers[0].self_attn
        q, kv = c.num_attention_heads * attn.head_dim, c.num_key_value_heads * attn.head_dim
        layer = 2 * c.hidden_size * (2 * q + 2 * kv) + 6 * c.hidden_size * c.intermediate_size + 4 * q * keys
        return c.num_hidden_layers * layer + 2 * c.hidden_size

    def _loops_with_exit(self, hidden_states, loops, mask, position_embeddings, cache, keymask, threshold, tol,
                         **kwargs):
        """``exit_mode="skip"``: every loop runs on the tokens still running only. Returns the loop states (an exited
        token keeps its exit state), the gate logits and each token's exit loop ``(B, S)``.

        Per loop the bookkeeping is a few tensor ops and one host sync (the running count): the running set's index
        tensors (``_RunningSet``) are built when a token exits, not every loop, and ``exit_loop`` is written only then;
        while every token runs, the plain loop runs (no index tensors at all)."""
        num_layers, rule = len(self.layers), ExitRule(threshold, tol)
        total = hidden_states.shape[0] * hidden_states.shape[1]
        active, running, current = None, total, None  # active None: every token runs; current: the _RunningSet
        exit_loop = torch.full(hidden_states.shape[:2], loops - 1, dtype=torch.long, device=hidden_states.device)
        states, gates, x = [], [], None
        for t in range(loops):
            if active is None:  # the plain loop, exactly
                new = self.loop(hidden_states, mask, position_embeddings, cache, offset=t * num_layers, **kwargs)
                gate = self.early_exit_gate(new)
            elif running == 0:  # every token has exited: the remaining slots get copies, nothing is computed
                self._copy_slots(cache, range(t * num_layers, loops * num_layers), hidden_states.shape[1])
                states += [hidden_states] * (loops - t)
                gates += [gates[-1]] * (loops - t)
                break
            else:
                if current is None:  # the running set changed: gather it anew
                    current, x = _RunningSet(active, position_embeddings, keymask), None
                new, x = self._loop_running(hidden_states, current, cache, t * num_layers, x)
                gate = _put_running(gates[-1], current.flat, self.early_exit_gate(x))  # an exited token's is frozen
            states.append(new)
            gates.append(gate)
            fire = rule(gate, hidden_states if t else None, new) if t < loops - 1 else None
            if fire is not None:
                # bool tensors: a > b is a & ~b, one op (the tokens that ran and did not fire)
                still = ~fire if active is None else active > fire
                count = int(still.sum())
                if count != running:  # tokens exited at this loop: record them, rebuild the running set
                    exit_loop = exit_loop.masked_fill(fire if active is None else active ^ still, t)
                    running, current = count, None
                if count < total:
                    active = still
            hidden_states = new
        return states, gates, exit_loop

    def _copy_slots(self, cache, slots, seq: int) -> None:
        """Each of ``slots`` gets the previous loop's entries of this call's ``seq`` tokens (its latest ones)."""
        for slot in slots:
            latest = cache.layers[slot - len(self.layers)]
            cache.update(latest.keys[:, :, -seq:], latest.values[:, :, -seq:], slot)

    def _loop_running(self, hidden_states, running, cache, offset, x=None):
        """One loop for the running tokens (``running``, a ``_RunningSet``) only, gathered; the others keep their
        state, and their cache entries of this loop are copies of their latest ones (those of their exit loop). ``x``:
        the running tokens' states ``(N, D)`` if the previous loop ran on the same set (no gather). Returns the new
        states ``(B, S, D)`` and the running tokens' new states ``(N, D)``."""
        if x is None:
            x = running.gather(hidden_states)
        seq = hidden_states.shape[1]
        for layer_idx, layer in enumerate(self.layers):
            x = layer(x, attend=partial(self._attend_running, cache=cache, slot=offset + layer_idx, seq=seq,
                                        running=running))
        x = self.norm(x)
        return _put_running(hidden_states, running.flat, x), x

    def _attend_running(self, attn, x, cache, slot, seq, running):
        """Attention of the running tokens ``x`` ``(N, D)`` (already normed) of a call of ``seq`` tokens: slot
        ``slot`` gets the previous loop's latest keys and values of this call with the running tokens' replaced;
        queries attend packed per row ``(R, width)`` (``running.valid``), or one per row when decoding (``valid``
        None). The rows' keys are gathered only when some row has no running token."""
        n, head_dim = x.shape[0], attn.head_dim
        q = attn.q_proj(x).view(n, -1, head_dim)
        k = attn.k_proj(x).view(n, -1, head_dim)
        v = attn.v_proj(x).view(n, -1, head_dim)
        q, k = apply_rotary_pos_emb(q, k, *running.rope, unsqueeze_dim=1)
        latest = cache.layers[slot - len(self.layers)]  # this layer, previous loop: (B, H_kv, past + S, head_dim)
        if running.valid is None:  # decoding, one query per running row: index_copy (cheaper than indexing)
            keys = latest.keys[:, :, -1:].index_copy(0, running.flat, k[:, :, None])
            values = latest.values[:, :, -1:].index_copy(0, running.flat, v[:, :, None])
        else:  # (B, S, H_kv, head_dim) with the running tokens' entries put, back to (B, H_kv, S, head_dim)
            keys, values = (_put_running(x[:, :, -seq:].transpose(1, 2), running.flat, y).transpose(1, 2)
                            for x, y in ((latest.keys, k), (latest.values, v)))
        keys, values = cache.update(keys, values, slot)
        if running.rows is not None:  # only the rows with a running token attend
            keys, values = keys.index_select(0, running.rows), values.index_select(0, running.rows)
        keys = repeat_kv(keys, attn.num_key_value_groups)
        values = repeat_kv(values, attn.num_key_value_groups)
        if running.valid is None:  # one query per row: (N, H, 1, head_dim)
            out = F.scaled_dot_product_attention(q[:, :, None], keys, values, scale=attn.scaling,
                                                 attn_mask=running.allowed)
            return attn.o_proj(out.reshape(n, -1))
        # queries (R, width, H, head_dim) put and taken through the flat places of the valid ones (no mask indexing)
        query = q.new_zeros(running.valid.numel(), *q.shape[1:]).index_copy(0, running.slots, q)
        out = F.scaled_dot_product_attention(query.view(*running.valid.shape, *q.shape[1:]).transpose(1, 2), keys,
                                             values, attn_mask=running.allowed, scale=attn.scaling)
        return attn.o_proj(out.transpose(1, 2).reshape(running.valid.numel(), -1).index_select(0, running.slots))

    def loop_step(self, hidden_states, attention_mask=None, position_ids=None):
        """One uncached loop as a function of the state alone. The mask is built for the attention implementation
        active at call time, so a regularizer may switch to eager attention for double backward. A state holding
        only the first ``k`` sequences of the batch uses the first ``k`` rows of the mask and positions."""
        k = hidden_states.shape[0]
        if attention_mask is not None:
            attention_mask = attention_mask[:k]
        if position_ids is not None and position_ids.shape[0] > k:
            position_ids = position_ids[:k]
        if position_ids is None:
            position_ids = torch.arange(hidden_states.shape[1], device=hidden_states.device)[None]
        mask = create_causal_mask(config=self.config, inputs_embeds=hidden_states, attention_mask=attention_mask,
                                  past_key_values=None, position_ids=position_ids)
        return self.loop(hidden_states, mask, self.rotary_emb(hidden_states, position_ids=position_ids))

    def loop_function(self, outputs):
        """One loop of the call that returned ``outputs`` as a function of the state (its mask and positions)."""
        return partial(self.loop_step, attention_mask=outputs.loop_attention_mask,
                       position_ids=outputs.loop_position_ids)

    @capture_outputs
    def forward(
        self,
        input_ids: Optional[torch.LongTensor] = None,
        attention_mask: Optional[torch.Tensor] = None,
        position_ids: Optional[torch.LongTensor] = None,
        past_key_values: Optional[Cache] = None,
        inputs_embeds: Optional[torch.FloatTensor] = None,
        use_cache: Optional[bool] = None,
        total_ut_steps: Optional[int] = None,
        exit_mode: Optional[str] = None,
        exit_threshold: Optional[float] = None,
        exit_tol: Optional[float] = None,
        **kwargs,
    ) -> OuroModelOutput:
        r"""
        Args:
            total_ut_steps: loops for this call (default ``config.total_ut_steps``).
            exit_mode, exit_threshold, exit_tol: the early exit of this call (defaults: ``config.early_exit_mode``,
                ``early_exit_threshold``, ``early_exit_tol``). With ``"skip"`` at inference each token stops at the
                first loop where its ``ExitRule`` fires; otherwise every loop runs for every token.
        """
        reject_prefixed_keywords(kwargs, "fp", (), type(self).__name__, "Ouro has no fp_* settings: its per-call "
                                 "knobs are total_ut_steps=k (the loops of the layer stack) and exit_mode, "
                                 "exit_threshold, exit_tol (the early exit).")
        past_key_values = pop_cache(past_key_values, kwargs)
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("Pass exactly one of input_ids and inputs_embeds.")
        loops = _resolve_loops(total_ut_steps, self.config)
        mode, threshold, tol = _resolve_exit(exit_mode, exit_threshold, exit_tol, self.config)
        skip = mode == "skip" and not self.training
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if self.gradient_checkpointing and self.training:
            use_cache = False
        if use_cache and past_key_values is None:
            past_key_values = DynamicCache()
        if not use_cache:
            past_key_values = None
        cache = past_key_values
        if skip:  # the deeper slots of exited tokens are copied from the exit loop's: a working cache in any case
            self._check_skip(cache, kwargs)
            cache = DynamicCache() if cache is None else cache
        if cache is not None:
            self._prepare_cache(cache, loops)
        past = cache.get_seq_length() if cache is not None else 0  # (a tensor for a static cache)
        if position_ids is None:
            position_ids = (torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device) + past)[None]
        # Shared by all loops, as upstream: one mask, one set of rotary embeddings.
        if isinstance(attention_mask, dict):  # generate's prepared masks (static cache): one per attention type
            mask = attention_mask["full_attention"]
        else:
            mask = create_causal_mask(config=self.config, inputs_embeds=inputs_embeds, attention_mask=attention_mask,
                                      past_key_values=cache, position_ids=position_ids)
        position_embeddings = self.rotary_emb(inputs_embeds, position_ids=position_ids)
        batch, seq = inputs_embeds.shape[:2]
        exit_loop, ran = None, torch.full((batch, seq), loops, device=inputs_embeds.device)  # loops run per token
        if skip:
            if seq == 1 and (attention_mask is None or (torch.is_tensor(attention_mask) and attention_mask.dim() == 2
                                                         and bool(attention_mask.all()))):
                keymask = None  # decoding without padding: every query sees every key, no mask needed
            else:
                keymask = running_key_mask(attention_mask, batch, seq, past, inputs_embeds.device)
            states, gates, exit_loop = self._loops_with_exit(inputs_embeds, loops, mask, position_embeddings, cache,
                                                             keymask, threshold, tol, **kwargs)
            ran = exit_loop + 1
        else:
            hidden_states, states, gates = inputs_embeds, [], []
            for t in range(loops):
                hidden_states = self.loop(hidden_states, mask, position_embeddings, cache,
                                          offset=t * self.config.num_hidden_layers, **kwargs)
                states.append(hidden_states)
                gates.append(self.early_exit_gate(hidden_states))
        keys = cache.layers[0].keys.shape[-2] if cache is not None else seq  # attended positions (static: all)
        flops = ran.to(torch.float32) * float(self.loop_flops(keys))
        change = loop_change(states, attention_mask)
        self._guard_depth(loops, lambda: change)
        return OuroModelOutput(last_hidden_state=states[-1], **{CACHE_NAME: past_key_values},
                               loop_hidden_states=tuple(states), gate_logits=torch.cat(gates, dim=-1),
                               loop_attention_mask=attention_mask if torch.is_tensor(attention_mask) else None,
                               loop_position_ids=position_ids, loop_change=change, exit_loop=exit_loop,
                               flops=flops)

    def _check_skip(self, cache, kwargs) -> None:
        """Refuse what ``exit_mode="skip"`` cannot serve: a cache other than a dynamic one, per-layer recording."""
        require_dynamic_cache(cache, "Ouro with exit_mode='skip'", "the deeper cache entries of an exited token are "
                              "copies of its exit loop's, written into growing per-(loop, layer) slots")
        for name in ("output_hidden_states", "output_attentions"):
            if kwargs.get(name, getattr(self.config, name, False)):
                raise ValueError(f"{name}=True is not supported with exit_mode='skip' (the layers run on the running "
                                 "tokens only); use exit_mode='select'.")

    def _guard_depth(self, loops: int, change: Callable[[], Optional[torch.Tensor]]) -> None:
        """Warn once (``LoopDepthWarning``) when this call runs past the trained loop counts and the batch's mean
        change per loop (``change()``: ``loop_change``, called only where the guard applies) grows (the last loop
        changes the state more than the last trained loop did) or stays above ``config.loop_guard_tol`` past the
        trained depth."""
        tol = getattr(self.config, "loop_guard_tol", None)
        trained = getattr(self.config, "trained_loops", None)
        deepest = trained[1] if trained else self.config.total_ut_steps
        if tol is None or loops <= deepest or getattr(self, "_depth_warned", False):
            return
        if self.training or torch.compiler.is_compiling():
            return
        change = change()
        if change is None:
            return
        mean = change.mean(0)  # (T - 1,): mean[j] is the change into loop j + 2 (1-based) from loop j + 1
        past = mean[deepest - 1:]  # the changes into the loops past the trained depth
        grows = deepest >= 2 and bool(mean[-1] > mean[deepest - 2])  # the last loop moves more than the trained last
        if grows or bool((past > tol).any()):
            self._depth_warned = True
            trace = " ".join(f"{v:.3g}" for v in mean.tolist())
            warnings.warn(
                f"{type(self).__name__} ran total_ut_steps={loops} loops, past the {deepest} it was trained with "
                f"(config.trained_loops={trained}), and its state is not settling: the mean relative change per loop "
                f"is [{trace}] ({'it grows' if grows else f'above loop_guard_tol={tol:g}'} past loop {deepest}). "
                "Outputs past the trained depth are likely unreliable; a model trained with STARS settles instead. "
                "Set config.loop_guard_tol=None to silence this check.", LoopDepthWarning, stacklevel=3)


class OuroForCausalLM(OuroPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
    _tp_plan = {"lm_head": "colwise_gather_output"}

    def __init__(self, config: OuroConfig):
        super().__init__(config)
        self.model = OuroModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def loop_function(self, outputs):
        """One loop of the call that returned ``outputs`` as a function of the state (see ``OuroModel``)."""
        return self.model.loop_function(outputs)

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
        total_ut_steps: Optional[int] = None,
        exit_threshold: Optional[float] = None,
        exit_at_step: Optional[int] = None,
        use_weighted_exit: bool = False,
        output_loop_logits: bool = False,
        exit_mode: Optional[str] = None,
        exit_tol: Optional[float] = None,
        **kwargs,
    ) -> OuroCausalLMOutput:
        r"""
        Args:
            labels: next-token targets (shifted inside); gives ``loss`` per ``config.exit_loss``.
            total_ut_steps: loops for this call (default ``config.total_ut_steps``).
            exit_threshold: Q-exit threshold for this call (default ``config.early_exit_threshold``), in [0, 1]; each
                token exits at the first loop whose cumulative exit probability reaches it, else at the last loop.
            exit_tol: state-change exit for this call (default ``config.early_exit_tol``), >= 0: a token also exits
                at the first loop (from the second on) whose relative state change is below it.
            exit_mode: ``"select"`` (default ``config.early_exit_mode``; as upstream) runs every loop for every token
                and decodes the exit loop; ``"skip"`` stops each token at its exit loop (inference only).
            exit_at_step: decode this loop (0-based) for every token (default ``config.early_exit_step``).
            use_weighted_exit: decode the exit-probability-weighted mixture of the per-loop logits.
            output_loop_logits: also return the logits of every loop.

        With labels, or in training mode, ``logits`` are those the training loss uses (``config.exit_loss``: the
        exit-weighted mixture, or the last loop), from every loop. Otherwise the decoding rule is, in order:
        ``exit_at_step``, ``use_weighted_exit``, the exit rules (threshold, tolerance), the last loop. In ``"select"``
        mode all loops are computed (the exit selects, as upstream); in ``"skip"`` mode a token's later loops are not
        computed and its later cache slots hold copies of its exit loop's keys and values.
        """
        past_key_values = pop_cache(past_key_values, kwargs)
        decoding = labels is None and not self.training
        mode, threshold, tol = _resolve_exit(exit_mode, exit_threshold, exit_tol, self.config)
        step = self.config.early_exit_step if exit_at_step is None else exit_at_step
        if mode == "skip" and decoding and (step is not None or use_weighted_exit):
            raise ValueError("exit_mode='skip' decodes each token at its exit loop; exit_at_step (or "
                             "config.early_exit_step) and use_weighted_exit need every loop: use exit_mode='select'.")
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         past_key_values=past_key_values, inputs_embeds=inputs_embeds, use_cache=use_cache,
                         total_ut_steps=total_ut_steps, exit_mode=mode if decoding else "select",
                         exit_threshold=threshold, exit_tol=tol, return_dict=True, **kwargs)
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        states = [h[:, keep] for h in out.loop_hidden_states]
        pdf = exit_distribution(out.gate_logits[:, keep])
        need_all = output_loop_logits or not decoding or use_weighted_exit
        loop_logits = [self.lm_head(h) for h in states] if need_all else None
        loss, exit_loop = None, None
        if not decoding:
            logits, loss = self._training_logits(loop_logits, pdf, labels, **kwargs)
        elif mode == "skip":  # the last state of an exited token is its exit state
            logits = loop_logits[-1] if need_all else self.lm_head(states[-1])
            exit_loop = out.exit_loop[:, keep]
        else:
            logits, exit_loop = self._select_logits(states, loop_logits, pdf, out.gate_logits[:, keep], step,
                                                    use_weighted_exit, threshold, tol)
        flops = out.flops.clone()
        heads = len(states) if need_all else 1  # lm_head applications per decoded token
        flops[:, keep] += float(heads * 2 * self.config.hidden_size * self.config.vocab_size)
        if getattr(self, "_exit_trace", None) is not None:  # inside generate: per decoded token
            self._exit_trace.append((exit_loop, flops[:, keep]))
        return OuroCausalLMOutput(loss=loss, logits=logits, **{CACHE_NAME: getattr(out, CACHE_NAME)},
                                  loop_hidden_states=out.loop_hidden_states, gate_logits=out.gate_logits,
                                  exit_pdf=pdf, loop_logits=tuple(loop_logits) if output_loop_logits else None,
                                  loop_attention_mask=out.loop_attention_mask,
                                  loop_position_ids=out.loop_position_ids, hidden_states=out.hidden_states,
                                  attentions=out.attentions, loop_change=out.loop_change, exit_loop=exit_loop,
                                  flops=flops)

    def _training_logits(self, loop_logits, pdf, labels, **kwargs):
        """The logits and loss of ``config.exit_loss`` (loss None without labels)."""
        mode = self.config.exit_loss
        logits = loop_logits[-1] if mode == "last" else _mixture(loop_logits, pdf)
        if labels is not None and mode == "expected_loss":
            return logits, self._expected_loss(loop_logits, pdf, labels)
        if labels is not None:
            return logits, self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size,
                                              **kwargs)
        return logits, None

    def _select_logits(self, states, loop_logits, pdf, gate_logits, step, use_weighted_exit, threshold, tol):
        """``exit_mode="select"`` decoding: the logits and the decoded loop per token (None for the mixture)."""
        loops = len(states)
        if step is not None:
            check_number(step, "exit_at_step", low=0, high=loops - 1, integer=True)
            logits = loop_logits[step] if loop_logits is not None else self.lm_head(states[step])
            return logits, torch.full(states[0].shape[:2], step, dtype=torch.long, device=states[0].device)
        if use_weighted_exit:
            return _mixture(loop_logits, pdf), None
        if (threshold is not None or tol is not None) and loops > 1:
            index = exit_loops(gate_logits, states, threshold, tol)  # (B, S)
            stacked = torch.stack(states, dim=-2)  # (B, S, T, D)
            chosen = stacked.gather(-2, index[..., None, None].expand(*index.shape, 1, stacked.shape[-1]))
            return self.lm_head(chosen.squeeze(-2)), index
        logits = loop_logits[-1] if loop_logits is not None else self.lm_head(states[-1])
        return logits, torch.full(states[0].shape[:2], loops - 1, dtype=torch.long, device=states[0].device)

    def generate(self, *args, **kwargs):
        """``GenerationMixin.generate``. With ``return_dict_in_generate=True`` the result also carries, per
        generated token (one column each, ``(B, new tokens)``), ``flops``: the FLOPs spent on the position that
        produced it (the prompt's other positions are not included), and ``exit_loop``: the loop it was decoded
        from (absent with ``use_weighted_exit``). For greedy search and sampling (beam search reorders rows).

        ``draft_depth=d`` decodes self-speculatively (``fp_speculative.speculative_decoding``): drafts of ``d`` loops,
        verified by the remaining loops, the same tokens as full-depth greedy search."""
        if kwargs.get("draft_depth") is not None:
            return generate_speculative(self, *args, **kwargs)
        if kwargs.get("draft_max_depth") is not None:
            raise ValueError("draft_max_depth bounds the loops of self-speculative drafts: pass draft_depth too.")
        kwargs.pop("draft_depth", None)
        kwargs.pop("draft_max_depth", None)
        self._exit_trace = []
        try:
            result = super().generate(*args, **kwargs)
        finally:
            trace, self._exit_trace = self._exit_trace, None
        if isinstance(result, ModelOutput) and trace:
            result["flops"] = torch.cat([f for _, f in trace], dim=1)
            if all(e is not None for e, _ in trace):
                result["exit_loop"] = torch.cat([e for e, _ in trace], dim=1)
        return result

    def _speculation(self, generation_config, draft_depth, model_kwargs):
        """The draft / verify steps of ``generate(..., draft_depth=d)`` (``fp_speculative.speculative_decoding``)."""
        return _OuroSpeculation(self, generation_config, draft_depth, model_kwargs)

    def _expected_loss(self, loop_logits, pdf, labels):
        """Paper stage I: mean over target tokens of ``sum_t p_t * CE_t - entropy_weight * H(p)``."""
        targets = F.pad(labels, (0, 1), value=-100)[:, 1:].to(pdf.device)
        valid = targets != -100
        ce = torch.stack([F.cross_entropy(lg.to(pdf.dtype).transpose(1, 2), targets, reduction="none")
                          for lg in loop_logits], dim=-1)  # (B, S, T); ignored targets (-100) give 0
        entropy = -(pdf * pdf.clamp_min(1e-12).log()).sum(-1)
        per_token = (pdf * ce).sum(-1) - self.config.entropy_weight * entropy
        return (per_token * valid).sum() / valid.sum().clamp_min(1)


# --- Self-speculative decoding: the model at fewer loops drafts, the remaining loops verify -------------------------
#
# Every (loop, layer) has its own cache slots, so a draft of ``d`` loops computes exactly loops 1..d of the full model
# for the drafted tokens: verification runs loops d+1..K on their loop-d states, all drafted tokens in one pass, and
# keeps the draft's cache entries. Loop ``t`` at a position depends only on loop ``t`` at the positions up to it and on
# loop ``t - 1``, so the prompt too needs only its loops 1..d before drafting: the prefill runs those (its last
# position drafts the first token), and the first verification runs loops d+1..K on the prompt and the drafts in one
# pass, the same computation as a full-depth prefill followed by a verification. The loop itself (``generate``
# plumbing, acceptance, roll-back, draft length) is ``fp_speculative``'s, shared with the fixed-point families.


def _run_loops(model, hidden, position_ids, attention_mask, cache, start: int, stop: int, gated: bool = True):
    """Loops ``start..stop - 1`` (0-based) of an ``OuroModel`` on ``hidden`` ``(B, q, D)`` (the state after loop
    ``start``; the embeddings for ``start = 0``) at ``position_ids`` ``(B, q)``, reading and writing the cache slots of
    those loops. Returns the states and gate logits of each loop (no gate logits when not ``gated``: the decoding
    rule does not read them)."""
    layers = model.config.num_hidden_layers
    if hidden.shape[1] == 1 and attention_mask is None and isinstance(cache.layers[start * layers], DynamicLayer):
        mask = None  # one query, no padding, no static slots past the length: it attends every key
    else:
        view = copy.copy(cache)  # the mask's sizes come from the first slot of loop `start` (slots differ in length)
        view.layers = cache.layers[start * layers:]
        mask = create_causal_mask(config=model.config, inputs_embeds=hidden, attention_mask=attention_mask,
                                  past_key_values=view, position_ids=position_ids)
    rope = model.rotary_emb(hidden, position_ids=position_ids)
    states, gates = [], []
    for t in range(start, stop):
        hidden = model.loop(hidden, mask, rope, cache, offset=t * layers)
        states.append(hidden)
        if gated:
            gates.append(model.early_exit_gate(hidden))
    return states, gates


class _OuroSpeculation(Speculation):
    """Ouro's deferred prefill (the prompt's loops 1..d, whose last position drafts the first token), draft (loops
    1..d, one position at a time) and verification (loops d+1..K on the loop-d states of every position not yet at
    full depth, in one pass, decoded by the call's exit rule); the call's loop and exit settings, validated."""

    UNSUPPORTED_FLAGS = Speculation.UNSUPPORTED_FLAGS + ("output_loop_logits",)

    def __init__(self, model, generation_config, draft_depth, model_kwargs):
        self.loops = _resolve_loops(model_kwargs.pop("total_ut_steps", None), model.config)
        self.depth = self.check_depth(draft_depth, self.loops, "total_ut_steps", "loops")
        mode, self.threshold, self.tol = _resolve_exit(model_kwargs.pop("exit_mode", None),
                                                       model_kwargs.pop("exit_threshold", None),
                                                       model_kwargs.pop("exit_tol", None), model.config)
        if mode == "skip":
            raise ValueError("draft_depth cannot be combined with exit_mode='skip' (a token's loops would stop at its "
                             "exit loop, where the draft needs loops 1..d and verification the rest); use "
                             "exit_mode='select', whose exit rules the verification applies as full-depth decoding.")
        step = model_kwargs.pop("exit_at_step", None)
        self.step = model.config.early_exit_step if step is None else step
        if self.step is not None:
            check_number(self.step, "exit_at_step", low=0, high=self.loops - 1, integer=True)
        self.weighted = bool(model_kwargs.pop("use_weighted_exit", False))
        self.gated = self.threshold is not None or self.weighted  # the rules that read the exit gate
        max_depth = model_kwargs.pop("draft_max_depth", None)
        super().__init__(model, generation_config, model_kwargs)
        self.max_depth = self.depth if max_depth is None else max_depth
        if max_depth is not None:
            check_number(max_depth, "draft_max_depth", low=self.depth, high=self.loops - 1, integer=True)
            if max_depth > self.depth and not self.confidence:
                raise ValueError(f"draft_max_depth={max_depth} runs a draft token's further loops while its "
                                 "probability is below assistant_confidence_threshold, which is "
                                 f"{self.confidence!r}: set a threshold in (0, 1], e.g. 0.9.")
        # the prompt's positions before its last token (pending: the first verification runs their loops d+1..K) and
        # the first draft step, taken by the prefill (the prompt's last position at loop d)
        self.pending, self.first = None, None

    def prefill(self, state, input_ids, model_kwargs, logits_processor) -> None:
        """Loops 1..d of the prompt (the slots of those loops). Its last position's loop-d state drafts the first
        token, and its deeper loops run in the first verification, with the drafts: the prompt never runs the full
        depth alone (``state.last`` stays the prompt's last token)."""
        core = self.model.model
        core._prepare_cache(self.cache, self.loops)
        positions = model_kwargs.get("position_ids")
        if positions is None:  # as forward's: 0..n-1 (the cache is empty, see Speculation)
            positions = torch.arange(input_ids.shape[1], device=input_ids.device).expand(input_ids.shape[0], -1)
        states, gates = _run_loops(core, core.embed_tokens(input_ids), positions, state.mask, self.cache, 0,
                                   self.depth, self.gated)
        self.pending = positions[:, :-1]
        self.first = self.model.lm_head(states[-1][:, -1]), (states, gates)

    def draft(self, state, k: int, logits_processor):
        """Up to ``k`` tokens at ``draft_depth`` loops; what ``verify`` needs of them: per loop 1..d the states and
        gate logits of the positions it decodes (the last kept token or the prompt, and the drafts), the last draft's
        loops 1..d included (no token is drafted from it)."""
        core, first, self.first = self.model.model, self.first, None

        def run(token, j):  # loops 1..d of ``token`` at position ``j`` of the round
            return _run_loops(core, core.embed_tokens(token[:, None]), state.positions(j + 1)[:, j:],
                              state.mask_with(j), self.cache, 0, self.depth, self.gated)

        def step(token, j):
            if j == 0 and first is not None:  # the prompt's last position, run by the prefill
                return first
            loops = run(token, j)
            return self.model.lm_head(loops[0][-1])[:, -1], loops

        deeper = _Deeper(self, state, first)
        drafts, scores, loops = self.draft_tokens(state, k, logits_processor, deeper.step(step),
                                                  deeper.deepen if self.max_depth > self.depth else None)
        deeper.settle()
        k = drafts.shape[1]
        loops.append(first[1] if k == 0 and first is not None else run(drafts[:, -1] if k else state.last, k))
        states = [torch.cat([s[t] for s, _ in loops], dim=1) for t in range(self.depth)]
        gates = [torch.cat([g[t] for _, g in loops], dim=1) for t in range(self.depth)] if self.gated else []
        return drafts, scores, (states, gates)

    def positions(self, state, new: int):
        """The positions of ``state.last`` and ``new - 1`` drafts, after the prompt's pending ones (first round)."""
        positions = state.positions(new)
        return positions if self.pending is None else torch.cat([self.pending, positions], dim=1)

    def verify(self, state, drafts, carry, logits_processor):
        """Loops d+1..K on the loop-d states of the positions from the last kept token to the last draft (and, in
        the first round, of the prompt's earlier positions: the deferred prefill), in one pass. Returns the processed
        scores ``(B, k + 1, V)``, decoded by the same exit rule as ``forward``."""
        (states, gates), core, k = carry, self.model.model, drafts.shape[1]
        positions, first = self.positions(state, k + 1), self.pending is not None  # first round: the prompt's too
        self.pending = None
        rest, rest_gates = _run_loops(core, states[-1], positions, state.mask_with(k), self.cache, self.depth,
                                      self.loops, self.gated)
        states = states + rest
        if first:  # the prompt at every loop: the depth guard of forward
            prompt = state.ids.shape[1]
            core._guard_depth(self.loops, lambda: loop_change([h[:, :prompt] for h in states], state.mask))
        states = [h[:, -(k + 1):] for h in states]
        gate_logits = torch.cat(gates + rest_gates, dim=-1)[:, -(k + 1):] if self.gated else None
        loop_logits = [self.model.lm_head(h) for h in states] if self.weighted else None
        pdf = exit_distribution(gate_logits) if self.weighted else None
        logits, _ = self.model._select_logits(states, loop_logits, pdf, gate_logits, self.step, self.weighted,
                                              self.threshold, self.tol)
        return self.process(state, drafts, logits, logits_processor)


class _Deeper:
    """``draft_max_depth``: a draft token the draft's ``d`` loops leave unsure is decided one loop deeper, up to
    ``draft_max_depth`` loops. Loop ``d + 1`` at a position needs loop ``d + 1`` at every earlier one, so each deeper
    loop runs on all positions not yet at full depth (the prompt's in the first round, and this round's so far), from
    their loop-``d`` states; its cache entries are dropped once the token is decided (``settle``): the verification
    computes those loops again for every position, so the deeper loops only choose the draft."""

    def __init__(self, spec, state, first):
        self.spec, self.state = spec, state
        self.prompt = first is not None  # the first round: position 0 is the prompt's last, run by the prefill
        self.shallow = [first[1][0][-1]] if self.prompt else []  # loop-d states of those positions
        self.hidden, self.extra = None, 0  # the deepest states so far, and the loops run past d

    def step(self, step):
        """``step``, recording the loop-d states of the positions it runs."""
        def run(token, j):
            self.settle()
            logits, loops = step(token, j)
            if j > 0 or not self.prompt:  # (the prompt's states are in already)
                self.shallow.append(loops[0][-1])
            return logits, loops
        return run

    def deepen(self, j):
        """The logits of position ``j`` one loop deeper (None at ``draft_max_depth``)."""
        spec = self.spec
        start = spec.depth + self.extra
        if start >= spec.max_depth:
            return None
        hidden = torch.cat(self.shallow, dim=1) if self.extra == 0 else self.hidden
        states, _ = _run_loops(spec.model.model, hidden, spec.positions(self.state, j + 1),
                               self.state.mask_with(j), spec.cache, start, start + 1, gated=False)
        self.hidden, self.extra = states[-1], self.extra + 1
        return spec.model.lm_head(self.hidden[:, -1])

    def settle(self) -> None:
        """Drop the deeper loops' cache entries."""
        if self.extra:
            layers = self.spec.model.config.num_hidden_layers
            depth = self.spec.depth
            rollback(self.spec.cache, self.hidden.shape[1],
                     self.spec.cache.layers[depth * layers:(depth + self.extra) * layers])
            self.hidden, self.extra = None, 0


__all__ = ["ExitRule", "LoopDepthWarning", "OuroCausalLMOutput", "OuroForCausalLM", "OuroModel", "OuroModelOutput",
           "OuroPreTrainedModel", "adaptive_gate_loss", "exit_distribution", "exit_loops", "loop_change"]
