"""URM: one state ``h`` looped through a stack of post-norm blocks with ConvSwiGLU MLPs, ``h <- blocks(h + x)``.

Per supervision step the first loops run forward-only (an unrolled solve with the ``fp_*`` settings: ``fp_max_iter``
Picard loops by default), then ``L_cycles`` loops with gradient (truncated backprop through loops); the carried state
is detached. The Q-halt head decides when a puzzle stops (ACT, training only).
"""

from dataclasses import dataclass
from typing import Optional

import torch
from transformers import PreTrainedModel
from transformers.modeling_outputs import ModelOutput
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
from transformers.utils import can_return_tuple

from .configuration_urm import URMConfig
from .fp_backward import fixed_point  # noqa: F401  (see vendor.direct_import_problems)
from .fp_reasoning import (
    PuzzleCheckpointMixin,
    PuzzleHeads,
    PuzzleSolverMixin,
    PuzzleTrunk,
    build_blocks,
    puzzle_hidden_states,
    trunc_normal_,
)
from .fp_registry import check_number  # noqa: F401  (see vendor.direct_import_problems)
from .fp_settings import call_knobs, fixed_point_kwargs
from .fp_solvers import solve
from .fp_stats import FixedPointStats


@dataclass
class URMModelOutput(ModelOutput):
    """``last_hidden_state``: ``h`` over the puzzle positions ``(B, L, D)``; ``state``: detached ``{h}``;
    ``fp_stats`` of the forward-only loops; ``iterations``: loops per sample (forward-only + ``L_cycles``)."""

    last_hidden_state: Optional[torch.FloatTensor] = None
    state: Optional[dict] = None
    fp_stats: Optional[FixedPointStats] = None
    iterations: Optional[torch.LongTensor] = None
    hidden_states: Optional[tuple] = None


@dataclass
class URMPuzzleOutput(ModelOutput):
    """See ``FPRMPuzzleOutput``: ``loss, logits, q_halt_logits, metrics, carry, fp_stats, iterations``."""

    loss: Optional[torch.FloatTensor] = None
    logits: Optional[torch.FloatTensor] = None
    q_halt_logits: Optional[torch.FloatTensor] = None
    metrics: Optional[dict] = None
    carry: Optional[dict] = None
    fp_stats: Optional[FixedPointStats] = None
    iterations: Optional[torch.LongTensor] = None
    hidden_states: Optional[tuple] = None


class URMPreTrainedModel(PuzzleCheckpointMixin, PreTrainedModel):
    config_class = URMConfig
    base_model_prefix = "model"
    _no_split_modules = ["ReasoningBlock"]
    _supports_sdpa = True


class URMModel(URMPreTrainedModel):
    def __init__(self, config: URMConfig):
        super().__init__(config)
        c = config
        self.trunk = PuzzleTrunk(c, apply_rotary_pos_emb)
        self.layers = build_blocks(c, c.num_layers, norm="post", mlp="conv_swiglu")
        self.register_buffer("h_init", trunc_normal_(torch.empty(c.hidden_size), std=1.0))
        self.post_init()

    def loop(self, h, x):
        """One loop ``h <- blocks(h + x)``."""
        h = h + x
        rope = self.trunk.rope(h.shape[1])
        for layer in self.layers:
            h = layer(h, rope)
        return h

    def fresh_state(self, batch_size: int, device, seq_len: int) -> dict:
        c = self.config
        shape = (batch_size, seq_len + c.puzzle_emb_len, c.hidden_size)
        return {"h": self.h_init.to(device, self.trunk.dtype).expand(shape).clone()}

    def inner(self, input_ids, puzzle_identifiers=None, state=None, fp_overrides=None):
        """The dict ``puzzle_step`` reads: ``h, state, stats, iterations`` (see the module docstring)."""
        x = self.trunk.embed(input_ids, puzzle_identifiers)
        state = state if state is not None else self.fresh_state(x.shape[0], x.device, input_ids.shape[1])
        kw = fixed_point_kwargs(self.config, self.training, fp_overrides)
        h, stats = solve(self.loop, state["h"], args=(x,), solver=kw["solver"], solver_kwargs=kw["solver_kwargs"],
                         tol=kw["tol"], stop_mode=kw["stop_mode"], norm=kw["norm"], max_iter=kw["max_iter"],
                         min_iter=kw["min_iter"], stop_fraction=kw["stop_fraction"], return_mode=kw["return_mode"],
                         check_every=kw["check_every"])
        for _ in range(self.config.L_cycles):
            h = self.loop(h, x)
        return {"h": h, "x": x, "state": {"h": h.detach()}, "stats": stats,
                "iterations": stats.nstep + self.config.L_cycles}

    @can_return_tuple
    def forward(self, input_ids: torch.LongTensor, puzzle_identifiers: Optional[torch.LongTensor] = None,
                state: Optional[dict] = None, fp_max_iter: Optional[int] = None, fp_tol: Optional[float] = None,
                fp_overrides: Optional[dict] = None, **kwargs) -> URMModelOutput:
        """``kwargs``: the standard output switches (``output_hidden_states``: the input injection and the final
        state; ``return_dict``)."""
        overrides = call_knobs(self.config, kwargs, type(self).__name__, fp_overrides, fp_max_iter, fp_tol)
        out = self.inner(input_ids, puzzle_identifiers, state, overrides)
        return URMModelOutput(last_hidden_state=out["h"][:, self.config.puzzle_emb_len:], state=out["state"],
                              fp_stats=out["stats"], iterations=out["iterations"],
                              hidden_states=puzzle_hidden_states(self.config, out, kwargs))


class URMForPuzzles(PuzzleSolverMixin, URMPreTrainedModel):
    """URM with the LM head and the Q-halt head, one supervision step per call (see ``FPRMForPuzzles``)."""

    def __init__(self, config: URMConfig):
        super().__init__(config)
        self.model = URMModel(config)
        self.heads = PuzzleHeads(config.hidden_size, config.vocab_size, config.puzzle_emb_len, config.causal)
        self.post_init()

    @can_return_tuple
    def forward(self, input_ids: torch.LongTensor, puzzle_identifiers: Optional[torch.LongTensor] = None,
                labels: Optional[torch.LongTensor] = None, carry: Optional[dict] = None,
                fp_max_iter: Optional[int] = None, fp_tol: Optional[float] = None,
                fp_overrides: Optional[dict] = None, **kwargs) -> URMPuzzleOutput:
        return URMPuzzleOutput(**self.puzzle_forward(input_ids, puzzle_identifiers, labels, carry, fp_overrides,
                                                     fp_max_iter=fp_max_iter, fp_tol=fp_tol, **kwargs))


__all__ = ["URMForPuzzles", "URMModel", "URMPreTrainedModel"]
