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

``fpsa_update_scale`` (``update_scale``, in (0, 1], default 1) re-injects a share ``beta`` of the heads' output:
``Z = norm(R + beta W_O O)`` (``plain``: ``Z = beta W_O O``). It leaves the exact first step alone and shrinks the
map's Jacobian with ``beta``. In the pre-norm models (ViT, LLaMA, Mistral: ``x = norm(R)``) it also moves the fixed
point toward the base model's attention, which it reaches as ``beta -> 0`` (the iterate is then ``x`` itself): a
retrofit-strength knob for pretrained decoders.

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
from dataclasses import dataclass, fields
from typing import Callable, Optional

import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from .fp_backward import fixed_point
from .fp_compat import is_static_layer
from .fp_fpsa_settings import HALT_UNITS, HALTING_MODES, JAC_NORMS, STEP_NORMS, UPDATE_FORMS
from .fp_fpsa_stats import FPSAResult
from .fp_halting import ACTAccumulator
from .fp_jacobian import jacobian_frobenius, spectral_radius
from .fp_registry import check_choice, check_number

JAC_POWER_ITERS = 6  # power-iteration products per layer and step of the spectral penalty (random start each step)
HALT_FEATURES = 3  # relative latent change, attention entropy, task-head logit margin
# Encoder solves: an evaluation recomputes every token (the dense map) while at least this share of the working tokens
# is open, else the open ones only (``_open_tokens_attention``: ~15 small indexing ops and host syncs per call). One
# evaluation, open-token path over dense map (``python -m benchmarks.bench_fpsa --dispatch``, one thread, CPU time;
# docs/fpsa.md "Latency"): 0.76-0.83x at half the tokens open at MiniLM's shape (T=64/128, D=384, batch 4), 1.07-1.10x
# at 75% (crossover ~0.6-0.75), but 1.33x at half open at FPSA-ViT digits' (T=17, D=64, batch 128; crossover ~0.2).
# No-grad forward against every evaluation dense, this rule / the previous one (dense only with every token open):
# MiniLM FPSA-BERT 0.91x / 0.92x, FPSA-ViT digits 1.03x / 1.11x.
DENSE_OPEN_FRACTION = 0.5


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


@dataclass(frozen=True)
class FPSAOptions:
    """How one FPSA layer call iterates, halts, regularises and what it returns (``fpsa_attention``'s options; a
    model builds them from its ``fpsa_*`` settings). Every field is validated; errors name the ``fpsa_*`` setting.

    Attributes:
        update, step_norm: the iterate's form (``residual_norm`` | ``plain``) and step (``none`` | ``tanh``); see the
            module docstring. ``update_scale``: the share ``beta`` of ``W_O O`` the iterate re-injects, in (0, 1].
        dropout: attention dropout of the exact first step; the inner iterations are deterministic so that the map
            has a fixed point.
        adjoint_mask: ``ift`` backward: keep the implicit term only for converged entries.
        return_weights: also return the attention weights at the fixed point (one extra evaluation).
        halting: ``tolerance`` or ``learned`` (FPSA-LH; needs ``fpsa_attention``'s ``halting_gate``);
            ``halt_threshold``: learned halting's ACT threshold.
        halt_unit: what converges and halts as one entry with ``halting="tolerance"``: ``head`` (each (token, head)
            pair, on the relative change of its own output), ``token`` (the relative Frobenius change of all the
            token's head outputs) or ``state`` (each token on the relative change of its iterate ``Z``, what its next
            queries and keys are computed from: the official code's rule). Counts are reported per (token, head).
        return_state: also return the final iterate ``Z`` (``x`` when only the exact first step ran), e.g. for the
            keys a KV cache stores.
        jac_penalty: when gradients are enabled and the loop runs, also return the differentiable Jacobian penalty of
            the map at the fixed point (``jac_norm``: ``frobenius`` or ``spectral`` with ``jac_target``; see
            ``_jacobian_penalty``), which ``fpsa_jac_weight`` adds to the loss to train the map to contract.
    """

    update: str = "residual_norm"
    update_scale: float = 1.0
    step_norm: str = "none"
    dropout: float = 0.0
    adjoint_mask: bool = True
    return_weights: bool = False
    halting: str = "tolerance"
    halt_threshold: float = 0.99
    halt_unit: str = "head"
    return_state: bool = False
    jac_penalty: bool = False
    jac_norm: str = "frobenius"
    jac_target: float = 0.2

    def __post_init__(self):
        for name, allowed in (("update", UPDATE_FORMS), ("step_norm", STEP_NORMS), ("halting", HALTING_MODES),
                              ("halt_unit", HALT_UNITS), ("jac_norm", JAC_NORMS)):
            check_choice(getattr(self, name), "fpsa_" + name, allowed)
        check_number(self.update_scale, "fpsa_update_scale", low=0.0, high=1.0, low_open=True)

    @classmethod
    def from_config(cls, config, **changes) -> "FPSAOptions":
        """The options a model's ``fpsa_*`` settings give (the penalty on when ``fpsa_jac_weight > 0``), with
        per-call ``changes`` (``dropout``, ``return_weights``, ...)."""
        base = cls(update=config.fpsa_update, update_scale=config.fpsa_update_scale, step_norm=config.fpsa_step_norm,
                   adjoint_mask=config.fpsa_adjoint_mask,
                   halting=config.fpsa_halting, halt_threshold=config.fpsa_halt_threshold,
                   halt_unit=config.fpsa_halt_unit, jac_penalty=config.fpsa_jac_weight > 0,
                   jac_norm=config.fpsa_jac_norm, jac_target=config.fpsa_jac_target)
        return cls.resolve(base, **changes)

    @classmethod
    def resolve(cls, options: Optional["FPSAOptions"] = None, **changes) -> "FPSAOptions":
        """``options`` (default ``FPSAOptions()``) with keyword ``changes``; an unknown name is a ValueError."""
        if not changes:  # nothing to re-validate
            return options or cls()
        unknown = set(changes) - set(FPSA_OPTION_NAMES)
        if unknown:
            raise ValueError(f"Unknown FPSA option(s) {sorted(unknown)}; allowed: {list(FPSA_OPTION_NAMES)}.")
        base = options or cls()
        # Not dataclasses.replace: torch.compile cannot trace dataclasses.fields() of a class (a graph break).
        return cls(**{name: changes[name] if name in changes else getattr(base, name) for name in FPSA_OPTION_NAMES})


FPSA_OPTION_NAMES = tuple(f.name for f in fields(FPSAOptions))


class _LayerMap:
    """The FPSA map of one layer call: the iterate ``state(O)``, the temperature-scaled attention and one step."""

    def __init__(self, module, query, key, out_proj, norm, attention_fn, scaling, attention_kwargs, log_temperature,
                 options: FPSAOptions, dtype):
        self.module, self.query, self.key, self.out_proj, self.norm = module, query, key, out_proj, norm
        self.attention_fn, self.scaling, self.attention_kwargs = attention_fn, scaling, dict(attention_kwargs or {})
        self.update, self.update_scale, self.step_norm = options.update, options.update_scale, options.step_norm
        self.inv_tau = None if log_temperature is None else torch.exp(-log_temperature).to(dtype)[None, :, None, None]

    def state(self, o, res):  # (..., H, d) head outputs -> (..., D) iterate
        z = self.out_proj(o.flatten(-2))
        if self.update_scale != 1.0:
            z = self.update_scale * z
        if self.update == "residual_norm":
            z = res + z
            z = self.norm(z) if self.norm is not None else z
        return z

    def scaled_query(self, z, *ex):  # the learned per-head temperature divides the logits
        q = self.query(z, *ex)
        return q if self.inv_tau is None else q * self.inv_tau

    def attend(self, z, v, mask, ex, p=0.0):
        return self.attention_fn(self.module, self.scaled_query(z, *ex), self.key(z, *ex), v, mask, dropout=p,
                                 scaling=self.scaling, **self.attention_kwargs)

    def attend_rows(self, q, k, v, mask):  # the loop's attention: no dropout, outputs only
        return self.attention_fn(self.module, q, k, v, mask, dropout=0.0, scaling=self.scaling,
                                 **self.attention_kwargs)[0]

    def step(self, o, res, v, mask, *ex):
        """One FPSA step and its attention weights."""
        new, weights = self.attend(self.state(o, res), v, mask, ex)
        return (o + torch.tanh(new - o) if self.step_norm == "tanh" else new), weights

    def f(self, o, *args):
        return self.step(o, *args)[0]


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
    attention_kwargs: Optional[dict] = None,
    halting_gate: Optional[FPSAHaltingGate] = None,
    margin_fn: Optional[Callable] = None,
    options: Optional[FPSAOptions] = None,
    **option_changes,
) -> FPSAResult:
    """Run one FPSA layer.

    Args:
        module: the attention module handed to ``attention_fn`` (its ``training``, ``is_causal`` and, for GQA,
            ``num_key_value_groups`` are read there).
        x: ``(B, T, D)`` attention input, the initial iterate ``Z_0``.
        query, key: ``query(z, *extra) -> (B, H, T, d)``, ``key(z, *extra) -> (B, H_kv, T, d)`` (RoPE inside).
        value: ``(B, H_kv, T, d)``, computed once from ``x``; ``out_proj``: ``W_O``, ``(B, T, H * d) -> (B, T, D)``.
        attention_fn: a transformers attention function (``ALL_ATTENTION_FUNCTIONS`` entry or a model's eager one):
            ``attention_fn(module, q, k, v, mask, dropout=, scaling=, **attention_kwargs) -> ((B, T, H, d), w)``.
        scaling: the softmax scale ``1 / sqrt(d)``; ``log_temperature`` (``(H,)``, None: 1) divides it per head.
        fp_kwargs: ``fixed_point`` keyword arguments (``fp_settings.fixed_point_kwargs``); ``max_iter`` counts the
            exact first step.
        attention_mask: passed to ``attention_fn`` unchanged (None, bool or additive float, causal or not).
        residual: ``R`` of the ``residual_norm`` form (default ``x``); ``norm``: its norm (default identity).
        extra: batch-first tensors for ``query``/``key`` (e.g. RoPE ``cos, sin``), sliced with the batch when the
            solver drops finished samples.
        halting_gate, margin_fn: learned halting's gate, and ``margin_fn(z) -> (B, T, C)`` the task head's logits of
            an iterate (the feature is their top-2 margin).
        options, **option_changes: an ``FPSAOptions`` and/or its fields as keywords (``halt_unit="state"``, ...).
    """
    opts = FPSAOptions.resolve(options, **option_changes)
    residual = x if residual is None else residual
    fmap = _LayerMap(module, query, key, out_proj, norm, attention_fn, scaling, attention_kwargs, log_temperature,
                     opts, x.dtype)
    args = (residual, value, attention_mask, *extra)
    o1, w1 = fmap.attend(x, value, attention_mask, extra, opts.dropout)  # the base model's attention, exactly
    max_iter = fp_kwargs["max_iter"]
    if opts.halting == "learned":
        if halting_gate is None:
            raise ValueError("fpsa_halting='learned' needs a halting_gate.")
        return _learned_halting(fmap.step, fmap.state, o1, w1, args, max_iter, halting_gate, opts.halt_threshold,
                                margin_fn)
    jac = {}
    hook = None
    if opts.jac_penalty and max_iter > 1 and torch.is_grad_enabled():
        def hook(h, fh):  # the penalty shares the backward's evaluation of the map at the fixed point
            jac["penalty"] = _jacobian_penalty(h, fh, opts.jac_norm, opts.jac_target)
    o, solve_stats, iterations, converged = _tolerance_solve(fmap, o1, args, fp_kwargs, opts, hook)
    weights = w1 if max_iter == 1 else None
    if opts.return_weights and max_iter > 1:
        _, weights = fmap.attend(fmap.state(o, residual), value, attention_mask, extra)
    final_state = (x if max_iter == 1 else fmap.state(o, residual)) if opts.return_state else None
    penalty, rho = jac.get("penalty", (None, None))
    return FPSAResult(output=o.flatten(2), attn_weights=weights, iterations=iterations, converged=converged,
                      max_iter=max_iter, stats=solve_stats, state=final_state, jac_penalty=penalty, jac_rho=rho)


def _tolerance_solve(fmap: _LayerMap, o1, args, fp_kwargs, opts: FPSAOptions, hook=None):
    """The loop after the exact first step ``o1``: ``(o, solve stats, iterations, converged)``, counts per (token,
    head) with the first step included. ``hook``: ``fixed_point``'s ``evaluation_hook`` (the Jacobian penalty); its
    evaluation of the map runs on the math attention kernel (``_math_attention``)."""
    B, T, H = o1.shape[:3]
    ones = torch.ones(B, T, H, dtype=torch.long, device=o1.device)
    max_iter = fp_kwargs["max_iter"]
    if max_iter == 1:
        return o1, None, ones, torch.zeros_like(ones, dtype=torch.bool)
    kw = dict(fp_kwargs, max_iter=max_iter - 1, min_iter=max(fp_kwargs.get("min_iter", 0) - 1, 0))
    if opts.halt_unit == "state":
        kw["residual_fn"] = _state_change(fmap.state)
    if hook is not None:
        kw.update(evaluation_hook=hook, evaluation_context=_math_attention)
    if opts.adjoint_mask and kw.get("backward") == "ift":
        kw["backward_kwargs"] = {**(kw.get("backward_kwargs") or {}), "mask": "converged"}
    batch_dims = 3 if opts.halt_unit == "head" else 2
    residual, value, mask, *extra = args
    # Encoder layers (every query and key a per-token function of the iterate, no extra inputs, not causal: attention
    # functions treat a module without ``is_causal = False`` as causal) let the forward solve skip converged tokens:
    # the solver passes the open entries and ``sparse_f`` recomputes the iterate, queries and keys of the tokens that
    # still have an open head only, reusing the cached keys of the others. That needs the host to pick the tokens:
    # a solve that checks less often than every step (``check_every != 1``) recomputes every token instead.
    if not extra and getattr(fmap.module, "is_causal", True) is False and kw.get("check_every", 1) == 1:
        keys = torch.empty((B, value.shape[1], T, value.shape[-1]), dtype=value.dtype, device=value.device)
        stale = torch.ones(B, T, dtype=torch.bool, device=o1.device)
        sparse_f = _open_tokens_map(fmap.state, fmap.scaled_query, fmap.key, fmap.attend_rows, fmap.step_norm)
        o, stats = fixed_point(sparse_f, o1, args=(residual, value, mask, keys, stale), batch_dims=batch_dims,
                               compact=True, pass_active=True, **kw)
    else:
        o, stats = fixed_point(fmap.f, o1, args=args, batch_dims=batch_dims, compact=True, **kw)
    nstep, converged = stats.nstep, stats.converged
    if opts.halt_unit != "head":  # one entry per token: every head of it shares the count
        nstep, converged = nstep[..., None], converged[..., None].expand_as(ones)
    return o, stats, ones + nstep, converged


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


def _math_attention():
    """The context of the evaluation the Jacobian penalty differentiates twice: SDPA's fused CPU/GPU kernels have no
    double backward, its math one has. The solve's own evaluations and the other backward modes' unrolls keep the
    fused kernels."""
    return sdpa_kernel(SDPBackend.MATH)


def _jacobian_penalty(h, fh, jac_norm, jac_target):
    """The differentiable Jacobian penalty of the map at the fixed point ``h`` from its evaluation ``fh = f(h)``
    (with a graph) and, for ``spectral``, the mean spectral radius (see ``fpsa_attention``'s ``jac_penalty``):
    ``(penalty, rho or None)``."""
    if jac_norm == "frobenius":
        fro = jacobian_frobenius(None, h, batch_dims=0, create_graph=True, fz=fh)
        return fro / h.numel(), None
    rhos = spectral_radius(None, h, n_iter=JAC_POWER_ITERS, create_graph=True, fz=fh)
    return torch.relu(rhos - jac_target).square().mean(), rhos.detach().mean()


def _open_tokens_map(state, query, key, attend, step_norm):
    """The FPSA map of an encoder layer for a solve that passes the open entries (``active``): with at least
    ``DENSE_OPEN_FRACTION`` of the tokens open (or ``active=None``: every entry open, or the backward's own
    evaluations) it recomputes every token and, without gradients, caches the keys in ``keys``; otherwise only tokens
    with an open entry are recomputed (``_open_tokens_attention``)."""

    def sparse_f(o, res, v, mask, keys, stale, active=None):
        tokens = None if active is None else (active if active.dim() == 2 else active.any(-1))
        if tokens is None or int(tokens.sum()) >= DENSE_OPEN_FRACTION * tokens.numel():
            # Every token recomputed; the frozen ones' images are ignored by the solver, which holds their values.
            z = state(o, res)
            k = key(z)
            if not torch.is_grad_enabled():  # the solve's own evaluations; a backward's keep their graph
                k = keys.copy_(k)  # current for every token; the open ones change in this step
                if tokens is None:
                    stale.fill_(True)
                else:  # the next call's stale tokens: those whose values change in this step
                    stale.copy_(tokens)
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
    every = samples.numel() == o.shape[0]  # every sample has an open token: no need to gather the samples' rows
    if mask is not None:
        if mask.shape[0] == 1:
            mask = mask.expand(samples.numel(), *mask.shape[1:])
        elif not every:
            mask = mask[samples]
        if mask.shape[-2] > 1:  # per-query rows: take each packed query's own row (padding rows repeat row 0)
            t_pad = torch.zeros(samples.numel(), width, dtype=torch.long, device=o.device)
            t_pad[row, slot] = t_idx
            index = t_pad[:, None, :, None].expand(-1, mask.shape[1], -1, mask.shape[-1])
            mask = torch.gather(mask, 2, index)
    if not every:
        keys, value = keys[samples], value[samples]
    out = attend(q, keys, value, mask)  # (samples, width, H, d)
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
    attention_kwargs: Optional[dict] = None,
    options: Optional[FPSAOptions] = None,
    **option_changes,
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

    ``residual``, ``norm``, ``log_temperature``, ``attention_kwargs``, ``options`` and ``**option_changes`` are
    ``fpsa_attention``'s (``dropout`` is the module's attention dropout in training, ``return_state`` is set with a
    cache). Returns ``(output, result)``: the block's output after ``o_proj`` ``(B, T, D)`` and the ``FPSAResult``.
    """
    B, T, _ = hidden_states.shape
    head_dim = module.head_dim

    def heads(t):  # (b, t, H * d) -> (b, H, t, d)
        return t.view(*t.shape[:-1], -1, head_dim).transpose(1, 2)

    cos, sin = position_embeddings
    cos, sin = cos.expand(B, *cos.shape[1:]), sin.expand(B, *sin.shape[1:])  # batch-first for the compact solver
    value = heads(module.v_proj(hidden_states))
    past_key = slots = None
    if cache is not None:
        # Write the new values and placeholder keys now; the cache returns what the mask was built for (earlier
        # tokens, possibly cut to a sliding window, then the new ones; a static cache: its whole buffer).
        keys, values = cache.update(torch.zeros_like(value), value.detach(), module.layer_idx)
        slots = _static_slots(cache.layers[module.layer_idx], T)
        n_past = keys.shape[-2] - T
        if slots is not None or n_past > 0:
            past_key = keys if slots is not None else keys[:, :, :n_past]
            if torch.is_grad_enabled():  # the placeholders are overwritten in place below
                past_key = past_key.clone()
            value = values if slots is not None else torch.cat([values[:, :, :n_past], value], dim=2)

    def query(z, c, s, *past):
        return rope(heads(module.q_proj(z)), c, s)

    def key(z, c, s, *past):
        k = rope(heads(module.k_proj(z)), c, s)
        if not past:
            return k
        return torch.cat([past[0], k], dim=2) if slots is None else past[0].index_copy(2, slots, k.to(past[0].dtype))

    opts = FPSAOptions.resolve(options, **option_changes, dropout=module.attention_dropout if module.training else 0.0,
                               return_state=cache is not None)
    result = fpsa_attention(
        module, hidden_states, query=query, key=key, value=value, out_proj=module.o_proj,
        attention_fn=attention_fn, scaling=module.scaling, fp_kwargs=fp_kwargs, attention_mask=attention_mask,
        residual=residual, norm=norm, extra=(cos, sin) + ((past_key,) if past_key is not None else ()),
        log_temperature=log_temperature, attention_kwargs=attention_kwargs, options=opts)
    if cache is not None:
        _store_converged_keys(cache, module, lambda: rope(heads(module.k_proj(result.state)), cos, sin), T, slots)
    return module.o_proj(result.output), result


def _static_slots(layer, T):
    """The positions of the ``T`` new tokens in a static cache layer that has just stored them (a device tensor:
    no host read), or None for a dynamic layer, where they are its last ``T`` slots."""
    if not is_static_layer(layer):
        return None
    return layer.cumulative_length - T + torch.arange(T, device=layer.keys.device)


@torch.no_grad()
def _store_converged_keys(cache, module, final_keys: Callable, T, slots=None):
    """Overwrite the placeholder keys of the new tokens (the last ``T`` slots, fewer if a sliding window cut them;
    ``slots`` in a static cache) with ``final_keys()``, the keys of their final iterate (computed here, without
    gradients)."""
    final_key = final_keys()
    stored = cache.layers[module.layer_idx].keys
    if slots is not None:
        stored.index_copy_(2, slots, final_key.to(stored.dtype))
        return
    n = min(T, stored.shape[-2])
    stored[:, :, stored.shape[-2] - n:] = final_key[:, :, T - n:].to(stored.dtype)


__all__ = ["FPSAHaltingGate", "FPSAOptions", "fpsa_attention", "fpsa_decoder_attention"]
