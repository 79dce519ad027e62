"""FPRM: one latent ``y`` driven to the fixed point of ``f(y) = Blocks(alpha_2 * y + beta_2 * x)`` by FPRM's damped
solver (``fpopt``: Picard steps whose per-sample step size decays after ``patience`` non-improving steps).

Blocks are pre-norm with residual scaling: every sublayer is ``h <- alpha_1 * h + beta_1 * Sublayer(RMSNorm(h))``,
with the betas tied to the alphas so that the map is a convex mix of ``y`` and its update (``beta_2 = 1 -
alpha_2 alpha_1^(2L)``). Iterations per sample are adaptive: a puzzle stops when its residual (default: the largest
per-token relative l-inf residual, ``fp_norm="token_linf"``) falls below ``fp_tol``, when its step size decays
below ``min_step`` or at the iteration cap.

``solve_mode="official"`` (default) follows the research code:
* deep supervision (``state`` carried between calls, training): each call runs ``bptt_window`` solver steps on every
  puzzle with gradient from the carried state (truncated BPTT); halting is decided after the window;
* evaluation: one solver step per call with a carried state (step-size decay ``eval_step_decay``), the whole batch
  halting once every residual is below ``fp_tol``, or every step size below ``min_step``, or at the cap (a batch
  with some puzzles converged and the others stalled goes on); a call without a state steps until then (in
  training: one window from a fresh state). The output is the damped iterate ``y``.
``solve_mode="per_sample"``: a call without a state is a full solve with ``fixed_point`` (any solver and backward
mode, stopping per puzzle, output ``f(y)``); training windows freeze the puzzles that converged.
Padding positions (``pad_id``) are left out of the ``token_linf`` residual.
"""

import functools
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.modeling_outputs import ModelOutput
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
from transformers.utils import can_return_tuple

from .configuration_fprm import WINDOW_SOLVERS, FPRMConfig
from .fp_backward import fixed_point
from .fp_compat import init
from .fp_reasoning import (
    PuzzleCheckpointMixin,
    PuzzleHeads,
    PuzzleSolverMixin,
    PuzzleTrunk,
    ShortConv,
    build_blocks,
    puzzle_hidden_states,
    rms_norm,
    trunc_normal_,
    truncated_normal,
)
from .fp_registry import check_number  # noqa: F401  (see vendor.direct_import_problems)
from .fp_settings import call_knobs, fixed_point_kwargs
from .fp_solvers import SOLVERS, _residual
from .fp_stats import FixedPointStats


@dataclass
class FPRMModelOutput(ModelOutput):
    """``last_hidden_state``: the fixed point over the puzzle positions ``(B, L, D)``; ``state``: the detached state to
    carry; ``fp_stats``; ``iterations``: solver steps per sample."""

    last_hidden_state: Optional[torch.FloatTensor] = None
    state: Optional[dict] = None
    fp_stats: Optional[FixedPointStats] = None
    iterations: Optional[torch.LongTensor] = None
    hidden_states: Optional[tuple] = None


@dataclass
class FPRMPuzzleOutput(ModelOutput):
    """``logits`` ``(B, L, vocab)``, ``q_halt_logits`` ``(B,)``, ``loss`` (with labels), ``metrics`` (per-sample
    ``cell_accuracy``, ``exact``, losses), ``carry`` (deep supervision), ``fp_stats``, ``iterations`` per sample."""

    loss: Optional[torch.FloatTensor] = None
    logits: Optional[torch.FloatTensor] = None
    q_halt_logits: Optional[torch.FloatTensor] = None
    metrics: Optional[dict] = None
    carry: Optional[dict] = None
    fp_stats: Optional[FixedPointStats] = None
    iterations: Optional[torch.LongTensor] = None
    hidden_states: Optional[tuple] = None


def _start_noise(n, S, D, std, kind, device, generator=None, sync_free=False):
    """``(n, S, D)`` start noise: truncated normal or normal with standard deviation ``std``; ``sync_free``: the
    truncated normal drawn without a host read (``truncated_normal``; other numbers from the same seed)."""
    if kind == "truncated" and sync_free:
        return truncated_normal((n, S, D), std=std, device=device, generator=generator)
    if kind == "truncated":
        return trunc_normal_(torch.empty(n, S, D, device=device), std=std, generator=generator)
    return torch.randn(n, S, D, generator=generator, device=device) * std


@functools.lru_cache(maxsize=16)  # drawn once per shape (the callers copy it)
@torch.compiler.assume_constant_result  # a constant of (S, D) and the config: no generator inside a compiled graph
def _seeded_start_noise(S, D, std, kind, seed):
    """The evaluation start: one ``(1, S, D)`` draw on the CPU from a generator seeded with ``seed``."""
    return _start_noise(1, S, D, std, kind, "cpu", torch.Generator().manual_seed(seed))


class FPRMPreTrainedModel(PuzzleCheckpointMixin, PreTrainedModel):
    config_class = FPRMConfig
    base_model_prefix = "model"
    _no_split_modules = ["ReasoningBlock"]
    _supports_sdpa = True

    @torch.no_grad()
    def _init_weights(self, module):
        super()._init_weights(module)
        if isinstance(getattr(module, "alpha_logits", None), torch.Tensor):
            init.copy_(module.alpha_logits, self._alpha_logits())

    def _alpha_logits(self):
        """``(2, D)``: the logits of ``alpha_1_init`` and ``alpha_2_init``, one row each."""
        c = self.config
        return torch.tensor([c.alpha_1_init, c.alpha_2_init]).logit()[:, None].repeat(1, c.hidden_size)


class FPRMModel(FPRMPreTrainedModel):
    def __init__(self, config: FPRMConfig):
        super().__init__(config)
        c = config
        self.trunk = PuzzleTrunk(c, apply_rotary_pos_emb)
        self.layers = build_blocks(c, c.num_layers, norm="pre")
        if c.spectral_norm:
            for module in self.layers.modules():
                if isinstance(module, nn.Linear):
                    nn.utils.parametrizations.spectral_norm(module)
        self.conv = (ShortConv(c.hidden_size, c.conv, c.conv_kernel, c.puzzle_emb_len, c.grid_shape, c.conv_skip)
                     if c.conv != "none" else None)
        logits = self._alpha_logits()
        if c.residual_scale == "learned":
            self.alpha_logits = nn.Parameter(logits)
        else:
            self.register_buffer("alpha_logits", logits)
        self.register_buffer("y_init", trunc_normal_(torch.empty(c.hidden_size), std=1.0))
        self.post_init()

    def residual_scales(self):
        """``(alpha_1, alpha_2, beta_1, beta_2)``, each ``(D,)``; ``2L`` sublayers (attention and MLP per block)."""
        a1, a2 = torch.sigmoid(self.alpha_logits.to(torch.promote_types(self.alpha_logits.dtype, torch.float32)))
        p = a1 ** (2 * len(self.layers))
        b2 = 1 - a2 * p
        b1 = b2 * (1 - a1) / (1 - p + 1e-5)
        return a1, a2, b1, b2

    def step_map(self, y, x):
        """``f(y; x)``: short conv of the grid, injection ``alpha_2 y + beta_2 x``, the scaled pre-norm blocks."""
        if self.conv is not None:
            y = self.conv(y)
        a1, a2, b1, b2 = (t.to(y.dtype) for t in self.residual_scales())
        h = a2 * y + b2 * x
        rope = self.trunk.rope(h.shape[1])
        for layer in self.layers:
            h = layer(h, rope, scale=(a1, b1))
        return rms_norm(h, self.config.rms_norm_eps) if self.config.output_norm else h

    def _solver(self, fp_overrides):
        """``fixed_point`` arguments; at evaluation every puzzle must converge (``fp_stop_fraction`` is a training
        rule) and ``fpopt`` decays its step size by ``eval_step_decay`` (the config's ``fp_solver_kwargs["decay"]``
        is the training decay; a ``decay`` in a call's ``fp_solver_kwargs`` applies to that call in either mode);
        ``fpopt`` decays only while the residual is at least ``fp_tol`` (the research code's ``fp_thresh``)."""
        kw = fixed_point_kwargs(self.config, self.training, fp_overrides)
        if kw["solver"] == "fpopt":
            kw["solver_kwargs"] = {"threshold": kw["tol"], **(kw["solver_kwargs"] or {})}
        if not self.training:
            kw["stop_fraction"] = 0.0
            if kw["solver"] == "fpopt":
                call = (fp_overrides or {}).get("fp_solver_kwargs") or {}
                kw["solver_kwargs"]["decay"] = call.get("decay", self.config.eval_step_decay)
        return kw

    def residual_mask(self, input_ids):
        """``(B, P + L)`` bool: the positions whose residual counts (all but padding), or None (every position)."""
        c = self.config
        if c.pad_id is None or c.fp_norm != "token_linf":
            return None
        keep = input_ids != c.pad_id
        return torch.cat([keep.new_ones(keep.shape[0], c.puzzle_emb_len), keep], dim=1)

    def fresh_state(self, batch_size: int, device, seq_len: int) -> dict:
        """Initial ``y`` (noise or the fixed vector) and the window solver's per-sample state."""
        c = self.config
        S, D = seq_len + c.puzzle_emb_len, c.hidden_size
        dtype = self.trunk.dtype
        if c.init_mode == "fixed":
            y = self.y_init.to(device, dtype).expand(batch_size, S, D).clone()
        else:
            # Evaluation: one draw from a seeded CPU generator, shared by every slot, so a puzzle's output does not
            # depend on the batch it is in, its slot, or the device (CUDA's generator draws other numbers).
            if self.training:  # drawn in every training forward: without a host read
                noise = _start_noise(batch_size, S, D, c.init_std, c.init_noise, device, sync_free=True)
            else:
                noise = _seeded_start_noise(S, D, c.init_std, c.init_noise, c.seed)
            y = noise.to(device, dtype).expand(batch_size, S, D).clone()
        state = {"y": y, "iterations": torch.zeros(batch_size, dtype=torch.long, device=device)}
        kw = self._solver(None)
        if kw["solver"] in WINDOW_SOLVERS:
            algo = SOLVERS.get(kw["solver"])(**(kw["solver_kwargs"] or {}))
            algo.init(y.reshape(batch_size, -1))
            state.update({f"solver_{k}": v for k, v in algo.state.items()})
        return state

    @staticmethod
    def _window_solver(kw, state):
        """The carried solver (its per-sample state comes from ``state``)."""
        if kw["solver"] not in WINDOW_SOLVERS:
            raise ValueError(f"deep-supervision windows need fp_solver in {WINDOW_SOLVERS}; got {kw['solver']!r} "
                             "(other solvers run in single-call mode, without a carried state).")
        algo = SOLVERS.get(kw["solver"])(**(kw["solver_kwargs"] or {}))
        algo.state = {k[len("solver_"):]: v for k, v in state.items() if k.startswith("solver_")}
        return algo

    def _step(self, algo, y, x, kw, mask, k):
        """One solver step on every puzzle: ``(next iterate, f(y), residual of y)``."""
        B = y.shape[0]
        fy = self.step_map(y, x)
        g = (fy - y).reshape(B, -1)
        res = _residual(g.detach(), fy.detach().reshape(B, -1), kw["stop_mode"], kw["norm"], y.shape[-1],
                        mask).float()
        if not torch.isfinite(res).all():
            raise FloatingPointError("FPRM produced NaN/Inf residuals; lower the learning rate.")
        if hasattr(algo, "observe"):
            algo.observe(res)
        return algo.step(y.reshape(B, -1), fy.reshape(B, -1), g, k).view_as(y), fy, res

    def _official(self, x, state, kw, mask, until_halt):
        """The research code's steps: a training window of ``bptt_window`` steps on every puzzle, halting decided
        after it per puzzle; at evaluation one step (or, ``until_halt``, steps until the batch halts), the whole
        batch halting once every residual is below ``fp_tol``, or every step size is below ``min_step``, or at the
        cap. Returns the dict ``inner`` returns, with the damped iterate as ``h``."""
        algo = self._window_solver(kw, state)
        y, total = state["y"], state["iterations"]
        n = self.config.bptt_window if self.training else (kw["max_iter"] if until_halt else 1)
        k = 0
        for k in range(1, n + 1):
            y, _, res = self._step(algo, y, x, kw, mask, k)
            halted = algo.halted()
            stalled = torch.zeros_like(res, dtype=torch.bool) if halted is None else halted
            capped = total + k >= kw["max_iter"]
            if self.training:
                done = (res < kw["tol"]) | stalled | capped
            else:  # a batch with some puzzles converged and the others stalled goes on, as in the research code
                done = capped | (res < kw["tol"]).all() | stalled.all()
                if bool(done.all()) or not until_halt:
                    break
        used = torch.full_like(total, k)
        stats = FixedPointStats(nstep=used, residual=res, converged=res < kw["tol"], nfe=k, solver=kw["solver"],
                                tol=kw["tol"], stop_mode=kw["stop_mode"])
        out = {"h": y, "x": x, "stats": stats, "iterations": used,
               "state": {"y": y.detach(), "iterations": total + used,
                         **{f"solver_{key}": v.detach() for key, v in algo.state.items()}}}
        if self.training:
            out["done"] = done
        else:  # the whole batch halts together (puzzles evaluated together have taken the same number of steps)
            out["halt"] = done
        return out

    def _window(self, x, state, kw, mask):
        """``bptt_window`` solver steps with gradient from the carried state; per-sample halting."""
        B = x.shape[0]
        algo = self._window_solver(kw, state)
        y, total = state["y"], state["iterations"]
        used = torch.zeros_like(total)
        res = torch.full((B,), float("inf"), device=x.device)
        done = total >= kw["max_iter"]
        k = 0
        for k in range(1, self.config.bptt_window + 1):
            step, _, step_res = self._step(algo, y, x, kw, mask, k)
            res = torch.where(done, res, step_res)
            used = used + (~done).long()
            y = torch.where(done[:, None, None], y, step)
            halted = algo.halted()
            done = done | (res < kw["tol"]) | (total + used >= kw["max_iter"])
            if halted is not None:
                done = done | halted
            if (~done).float().mean() <= kw["stop_fraction"]:
                break
        stats = FixedPointStats(nstep=used, residual=res, converged=res < kw["tol"], nfe=k, solver=kw["solver"],
                                tol=kw["tol"], stop_mode=kw["stop_mode"])
        new_state = {"y": y.detach(), "iterations": total + used,
                     **{f"solver_{k}": v.detach() for k, v in algo.state.items()}}
        return {"h": y, "x": x, "state": new_state, "stats": stats, "done": done, "iterations": used}

    def inner(self, input_ids, puzzle_identifiers=None, state=None, fp_overrides=None):
        """The dict ``puzzle_step`` reads: ``h, state, stats, done, iterations`` (see the module docstring)."""
        x = self.trunk.embed(input_ids, puzzle_identifiers)
        kw = self._solver(fp_overrides)
        mask = self.residual_mask(input_ids)
        if self.config.solve_mode == "official":
            until_halt = state is None
            state = self.fresh_state(x.shape[0], x.device, input_ids.shape[1]) if state is None else state
            return self._official(x, state, kw, mask, until_halt)
        if state is not None and self.training and torch.is_grad_enabled():
            return self._window(x, state, kw, mask)
        new_state = self.fresh_state(x.shape[0], x.device, input_ids.shape[1]) if state is None else dict(state)
        y, stats = fixed_point(self.step_map, new_state["y"], args=(x,), row_mask=mask, **kw)
        new_state.update(y=y.detach(), iterations=new_state["iterations"] + stats.nstep)
        return {"h": y, "x": x, "state": new_state, "stats": stats, "done": stats.converged,
                "iterations": stats.nstep}

    @can_return_tuple
    def forward(self, input_ids: torch.LongTensor, puzzle_identifiers: Optional[torch.LongTensor] = None,
                state: Optional[dict] = None, fp_max_iter: Optional[int] = None, fp_tol: Optional[float] = None,
                fp_overrides: Optional[dict] = None, **kwargs) -> FPRMModelOutput:
        """``kwargs``: the standard output switches (``output_hidden_states``: the input injection and the final
        state; ``return_dict``)."""
        overrides = call_knobs(self.config, kwargs, type(self).__name__, fp_overrides, fp_max_iter, fp_tol)
        out = self.inner(input_ids, puzzle_identifiers, state, overrides)
        return FPRMModelOutput(last_hidden_state=out["h"][:, self.config.puzzle_emb_len:], state=out["state"],
                               fp_stats=out["stats"], iterations=out["iterations"],
                              hidden_states=puzzle_hidden_states(self.config, out, kwargs))


class FPRMForPuzzles(PuzzleSolverMixin, FPRMPreTrainedModel):
    """FPRM with the LM head and the Q-halt head, one supervision step per call.

    ``model(input_ids, puzzle_identifiers, labels)``: a full solve (evaluation). ``carry = model.initial_carry(B)``
    then ``out = model(..., carry=carry); carry = out.carry`` for deep-supervision training.
    """

    def __init__(self, config: FPRMConfig):
        super().__init__(config)
        self.model = FPRMModel(config)
        self.heads = PuzzleHeads(config.hidden_size, config.vocab_size, config.puzzle_emb_len, config.causal)
        self.post_init()

    @can_return_tuple
    def forward(self, input_ids: torch.LongTensor, puzzle_identifiers: Optional[torch.LongTensor] = None,
                labels: Optional[torch.LongTensor] = None, carry: Optional[dict] = None,
                fp_max_iter: Optional[int] = None, fp_tol: Optional[float] = None,
                fp_overrides: Optional[dict] = None, **kwargs) -> FPRMPuzzleOutput:
        return FPRMPuzzleOutput(**self.puzzle_forward(input_ids, puzzle_identifiers, labels, carry, fp_overrides,
                                                      fp_max_iter=fp_max_iter, fp_tol=fp_tol, **kwargs))


__all__ = ["FPRMForPuzzles", "FPRMModel", "FPRMPreTrainedModel"]
