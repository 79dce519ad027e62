# Source of truth: hf_fixedpoint/core/fp_fpsa.py. Verbatim copies live in modeling/*/ so that checkpoints
# saved with save_pretrained() load with torch + transformers only. Edit here, then run
# `python -m hf_fixedpoint.vendor`. Allowed imports: stdlib, torch, and `from .fp_<x> import ...`.
"""Fixed-Point Self-Attention (FPSA; Mathur et al., "Change of Thought: Adaptive Test-Time Computation", 2025).

One attention layer becomes an inner fixed-point loop. With ``X`` the layer's attention input and ``V = X W_V`` fixed,
each head's output ``O_h = softmax(Q_h(Z) K_h(Z)^T / (sqrt(d_h) tau_h)) V_h`` is recomputed from an iterate
``Z = state(O)`` until it stops changing. ``fpsa_attention`` iterates the per-head outputs ``O`` (``(B, T, H, d)``) so
that every (token, head) pair is its own convergence entry: it halts on its own relative change (``fp_tol``) and is
frozen afterwards while the others go on (``fixed_point`` with ``batch_dims=3``). The first step is the model's own
attention ``O_1 = Attn(Q(X), K(X), V)``, computed exactly as the base model does, so ``fp_max_iter=1`` reproduces the
base model bit for bit.

Update forms (``state``), both with the same weight names as the base model:

* ``residual_norm`` (default): ``Z = norm(R + W_O O)``, with ``R`` the residual stream entering the attention block
  and ``norm`` the block's own norm (BERT: the attention output LayerNorm, so ``Z`` is the attention block's output;
  pre-norm ViT/LLaMA: the layer's input norm). This is the re-injection form of the paper (Eq. 5) and of the official
  code's FPSA-R. It is the default because without re-injection the map ``Z -> W_O A(Z) V`` averages value rows with a
  row-stochastic ``A``: as the queries lose their token identity every token is drawn to the same convex combination,
  a rank-1 fixed point where ``W_Q``/``W_K`` receive vanishing gradients (the official code's explanation). Keeping
  ``R`` in the iterate keeps each token's identity, and for a pretrained post-norm model ``Z`` stays in the
  distribution the next query projection was trained on.
* ``plain``: ``Z = W_O O`` (the official HEAD code's map without damping).

``fpsa_step_norm="tanh"`` bounds each step: ``O <- O + tanh(F(O) - O)``; it has the same fixed points and limits the
size of early steps (useful with large temperatures or untrained retrofits). Damping is the solver's own option
(``fp_solver="picard", fp_solver_kwargs={"damping": 0.5}``).

Position embeddings (RoPE), grouped-query attention, causal masks and KV handling are the caller's: ``query`` and
``key`` are callables of the iterate (apply RoPE inside them), ``value`` is precomputed, and the mask and the attention
function (any transformers ``ALL_ATTENTION_FUNCTIONS`` entry; GQA through ``module.num_key_value_groups``) are passed
through.

Learned halting (FPSA-LH, ``halting="learned"``): a per-head gate maps (relative latent change, attention entropy, task
head logit margin) to a halting probability, accumulated ACT-style per token and head (``fp_halting.ACTAccumulator``);
the output is the halting-weighted mean of the iterates and ``ponder_loss`` pushes the mean ponder cost down to a
compute budget. Its gradient is backprop through the (short) loop.
"""

import math
from dataclasses import dataclass, field
from typing import Callable, List, Optional

import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from .fp_backward import fixed_point
from .fp_halting import ACTAccumulator
from .fp_jacobian import jacobian_frobenius, spectral_radius
from .fp_registry import check_choice, check_number
from .fp_settings import call_knobs
from .fp_stats import FixedPointStats

UPDATE_FORMS = ("residual_norm", "plain")
STEP_NORMS = ("none", "tanh")
HALTING_MODES = ("tolerance", "learned")
SPECTRAL_NORMS = ("none", "qk", "qko")
HALT_UNITS = ("head", "token", "state")
JAC_NORMS = ("frobenius", "spectral")
JAC_POWER_ITERS = 6  # power-iteration products per layer and step of the spectral penalty (random start each step)
HALT_FEATURES = 3  # relative latent change, attention entropy, task-head logit margin

FPSA_DEFAULTS = {
    "fpsa_update": "residual_norm",  # residual_norm | plain (see module docstring)
    "fpsa_step_norm": "none",  # none | tanh
    "fpsa_learn_temperature": True,  # learned per-head temperature tau_h = exp(log_tau_h), initialised to 1
    "fpsa_spectral_norm": "none",  # none | qk | qko: spectral normalisation of W_Q, W_K (and W_O)
    "fpsa_adjoint_mask": True,  # ift backward: implicit term only for converged (token, head) entries (paper App. D)
    "fpsa_halting": "tolerance",  # tolerance (fp_tol) | learned (FPSA-LH gate + ACT)
    "fpsa_ponder_budget": 4.0,  # learned halting: target mean iterations per (token, head)
    "fpsa_ponder_weight": 0.01,  # learned halting: weight of relu(mean ponder cost - budget) in the loss
    "fpsa_halt_threshold": 0.99,  # learned halting: ACT threshold 1 - eps
    "fpsa_halt_unit": "head",  # head: each (token, head) halts on its own change | token: all heads of a token |
    # state: each token on the relative change of the iterate Z its queries and keys are computed from
    "fpsa_jac_weight": 0.0,  # training: weight of the Jacobian penalty of each layer's FPSA map (0: none)
    "fpsa_jac_norm": "frobenius",  # frobenius: Hutchinson ||J_f||_F^2 / n | spectral: relu(rho(J_f) - target)^2
    "fpsa_jac_target": 0.2,  # spectral penalty: the spectral radius (per-step contraction) left unpenalised
}

# FPSA's own defaults for the shared fp_* knobs: the official code's tolerance and cap, and Picard iteration whose
# per-entry step halves whenever that entry's residual fails to improve (``picard_adaptive``): a converging entry steps
# exactly as plain Picard does; one caught in an oscillation (measured: the non-converging entries of the MiniLM
# retrofit sit in layer 0 and alternate) is damped until it converges.
FPSA_FP_DEFAULTS = {"fp_solver": "picard_adaptive", "fp_tol": 1e-3, "fp_max_iter": 16}


def check_fpsa_settings(s: dict) -> None:
    """Validate a complete dict of ``fpsa_*`` settings; errors name the key and the allowed values."""
    check_choice(s["fpsa_update"], "fpsa_update", UPDATE_FORMS)
    check_choice(s["fpsa_step_norm"], "fpsa_step_norm", STEP_NORMS)
    check_choice(s["fpsa_halting"], "fpsa_halting", HALTING_MODES)
    check_choice(s["fpsa_spectral_norm"], "fpsa_spectral_norm", SPECTRAL_NORMS)
    check_choice(s["fpsa_halt_unit"], "fpsa_halt_unit", HALT_UNITS)
    for key in ("fpsa_learn_temperature", "fpsa_adjoint_mask"):
        check_choice(s[key], key, (True, False))
    check_number(s["fpsa_ponder_budget"], "fpsa_ponder_budget", low=1.0)
    check_number(s["fpsa_ponder_weight"], "fpsa_ponder_weight", low=0.0)
    check_number(s["fpsa_halt_threshold"], "fpsa_halt_threshold", low=0.0, high=1.0, low_open=True, high_open=True)
    check_number(s["fpsa_jac_weight"], "fpsa_jac_weight", low=0.0)
    check_choice(s["fpsa_jac_norm"], "fpsa_jac_norm", JAC_NORMS)
    check_number(s["fpsa_jac_target"], "fpsa_jac_target", low=0.0, high=1.0, high_open=True)


def pop_fpsa_kwargs(kwargs: dict, defaults: Optional[dict] = None) -> dict:
    """Remove every ``fpsa_*`` key from ``kwargs``; return the complete, validated settings (unknown keys fail).
    ``defaults`` lets a family change a default (e.g. no learned temperature for the decoder retrofits)."""
    given = {k: kwargs.pop(k) for k in [k for k in kwargs if k.startswith("fpsa_")]}
    unknown = (set(given) | set(defaults or {})) - set(FPSA_DEFAULTS)
    if unknown:
        raise ValueError(f"Unknown FPSA setting(s) {sorted(unknown)}. Valid keys: {sorted(FPSA_DEFAULTS)}.")
    settings = {**FPSA_DEFAULTS, **(defaults or {}), **given}
    check_fpsa_settings(settings)
    return settings


def retrofit_config_dict(config_class, config_dict: dict, compatible) -> dict:
    """A checkpoint's config dict for an FPSA config class: its ``model_type`` must be in ``compatible`` (the base
    family or FPSA's own), and it is dropped so the FPSA class's own ``model_type`` applies."""
    model_type = config_dict.get("model_type")
    if model_type is not None and model_type not in compatible:
        raise ValueError(f"{config_class.__name__} cannot load this checkpoint: its model_type={model_type!r} is not "
                         f"one of {tuple(compatible)}.")
    return {k: v for k, v in config_dict.items() if k != "model_type"}


def check_heads(config) -> None:
    if config.hidden_size % config.num_attention_heads:
        raise ValueError(f"hidden_size={config.hidden_size} must be divisible by "
                         f"num_attention_heads={config.num_attention_heads}.")


def check_decoder_fpsa(config) -> None:
    """The FPSA options a causal decoder retrofit supports; errors name the setting and the allowed values."""
    if config.fpsa_halting != "tolerance":
        raise ValueError(f"{type(config).__name__}: fpsa_halting={config.fpsa_halting!r} is not supported by the "
                         "decoder retrofits; allowed: 'tolerance' (learned halting is an encoder feature).")
    if config.fpsa_spectral_norm != "none":
        raise ValueError(f"{type(config).__name__}: fpsa_spectral_norm={config.fpsa_spectral_norm!r} is not "
                         "supported by the decoder retrofits (it would change the pretrained W_Q/W_K); "
                         "allowed: 'none'.")


@dataclass
class FPSAStats:
    """Iteration statistics of every FPSA layer of one forward pass.

    Attributes:
        iterations_per_layer: per layer, ``(B, T, H)`` attention evaluations per token and head (the exact first step
            included); ``iterations`` stacks them to ``(L, B, T, H)``.
        converged_per_layer: per layer, ``(B, T, H)``: met ``fp_tol`` (tolerance halting) or halted before the cap
            (learned halting); ``converged`` stacks them.
        max_iter: the cap used.
        solves: per layer, the ``FixedPointStats`` of the solve (None for ``fp_max_iter=1`` and learned halting).
        token_mask: ``(B, T)`` bool, the real (non-padding) tokens the summaries count; None counts every token.
        ponder_cost_per_layer: per layer ``(B, T, H)`` ACT ponder cost ``N + R`` (learned halting only).
        jac_penalty_per_layer: per layer, the differentiable Jacobian penalty at the fixed point (training with
            ``fpsa_jac_weight > 0`` only): ``||J_f||_F^2 / n`` or ``relu(rho - target)^2`` (see ``fpsa_attention``).
        jac_rho_per_layer: per layer, the mean power-iteration spectral radius behind the spectral penalty.
    """

    iterations_per_layer: List[torch.Tensor] = field(default_factory=list)
    converged_per_layer: List[torch.Tensor] = field(default_factory=list)
    max_iter: int = 1
    solves: List[Optional[FixedPointStats]] = field(default_factory=list)
    token_mask: Optional[torch.Tensor] = None
    ponder_cost_per_layer: List[torch.Tensor] = field(default_factory=list)
    jac_penalty_per_layer: List[torch.Tensor] = field(default_factory=list)
    jac_rho_per_layer: List[torch.Tensor] = field(default_factory=list)

    _slots: dict = field(default_factory=dict, repr=False)

    def add(self, result: "FPSAResult", layer: Optional[nn.Module] = None) -> None:
        """Record one layer's result. A layer that runs again in the same pass (activation checkpointing recomputes
        it during backward) replaces its entry instead of adding one."""
        i = self._slots.get(id(layer)) if layer is not None else None
        if i is None:
            if layer is not None:
                self._slots[id(layer)] = len(self.iterations_per_layer)
            self.iterations_per_layer.append(result.iterations)
            self.converged_per_layer.append(result.converged)
            self.solves.append(result.stats)
            if result.ponder_cost is not None:
                self.ponder_cost_per_layer.append(result.ponder_cost)
            if result.jac_penalty is not None:
                self.jac_penalty_per_layer.append(result.jac_penalty)
            if result.jac_rho is not None:
                self.jac_rho_per_layer.append(result.jac_rho)
        else:
            self.iterations_per_layer[i], self.converged_per_layer[i] = result.iterations, result.converged
            self.solves[i] = result.stats
        self.max_iter = max(self.max_iter, result.max_iter)

    @classmethod
    def merge(cls, stats_list) -> "FPSAStats":
        """One ``FPSAStats`` over several forward passes (e.g. every evaluation batch) for whole-set summaries:
        each layer's real-token entries are flattened (batches differ in length), so use ``summary()`` / ``quantile``
        on the result, not ``iterations``."""
        stats_list = [s for s in stats_list if s is not None and s.iterations_per_layer]
        merged = cls(max_iter=max((s.max_iter for s in stats_list), default=1))
        for s in stats_list:
            m = s.token_mask.bool() if s.token_mask is not None else None
            for it, conv in zip(s.iterations_per_layer, s.converged_per_layer):
                merged.iterations_per_layer.append(it[m].flatten() if m is not None else it.flatten())
                merged.converged_per_layer.append(conv[m].flatten() if m is not None else conv.flatten())
        return merged

    @property
    def iterations(self) -> torch.Tensor:
        return torch.stack(self.iterations_per_layer)

    @property
    def converged(self) -> torch.Tensor:
        return torch.stack(self.converged_per_layer)

    @property
    def nfe(self) -> int:
        """Attention evaluations of the slowest layer (what the loop cost in wall-clock terms)."""
        return max((int(it.max()) for it in self.iterations_per_layer), default=0)

    @property
    def solver(self) -> Optional[str]:
        return next((s.solver for s in self.solves if s is not None), None)

    def _valid(self, per_layer: List[torch.Tensor]) -> torch.Tensor:
        """The entries of real tokens over every layer, flattened."""
        if self.token_mask is None:
            return torch.cat([t.flatten() for t in per_layer])
        m = self.token_mask.bool()
        return torch.cat([t[m].flatten() for t in per_layer])

    @property
    def all_converged(self) -> bool:
        return bool(self._valid(self.converged_per_layer).all())

    def quantile(self, q: float) -> float:
        """The ``q`` quantile (0..1) of iterations per (layer, token, head), padding excluded."""
        check_number(q, "q", low=0.0, high=1.0)
        return float(torch.quantile(self._valid(self.iterations_per_layer).double(), q))

    @property
    def median(self) -> float:
        return self.quantile(0.5)

    @property
    def cap_hit_rate(self) -> float:
        """Fraction of (layer, token, head) entries that ran to ``max_iter`` without converging."""
        its, conv = self._valid(self.iterations_per_layer), self._valid(self.converged_per_layer)
        return float(((its >= self.max_iter) & ~conv).double().mean())

    def mean_ponder_cost(self) -> torch.Tensor:
        """Mean ACT ponder cost over every layer's real (token, head) entries (differentiable; learned halting)."""
        if not self.ponder_cost_per_layer:
            raise ValueError("mean_ponder_cost needs the stats of a forward pass with fpsa_halting='learned'.")
        return self._valid(self.ponder_cost_per_layer).mean()

    def jac_penalty(self) -> Optional[torch.Tensor]:
        """Mean over layers of the Jacobian penalty ``||J_f||_F^2 / n`` (differentiable); None when not computed."""
        if not self.jac_penalty_per_layer:
            return None
        return torch.stack(self.jac_penalty_per_layer).mean()

    def summary(self) -> dict:
        """Plain floats for logging: mean / median / p90 / p99 iterations, cap-hit rate and converged fraction."""
        its = self._valid(self.iterations_per_layer).double()
        extra = {}
        if self.jac_rho_per_layer:
            extra = {"fpsa_jac_penalty": float(self.jac_penalty().detach()),
                     "fpsa_jac_rho": float(torch.stack(self.jac_rho_per_layer).mean())}
        elif self.jac_penalty_per_layer:
            extra = {"fpsa_jac_fro": float(self.jac_penalty().detach())}
        return {
            **extra,
            "fpsa_iter_mean": float(its.mean()),
            "fpsa_iter_median": self.quantile(0.5),
            "fpsa_iter_p90": self.quantile(0.9),
            "fpsa_iter_p99": self.quantile(0.99),
            "fpsa_iter_max": float(its.max()),
            "fpsa_cap_hit_rate": self.cap_hit_rate,
            "fpsa_converged_fraction": float(self._valid(self.converged_per_layer).double().mean()),
        }


@dataclass
class FPSAResult:
    """What ``fpsa_attention`` returns for one layer."""

    output: torch.Tensor  # (B, T, H * d): the heads' outputs at the fixed point, before W_O
    attn_weights: Optional[torch.Tensor]  # (B, H, T, T) at the fixed point, when asked for
    iterations: torch.Tensor  # (B, T, H)
    converged: torch.Tensor  # (B, T, H)
    max_iter: int
    stats: Optional[FixedPointStats] = None
    ponder_cost: Optional[torch.Tensor] = None  # (B, T, H), learned halting
    state: Optional[torch.Tensor] = None  # (B, T, D) final iterate Z (x after the exact first step alone), if asked
    jac_penalty: Optional[torch.Tensor] = None  # scalar Jacobian penalty at the fixed point, if asked
    jac_rho: Optional[torch.Tensor] = None  # mean power-iteration spectral radius (spectral penalty), detached


class FPSAHaltingGate(nn.Module):
    """FPSA-LH gate: per head, ``p = sigmoid(w_h . features + b_h)`` over ``HALT_FEATURES`` features.

    ``reset_parameters(budget)`` starts every head at a constant ``p = 1 / budget`` so that ACT halts after about
    ``budget`` steps before any training.
    """

    def __init__(self, num_heads: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(num_heads, HALT_FEATURES))
        self.bias = nn.Parameter(torch.zeros(num_heads))

    @torch.no_grad()
    def reset_parameters(self, budget: float) -> None:
        p = min(max(1.0 / budget, 1e-3), 1 - 1e-3)
        self.weight.zero_()
        self.bias.fill_(math.log(p / (1 - p)))

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """``features`` ``(B, T, H, F)`` -> halting probabilities ``(B, T, H)``."""
        return torch.sigmoid((features * self.weight.to(features.dtype)).sum(-1) + self.bias.to(features.dtype))


def _attention_entropy(weights: torch.Tensor) -> torch.Tensor:
    """``(B, H, T, S)`` attention probabilities -> ``(B, T, H)`` entropy, normalised by ``log S``."""
    ent = -torch.special.xlogy(weights, weights).sum(-1)
    return (ent / math.log(max(weights.shape[-1], 2))).transpose(1, 2)


def fpsa_attention(
    module: nn.Module,
    x: torch.Tensor,
    *,
    query: Callable,
    key: Callable,
    value: torch.Tensor,
    out_proj: Callable,
    attention_fn: Callable,
    scaling: float,
    fp_kwargs: dict,
    attention_mask: Optional[torch.Tensor] = None,
    residual: Optional[torch.Tensor] = None,
    norm: Optional[Callable] = None,
    extra: tuple = (),
    log_temperature: Optional[torch.Tensor] = None,
    update: str = "residual_norm",
    step_norm: str = "none",
    dropout: float = 0.0,
    adjoint_mask: bool = True,
    return_weights: bool = False,
    halting: str = "tolerance",
    halting_gate: Optional[FPSAHaltingGate] = None,
    halt_threshold: float = 0.99,
    margin_fn: Optional[Callable] = None,
    attention_kwargs: Optional[dict] = None,
    return_state: bool = False,
    jac_penalty: bool = False,
    halt_unit: str = "head",
    jac_norm: str = "frobenius",
    jac_target: float = 0.2,
) -> FPSAResult:
    """Run one FPSA layer.

    Args:
        module: the attention module handed to ``attention_fn`` (its ``training``, ``is_causal`` and, for GQA,
            ``num_key_value_groups`` are read there).
        x: ``(B, T, D)`` attention input, the initial iterate ``Z_0``.
        query: ``query(z, *extra) -> (B, H, T, d)``; apply position embeddings (RoPE) inside.
        key: ``key(z, *extra) -> (B, H_kv, T, d)``.
        value: ``(B, H_kv, T, d)``, computed once from ``x``.
        out_proj: ``W_O``: ``(B, T, H * d) -> (B, T, D)``.
        attention_fn: a transformers attention function (``ALL_ATTENTION_FUNCTIONS`` entry or a model's eager one):
            ``attention_fn(module, q, k, v, mask, dropout=, scaling=, **kw) -> ((B, T, H, d), weights)``.
        scaling: the softmax scale ``1 / sqrt(d)``; a learned temperature divides it per head.
        fp_kwargs: ``fixed_point`` keyword arguments (``fp_settings.fixed_point_kwargs``); ``max_iter`` counts the
            exact first step.
        attention_mask: passed to ``attention_fn`` unchanged (None, bool or additive float, causal or not).
        residual: ``R`` of the ``residual_norm`` form (default ``x``); ``norm``: its norm (default identity).
        extra: batch-first tensors for ``query``/``key`` (e.g. RoPE ``cos, sin``), sliced with the batch when the
            solver drops finished samples.
        log_temperature: ``(H,)`` log of the per-head temperature (None: 1).
        update, step_norm: see the module docstring.
        dropout: attention dropout of the exact first step; the inner iterations are deterministic so that the map
            has a fixed point.
        adjoint_mask: ``ift`` backward: keep the implicit term only for converged entries.
        return_weights: also return the attention weights at the fixed point (one extra evaluation).
        halting: ``tolerance`` or ``learned`` (then ``halting_gate`` is required).
        margin_fn: learned halting: ``margin_fn(z) -> (B, T, C)`` task-head logits of the current iterate ``z``;
            the feature is their top-2 margin.
        attention_kwargs: further keyword arguments for ``attention_fn``.
        return_state: also return the final iterate ``Z`` (``x`` when only the exact first step ran), e.g. for the
            keys a KV cache stores.
        jac_penalty: when gradients are enabled and the loop runs (``max_iter > 1``, tolerance halting), also return
            a differentiable Hutchinson estimate of ``||J_f||_F^2 / n`` of the FPSA map at the fixed point (one
            Gaussian probe; ``n`` the size of the iterate), the Jacobian regulariser of Bai et al. (2021) that
            ``fpsa_jac_weight`` adds to the loss to train the map towards a contraction; with
            ``jac_norm="spectral"`` instead the hinge ``mean_b relu(rho_b - jac_target)^2`` on each sample's spectral
            radius ``rho_b`` of ``J_f`` (``JAC_POWER_ITERS`` power-iteration VJPs from a random start; the gradient
            flows through the last one), which leaves every direction but the slowest free and bounds the per-step
            contraction, hence the iteration count, by the target.
        halt_unit: what converges and halts as one entry with ``halting="tolerance"``: ``head`` (each (token, head)
            pair, on the relative change of its own output) or ``token`` (the paper's per-token relative Frobenius
            change of the token's head outputs, all heads together). Iteration counts are reported per (token, head)
            either way.
    """
    check_choice(update, "fpsa_update", UPDATE_FORMS)
    check_choice(step_norm, "fpsa_step_norm", STEP_NORMS)
    check_choice(halting, "fpsa_halting", HALTING_MODES)
    check_choice(halt_unit, "fpsa_halt_unit", HALT_UNITS)
    check_choice(jac_norm, "fpsa_jac_norm", JAC_NORMS)
    attention_kwargs = dict(attention_kwargs or {})
    B, T, _ = x.shape
    residual = x if residual is None else residual

    def state(o, res):  # (..., H, d) head outputs -> (..., D) iterate
        z = out_proj(o.flatten(-2))
        if update == "residual_norm":
            z = res + z
            z = norm(z) if norm is not None else z
        return z

    inv_tau = None if log_temperature is None else torch.exp(-log_temperature).to(x.dtype)[None, :, None, None]

    def scaled_query(z, *ex):  # the learned per-head temperature divides the logits
        q = query(z, *ex)
        return q if inv_tau is None else q * inv_tau

    def attend(z, v, mask, ex, p=0.0):
        return attention_fn(module, scaled_query(z, *ex), key(z, *ex), v, mask, dropout=p, scaling=scaling,
                            **attention_kwargs)

    o1, w1 = attend(x, value, attention_mask, extra, dropout)  # the base model's attention, exactly
    max_iter = fp_kwargs["max_iter"]

    def step(o, res, v, mask, *ex):
        """One FPSA step and its attention weights."""
        new, weights = attend(state(o, res), v, mask, ex)
        return (o + torch.tanh(new - o) if step_norm == "tanh" else new), weights

    def f(o, *args):
        return step(o, *args)[0]

    # Encoder layers (every query and key a per-token function of the iterate, no extra inputs, not causal: attention
    # functions treat a module without ``is_causal = False`` as causal) let the forward solve skip converged tokens:
    # the solver passes the open entries and ``sparse_f`` recomputes the iterate, queries and keys of the tokens that
    # still have an open head only, reusing the cached keys of the others.
    sparse = halting == "tolerance" and not extra and max_iter > 1 and getattr(module, "is_causal", True) is False

    def attend_rows(q, k, v, mask):  # the loop's attention: no dropout, outputs only
        return attention_fn(module, q, k, v, mask, dropout=0.0, scaling=scaling, **attention_kwargs)[0]

    if halting == "learned":
        if halting_gate is None:
            raise ValueError("fpsa_halting='learned' needs a halting_gate.")
        return _learned_halting(step, state, o1, w1, (residual, value, attention_mask, *extra), max_iter,
                                halting_gate, halt_threshold, margin_fn)

    ones = torch.ones(B, T, o1.shape[2], dtype=torch.long, device=x.device)
    if max_iter == 1:
        o, solve_stats, iterations, converged = o1, None, ones, torch.zeros_like(ones, dtype=torch.bool)
    else:
        kw = dict(fp_kwargs)
        if halt_unit == "state":
            kw["residual_fn"] = _state_change(state)
        kw["max_iter"] = max_iter - 1
        kw["min_iter"] = max(kw.get("min_iter", 0) - 1, 0)
        if adjoint_mask and kw.get("backward") == "ift":
            kw["backward_kwargs"] = {**(kw.get("backward_kwargs") or {}), "mask": "converged"}
        if sparse:
            keys = torch.empty((B, value.shape[1], T, value.shape[-1]), dtype=value.dtype, device=value.device)
            stale = torch.ones(B, T, dtype=torch.bool, device=x.device)
            sparse_f = _open_tokens_map(state, scaled_query, key, attend_rows, step_norm)
            o, solve_stats = fixed_point(sparse_f, o1, args=(residual, value, attention_mask, keys, stale),
                                         batch_dims=3 if halt_unit == "head" else 2, compact=True, pass_active=True,
                                         **kw)
        else:
            o, solve_stats = fixed_point(f, o1, args=(residual, value, attention_mask, *extra),
                                         batch_dims=3 if halt_unit == "head" else 2, compact=True, **kw)
        nstep, converged = solve_stats.nstep, solve_stats.converged
        if halt_unit != "head":  # one entry per token: every head of it shares the count
            nstep, converged = nstep[..., None], converged[..., None].expand_as(ones)
        iterations = ones + nstep
    weights = w1 if max_iter == 1 else None
    if return_weights and max_iter > 1:
        _, weights = attend(state(o, residual), value, attention_mask, extra)
    final_state = None
    if return_state:
        final_state = x if max_iter == 1 else state(o, residual)
    penalty = rho = None
    if jac_penalty and max_iter > 1 and torch.is_grad_enabled():
        penalty, rho = _jacobian_penalty(f, o, (residual, value, attention_mask, *extra), jac_norm, jac_target)
    return FPSAResult(output=o.flatten(2), attn_weights=weights, iterations=iterations, converged=converged,
                      max_iter=max_iter, stats=solve_stats, state=final_state, jac_penalty=penalty, jac_rho=rho)


def _state_change(state):
    """``fpsa_halt_unit="state"``'s residual: per token, the relative l2 change ``||Z' - Z|| / ||Z'||`` of the iterate
    ``Z = state(O)`` that the queries and keys are computed from (the official code's per-token rule), where ``O' =
    f(O)``. The residual stream in ``Z`` makes it the change of what the layer hands on, not of one head's output."""

    def residual(fo, o, res, *_, active=None):
        if active is not None:  # the open tokens only (the solve ignores the others)
            out = torch.zeros(active.shape, dtype=torch.promote_types(fo.dtype, torch.float32), device=fo.device)
            out[active] = residual(fo[active], o[active], res[active])
            return out
        new, old = state(fo, res), state(o, res)
        acc = torch.promote_types(new.dtype, torch.float32)
        change = torch.linalg.vector_norm(new - old, dim=-1, dtype=acc)
        return change / (torch.linalg.vector_norm(new, dim=-1, dtype=acc) + 1e-9)

    return residual


def _jacobian_penalty(f, o, args, jac_norm, jac_target):
    """The differentiable Jacobian penalty of ``f(., *args)`` at the fixed point ``o`` and, for ``spectral``, the
    mean spectral radius (see ``fpsa_attention``'s ``jac_penalty``): ``(penalty, rho or None)``."""
    # The penalty's gradient is a double backward: SDPA's fused CPU/GPU kernels have none, its math one has.
    with sdpa_kernel(SDPBackend.MATH):
        if jac_norm == "frobenius":
            fro = jacobian_frobenius(lambda z: f(z, *args), o.detach(), batch_dims=0, create_graph=True)
            return fro / o.numel(), None
        rhos = spectral_radius(lambda z: f(z, *args), o.detach(), n_iter=JAC_POWER_ITERS, create_graph=True)
    return torch.relu(rhos - jac_target).square().mean(), rhos.detach().mean()


def _open_tokens_map(state, query, key, attend, step_norm):
    """The FPSA map of an encoder layer for a solve that passes the open entries (``active``): with every token open
    (or ``active=None``: the backward's own evaluations) it recomputes every token and, without gradients, caches
    the keys in ``keys``; otherwise only tokens with an open entry are recomputed (``_open_tokens_attention``)."""

    def sparse_f(o, res, v, mask, keys, stale, active=None):
        tokens = None if active is None else (active if active.dim() == 2 else active.any(-1))
        if tokens is None or bool(tokens.all()):
            z = state(o, res)
            k = key(z)
            if not torch.is_grad_enabled():  # the solve's own evaluations; a backward's keep their graph
                k = keys.copy_(k)
                stale.fill_(True)
            new = attend(query(z), k, v, mask)
        else:
            new = _open_tokens_attention(o, res, tokens, stale, v, mask, keys, state, query, key, attend)
        return o + torch.tanh(new - o) if step_norm == "tanh" else new

    return sparse_f


def _open_tokens_attention(o, res, tokens, stale, value, mask, keys, state, query, key, attend):
    """One FPSA step for the open tokens only.

    ``o`` ``(B, T, H, d)`` head outputs, ``res`` ``(B, T, D)`` the residual stream, ``tokens`` ``(B, T)`` the tokens
    with an open entry, ``stale`` ``(B, T)`` the tokens whose head outputs changed since ``keys`` ``(B, H, T, d)`` were
    computed (those open in the previous call: a token that converged then was set to its last image). Their keys are
    recomputed; the other tokens are frozen, so their cached keys are current. The open tokens' queries attend, per
    sample, to every key. Returns ``o`` with the open tokens' rows replaced, and marks them as the next call's stale.
    """
    z_stale = state(o[stale], res[stale])
    s_idx, u_idx = stale.nonzero(as_tuple=True)
    keys[s_idx, :, u_idx] = key(z_stale[None])[0].transpose(0, 1).to(keys.dtype)
    z_open = z_stale[tokens[stale]]  # open tokens are a subset of the stale ones: tokens never reopen
    stale.copy_(tokens)
    b_idx, t_idx = tokens.nonzero(as_tuple=True)
    # Pack each sample's open tokens into the rows of a (samples, most open tokens, D) block.
    samples, per_sample = torch.unique_consecutive(b_idx, return_counts=True)
    starts = torch.cumsum(per_sample, 0) - per_sample
    slot = torch.arange(b_idx.numel(), device=o.device) - torch.repeat_interleave(starts, per_sample)
    row = torch.repeat_interleave(torch.arange(samples.numel(), device=o.device), per_sample)
    width = int(per_sample.max())
    z_pad = z_open.new_zeros(samples.numel(), width, z_open.shape[-1])
    z_pad[row, slot] = z_open
    q = query(z_pad)
    if mask is not None:
        mask = mask[samples] if mask.shape[0] > 1 else mask.expand(samples.numel(), *mask.shape[1:])
        if mask.shape[-2] > 1:  # per-query rows: take each packed query's own row (padding rows repeat row 0)
            t_pad = torch.zeros(samples.numel(), width, dtype=torch.long, device=o.device)
            t_pad[row, slot] = t_idx
            index = t_pad[:, None, :, None].expand(-1, mask.shape[1], -1, mask.shape[-1])
            mask = torch.gather(mask, 2, index)
    out = attend(q, keys[samples], value[samples], mask)  # (samples, width, H, d)
    new = o.clone()
    new[b_idx, t_idx] = out[row, slot].to(o.dtype)
    return new


def _learned_halting(step, state, o1, w1, args, max_iter, gate, threshold, margin_fn):
    """FPSA-LH: ACT over the iterates; halted (token, head) entries are frozen."""
    residual = args[0]
    B, T, H, _ = o1.shape
    act = ACTAccumulator((B, T, H), max_steps=max_iter, threshold=threshold, device=o1.device, dtype=o1.dtype)
    o, weights, change = o1, w1, torch.ones(B, T, H, dtype=o1.dtype, device=o1.device)
    for k in range(max_iter):
        if k > 0:
            new, weights = step(o, *args)
            change = (new - o).norm(dim=-1) / (new.norm(dim=-1) + 1e-9)
            o = torch.where(act.halted[..., None], o, new)
        feats = [change.detach()]
        feats.append(_attention_entropy(weights.detach()) if weights is not None else torch.zeros_like(change))
        if margin_fn is not None:
            with torch.no_grad():
                logits = margin_fn(state(o, residual))
            top2 = logits.topk(min(2, logits.shape[-1]), dim=-1).values
            margin = top2[..., 0] - top2[..., -1]  # zero for a single logit
            feats.append(margin[..., None].expand(B, T, H).to(o.dtype))
        else:
            feats.append(torch.zeros_like(change))
        act.update(gate(torch.stack(feats, -1)), o)
        if act.all_halted:
            break
    converged = act.halted & (act.n_updates < max_iter)
    return FPSAResult(output=act.output.flatten(2), attn_weights=weights, iterations=act.n_updates.long(),
                      converged=converged, max_iter=max_iter, ponder_cost=act.ponder_cost)


def fpsa_decoder_attention(
    module: nn.Module,
    hidden_states: torch.Tensor,
    *,
    position_embeddings,
    rope: Callable,
    attention_fn: Callable,
    fp_kwargs: dict,
    attention_mask: Optional[torch.Tensor] = None,
    cache=None,
    residual: Optional[torch.Tensor] = None,
    norm: Optional[Callable] = None,
    log_temperature: Optional[torch.Tensor] = None,
    update: str = "residual_norm",
    step_norm: str = "none",
    adjoint_mask: bool = True,
    return_weights: bool = False,
    attention_kwargs: Optional[dict] = None,
    jac_penalty: bool = False,
    halt_unit: str = "head",
    jac_norm: str = "frobenius",
    jac_target: float = 0.2,
):
    """Causal FPSA in one layer of a pretrained decoder (SELF-LLaMA / SELF-Mistral), with an optional KV cache.

    ``module`` is the decoder's own attention module (``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``, ``head_dim``,
    ``scaling``, ``layer_idx``, ``attention_dropout``); ``rope(t, cos, sin)`` applies the rotary embedding to
    ``(B, H, T, d)`` heads. Queries and keys of the new tokens are recomputed from the iterate with RoPE, values are
    static (``V = X W_V``), the causal / padding / sliding-window mask is used in every iteration, and GQA goes
    through ``module.num_key_value_groups`` inside ``attention_fn``.

    KV cache (``cache``: a transformers ``DynamicCache``; only ``update(k, v, layer_idx)`` and
    ``layers[layer_idx].keys`` are used): earlier tokens' keys are their converged keys and are not iterated again;
    the new tokens iterate against them, and once they have converged the keys of their final iterate (``K(x)`` when
    ``fp_max_iter=1``, so that one step is exactly the base model) replace placeholders written before the solve.
    Because earlier tokens never attend to later ones, this is the same fixed point that a full recomputation finds:
    where the solves converge, cached and uncached forwards agree to within the solver tolerance (exactly for
    ``fp_max_iter=1``). Entries stopped at the cap unconverged have no fixed point to agree on: there the cached keys
    (of the last iterate) and a full recomputation's differ, and greedy tokens can diverge.

    Returns ``(output, result)``: the attention block's output after ``o_proj`` ``(B, T, D)`` and the ``FPSAResult``.
    """
    B, T, _ = hidden_states.shape
    head_dim = module.head_dim

    def heads(t):  # (b, t, H * d) -> (b, H, t, d)
        return t.view(*t.shape[:-1], -1, head_dim).transpose(1, 2)

    cos, sin = position_embeddings
    cos, sin = cos.expand(B, *cos.shape[1:]), sin.expand(B, *sin.shape[1:])  # batch-first for the compact solver
    value = heads(module.v_proj(hidden_states))
    past_key = None
    if cache is not None:
        # Write the new values and placeholder keys now; the cache returns what the mask was built for (earlier
        # tokens, possibly cut to a sliding window, then the new ones).
        keys, values = cache.update(torch.zeros_like(value), value.detach(), module.layer_idx)
        n_past = keys.shape[-2] - T
        if n_past > 0:
            past_key = keys[:, :, :n_past]
            if torch.is_grad_enabled():  # the placeholders are overwritten in place below
                past_key = past_key.clone()
            value = torch.cat([values[:, :, :n_past], value], dim=2)

    def query(z, c, s, *past):
        return rope(heads(module.q_proj(z)), c, s)

    def key(z, c, s, *past):
        k = rope(heads(module.k_proj(z)), c, s)
        return torch.cat([past[0], k], dim=2) if past else k

    result = fpsa_attention(
        module, hidden_states, query=query, key=key, value=value, out_proj=module.o_proj,
        attention_fn=attention_fn, scaling=module.scaling, fp_kwargs=fp_kwargs, attention_mask=attention_mask,
        residual=residual, norm=norm, extra=(cos, sin) + ((past_key,) if past_key is not None else ()),
        log_temperature=log_temperature, update=update, step_norm=step_norm,
        dropout=module.attention_dropout if module.training else 0.0, adjoint_mask=adjoint_mask,
        return_weights=return_weights, attention_kwargs=attention_kwargs, return_state=cache is not None,
        jac_penalty=jac_penalty, halt_unit=halt_unit, jac_norm=jac_norm, jac_target=jac_target,
    )
    if cache is not None:
        with torch.no_grad():
            final_key = rope(heads(module.k_proj(result.state)), cos, sin)
            stored = cache.layers[module.layer_idx].keys
            n = min(T, stored.shape[-2])
            stored[:, :, stored.shape[-2] - n:] = final_key[:, :, T - n:].to(stored.dtype)
    return module.o_proj(result.output), result


def with_jac_penalty(output, stats: FPSAStats, weight: float):
    """Add ``weight *`` the mean per-layer Jacobian penalty to ``output.loss`` (when both exist); return ``output``."""
    penalty = stats.jac_penalty()
    if output.loss is not None and penalty is not None and weight > 0:
        output.loss = output.loss + weight * penalty.to(output.loss.dtype)
    return output


def ponder_loss(stats: FPSAStats, budget: float, weight: float) -> torch.Tensor:
    """``weight * relu(mean ponder cost - budget)`` (FPSA-LH): no cost while the model stays within its budget."""
    return weight * torch.relu(stats.mean_ponder_cost() - budget)


def apply_spectral_norm(linears) -> None:
    """Spectral-normalise the weights of ``linears`` in place (torch parametrization; ``remove_spectral_norm`` folds
    them back into plain weights for export)."""
    for lin in linears:
        torch.nn.utils.parametrizations.spectral_norm(lin)


@torch.no_grad()
def warm_up_spectral_norm(module: nn.Module, n_iter: int = 15) -> None:
    """Restart the power iteration of every spectral-norm parametrization under ``module`` from a fixed start vector.

    Its ``_u``/``_v`` are buffers that a plain checkpoint lacks (``from_pretrained`` leaves them uninitialised);
    ``eval()`` mode uses them as they are, so they must match the loaded weight before the first forward pass.
    """
    for mod in module.modules():
        if not torch.nn.utils.parametrize.is_parametrized(mod, "weight"):
            continue
        for p in mod.parametrizations.weight:
            if hasattr(p, "_power_method"):
                w = p._reshape_weight_to_matrix(mod.parametrizations.weight.original)
                p._v.copy_(nn.functional.normalize(torch.ones_like(p._v), dim=0, eps=p.eps))  # deterministic start
                p._u.copy_(nn.functional.normalize(w @ p._v, dim=0, eps=p.eps))
                p._power_method(w, n_iter)


def init_fpsa_weights(model: nn.Module, module: nn.Module) -> None:
    """The FPSA part of a model's ``_init_weights``: temperature 1, halting gate at the ponder budget, and a fresh
    power iteration for spectral-norm vectors a checkpoint lacked (``from_pretrained`` calls it after loading)."""
    if isinstance(getattr(module, "fpsa_log_tau", None), nn.Parameter):
        module.fpsa_log_tau.zero_()  # tau = 1: the base model's softmax scale
    elif isinstance(module, FPSAHaltingGate):
        module.reset_parameters(model.config.fpsa_ponder_budget)
    elif type(module).__name__ == "_SpectralNorm":
        owner = next(m for m in model.modules()
                     if any(p is module for p in getattr(getattr(m, "parametrizations", {}), "weight", ())))
        warm_up_spectral_norm(owner)


class FPSAStatsSink:
    """What an FPSA model hands its layers (``fpsa_stats=``) in place of its ``FPSAStats``: ``add`` records into that
    ``FPSAStats``, and the sink is not a dataclass. Engines that rebuild the dataclasses found in a module's inputs to
    hook the tensors inside them (FSDP2 does, to register its post-backward hook on each sharded layer) would otherwise
    hand every layer a copy once a recorded Jacobian penalty (a tensor that requires grad) is inside, and the later
    layers' results would land in the copies."""

    __slots__ = ("stats",)

    def __init__(self, stats: FPSAStats):
        self.stats = stats

    def add(self, result: "FPSAResult", layer: Optional[nn.Module] = None) -> None:
        self.stats.add(result, layer=layer)


class FPSAHeadMixin:
    """Put before a transformers head class (``BertForX``, ``ViTForX``) whose base model is an FPSA model: runs the
    head's own ``forward`` with an ``FPSAStats`` threaded through the base model, returns ``output_class`` (the head's
    output plus ``fp_stats``) and, with learned halting, adds the ponder loss to the task loss."""

    output_class = None

    def __init_subclass__(cls, **kwargs):
        # Trainer(remove_unused_columns=True) and generate() keep only the inputs named in forward's signature: give
        # each head a forward whose signature is the transformers head's own plus the per-call knobs.
        import inspect

        super().__init_subclass__(**kwargs)
        if "forward" in cls.__dict__:
            return
        head = inspect.signature(super(FPSAHeadMixin, cls).forward)
        params = [p for p in head.parameters.values() if p.kind != p.VAR_KEYWORD]
        params += [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=None, annotation=annotation)
                   for name, annotation in (("fp_max_iter", Optional[int]), ("fp_tol", Optional[float]),
                                            ("fp_overrides", Optional[dict]))]
        params += [p for p in head.parameters.values() if p.kind == p.VAR_KEYWORD]

        def forward(self, *args, **kwargs):
            return FPSAHeadMixin.forward(self, *args, **kwargs)

        forward.__signature__ = head.replace(parameters=params, return_annotation=cls.output_class)
        forward.__doc__ = FPSAHeadMixin.forward.__doc__
        forward.__qualname__ = f"{cls.__qualname__}.forward"
        cls.forward = forward

    def fpsa_margin_fn(self) -> Optional[Callable]:
        """Learned halting: the task head applied to an iterate, for the logit-margin feature (None: no margin)."""
        return None

    def forward(self, *args, fp_max_iter: Optional[int] = None, fp_tol: Optional[float] = None,
                fp_overrides: Optional[dict] = None, **kwargs):
        """The transformers head's ``forward`` with the per-call fixed-point knobs (``fp_max_iter``, ``fp_tol``, any
        other ``fp_*`` setting as a keyword, or ``fp_overrides={...}``); the output adds ``fp_stats``.
        ``return_dict=False`` (or ``config.return_dict=False``) gives a tuple."""
        fp_overrides = call_knobs(self.config, kwargs, type(self).__name__, fp_overrides, fp_max_iter, fp_tol)
        stats = FPSAStats()
        learned = self.config.fpsa_halting == "learned"
        if learned and self.fpsa_margin_fn() is not None:
            kwargs["fpsa_margin_fn"] = self.fpsa_margin_fn()
        return_dict = kwargs.pop("return_dict", None)
        return_dict = getattr(self.config, "return_dict", True) if return_dict is None else return_dict
        kwargs["return_dict"] = True
        out = self.output_class(**super().forward(*args, fp_overrides=fp_overrides, fpsa_stats=stats, **kwargs),
                                fp_stats=stats)
        if out.loss is not None and learned:
            out.loss = out.loss + ponder_loss(stats, self.config.fpsa_ponder_budget, self.config.fpsa_ponder_weight)
        out = with_jac_penalty(out, stats, self.config.fpsa_jac_weight)
        return out if return_dict else out.to_tuple()


def remove_spectral_norm(model: nn.Module) -> None:
    """Fold every spectral-norm parametrization of ``model`` into a plain weight (the value used in ``eval()``) and
    record it in ``model.config.fpsa_spectral_norm`` so the saved checkpoint is a plain one."""
    was_training = model.training
    model.eval()
    for mod in list(model.modules()):
        if torch.nn.utils.parametrize.is_parametrized(mod, "weight"):
            torch.nn.utils.parametrize.remove_parametrizations(mod, "weight", leave_parametrized=True)
    model.train(was_training)
    if hasattr(getattr(model, "config", None), "fpsa_spectral_norm"):
        model.config.fpsa_spectral_norm = "none"


__all__ = [
    "FPSA_DEFAULTS",
    "FPSA_FP_DEFAULTS",
    "HALTING_MODES",
    "HALT_UNITS",
    "JAC_NORMS",
    "SPECTRAL_NORMS",
    "STEP_NORMS",
    "UPDATE_FORMS",
    "FPSAHaltingGate",
    "FPSAHeadMixin",
    "FPSAResult",
    "FPSAStats",
    "FPSAStatsSink",
    "apply_spectral_norm",
    "check_decoder_fpsa",
    "check_fpsa_settings",
    "check_heads",
    "fpsa_attention",
    "fpsa_decoder_attention",
    "init_fpsa_weights",
    "ponder_loss",
    "pop_fpsa_kwargs",
    "remove_spectral_norm",
    "retrofit_config_dict",
    "warm_up_spectral_norm",
    "with_jac_penalty",
]
