"""TRM and Attractor-reasoning (TRM-DEQ) from the same blocks.

TRM keeps two latents, the answer ``y`` and the reasoning state ``z``, updated by one small post-norm network:
``H_cycles`` times, ``L_cycles`` updates ``z = net(z, y + x)`` then ``y = net(y, z)``; only the last cycle carries
gradient. With ``deq=True`` (Attractor-reasoning) each cycle's ``z`` updates are a fixed-point solve of
``z = net(z, y + x)`` (Anderson by default) with a phantom gradient through the last iterates, plus an optional
Jacobian regularizer. The logits read ``y``; the Q-halt head reads ``y`` at the first position.
"""

from dataclasses import dataclass
from typing import Optional

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import PreTrainedModel
from transformers.modeling_outputs import ModelOutput
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
from transformers.utils import can_return_tuple

from .configuration_trm import TRMConfig
from .fp_backward import fixed_point
from .fp_jacobian import jacobian_frobenius
from .fp_reasoning import (
    PuzzleCheckpointMixin,
    PuzzleHeads,
    PuzzleSolverMixin,
    PuzzleTrunk,
    build_blocks,
    puzzle_hidden_states,
    relative_change,
    trunc_normal_,
)
from .fp_registry import check_number  # noqa: F401  (see vendor.direct_import_problems)
from .fp_settings import call_knobs, fixed_point_kwargs
from .fp_solvers import defer_finite_checks
from .fp_stats import FixedPointStats


@dataclass
class TRMModelOutput(ModelOutput):
    """``last_hidden_state``: ``y`` over the puzzle positions ``(B, L, D)``; ``state``: detached ``{y, z}`` to carry;
    ``fp_stats`` of the last cycle's ``z`` solve (unrolled: its last update); ``iterations``: ``z`` updates per sample;
    ``aux_loss``: the weighted Jacobian regularizer (training, ``deq``)."""

    last_hidden_state: Optional[torch.FloatTensor] = None
    state: Optional[dict] = None
    fp_stats: Optional[FixedPointStats] = None
    iterations: Optional[torch.LongTensor] = None
    aux_loss: Optional[torch.FloatTensor] = None
    hidden_states: Optional[tuple] = None


@dataclass
class TRMPuzzleOutput(ModelOutput):
    """See ``FPRMPuzzleOutput``: ``loss, logits, q_halt_logits, metrics, carry, fp_stats, iterations``."""

    loss: Optional[torch.FloatTensor] = None
    logits: Optional[torch.FloatTensor] = None
    q_halt_logits: Optional[torch.FloatTensor] = None
    metrics: Optional[dict] = None
    carry: Optional[dict] = None
    fp_stats: Optional[FixedPointStats] = None
    iterations: Optional[torch.LongTensor] = None
    hidden_states: Optional[tuple] = None


class TRMPreTrainedModel(PuzzleCheckpointMixin, PreTrainedModel):
    config_class = TRMConfig
    base_model_prefix = "model"
    _no_split_modules = ["ReasoningBlock"]
    _supports_sdpa = True


class TRMModel(TRMPreTrainedModel):
    def __init__(self, config: TRMConfig):
        super().__init__(config)
        c = config
        self.trunk = PuzzleTrunk(c, apply_rotary_pos_emb)
        self.layers = build_blocks(c, c.num_layers, norm="post", mlp_t=c.mlp_t)
        # Fixed random reset values of the latents (not learned, saved with the model).
        self.register_buffer("y_init", trunc_normal_(torch.empty(c.hidden_size), std=1.0))
        self.register_buffer("z_init", trunc_normal_(torch.empty(c.hidden_size), std=1.0))
        self.post_init()

    def net(self, h, injection):
        """``h <- blocks(h + injection)``: the one network behind both updates."""
        h = h + injection
        rope = self.trunk.rope(h.shape[1])
        for layer in self.layers:
            h = layer(h, rope)
        return h

    def fresh_state(self, batch_size: int, device, seq_len: int) -> dict:
        c = self.config
        shape = (batch_size, seq_len + c.puzzle_emb_len, c.hidden_size)
        dtype = self.trunk.dtype
        return {"y": self.y_init.to(device, dtype).expand(shape).clone(),
                "z": self.z_init.to(device, dtype).expand(shape).clone()}

    def _z_update(self, y, z, x, kw):
        """One cycle's ``z`` updates: ``(z, stats, iterations per sample)``."""
        if kw is not None:
            z, stats = fixed_point(self.net, z, args=(y + x,), **kw)
            return z, stats, stats.nstep
        for _ in range(self.config.L_cycles):
            z_prev, z = z, self.net(z, y + x)
        res = relative_change(z.detach(), z_prev.detach())
        stats = FixedPointStats(nstep=torch.full_like(res, self.config.L_cycles, dtype=torch.long), residual=res,
                                converged=res < self.config.fp_tol, nfe=self.config.L_cycles, solver="unrolled",
                                tol=self.config.fp_tol, stop_mode="rel")
        return z, stats, stats.nstep

    def inner(self, input_ids, puzzle_identifiers=None, state=None, fp_overrides=None):
        """The dict ``puzzle_step`` reads: ``h, state, stats, iterations, aux_loss`` (see the module docstring)."""
        c = self.config
        x = self.trunk.embed(input_ids, puzzle_identifiers)
        state = state if state is not None else self.fresh_state(x.shape[0], x.device, input_ids.shape[1])
        y, z = state["y"], state["z"]
        kw = fixed_point_kwargs(c, self.training, fp_overrides) if c.deq else None
        iterations = torch.zeros(x.shape[0], dtype=torch.long, device=x.device)
        with torch.no_grad():
            for _ in range(c.H_cycles - 1):
                z, _, n = self._z_update(y, z, x, kw)
                iterations = iterations + n
                y = self.net(y, z)
        z, stats, n = self._z_update(y, z, x, kw)
        iterations = iterations + n
        aux = None
        if c.deq and c.jacobian_reg_weight > 0 and self.training and torch.is_grad_enabled():
            inj = y + x
            with sdpa_kernel(SDPBackend.MATH):  # the regularizer's gradient is a double backward through attention
                frob = jacobian_frobenius(lambda t: self.net(t, inj), z.detach(), create_graph=True)
            aux = c.jacobian_reg_weight * (frob / z[0].numel()).mean()
        y = self.net(y, z)
        return {"h": y, "x": x, "state": {"y": y.detach(), "z": z.detach()}, "stats": stats,
                "iterations": iterations, "aux_loss": aux}

    @can_return_tuple
    @defer_finite_checks
    def forward(self, input_ids: torch.LongTensor, puzzle_identifiers: Optional[torch.LongTensor] = None,
                state: Optional[dict] = None, fp_max_iter: Optional[int] = None, fp_tol: Optional[float] = None,
                fp_overrides: Optional[dict] = None, **kwargs) -> TRMModelOutput:
        """``kwargs``: the standard output switches (``output_hidden_states``: the input injection and the final
        state; ``return_dict``)."""
        overrides = call_knobs(self.config, kwargs, type(self).__name__, fp_overrides, fp_max_iter, fp_tol)
        out = self.inner(input_ids, puzzle_identifiers, state, overrides)
        return TRMModelOutput(last_hidden_state=out["h"][:, self.config.puzzle_emb_len:], state=out["state"],
                              fp_stats=out["stats"], iterations=out["iterations"], aux_loss=out["aux_loss"],
                              hidden_states=puzzle_hidden_states(self.config, out, kwargs))


class TRMForPuzzles(PuzzleSolverMixin, TRMPreTrainedModel):
    """TRM / Attractor-reasoning with the LM head and the Q-halt head, one supervision step per call (see
    ``FPRMForPuzzles`` for the call pattern with a carry)."""

    def __init__(self, config: TRMConfig):
        super().__init__(config)
        self.model = TRMModel(config)
        self.heads = PuzzleHeads(config.hidden_size, config.vocab_size, config.puzzle_emb_len, config.causal)
        self.post_init()

    @can_return_tuple
    @defer_finite_checks
    def forward(self, input_ids: torch.LongTensor, puzzle_identifiers: Optional[torch.LongTensor] = None,
                labels: Optional[torch.LongTensor] = None, carry: Optional[dict] = None,
                fp_max_iter: Optional[int] = None, fp_tol: Optional[float] = None,
                fp_overrides: Optional[dict] = None, **kwargs) -> TRMPuzzleOutput:
        return TRMPuzzleOutput(**self.puzzle_forward(input_ids, puzzle_identifiers, labels, carry, fp_overrides,
                                                     fp_max_iter=fp_max_iter, fp_tol=fp_tol, **kwargs))


__all__ = ["TRMForPuzzles", "TRMModel", "TRMPreTrainedModel"]
