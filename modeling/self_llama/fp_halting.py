# Source of truth: hf_fixedpoint/core/fp_halting.py. Verbatim copies live in modeling/*/ so that checkpoints
# saved with save_pretrained() load with torch + transformers only. Edit here, then run
# `python -m hf_fixedpoint.vendor`. Allowed imports: stdlib, torch, and `from .fp_<x> import ...`.
"""Halting: residual tolerance masks and Adaptive Computation Time (Graves 2016, as in the Universal Transformer).

``ACTAccumulator`` is used by step: at each loop step the model produces halting probabilities ``p`` (one per entry,
e.g. per token) and a new state; the accumulator keeps the halting-weighted mean of the states, which entries have
halted, their remainders and the ponder cost ``N + R`` to add to the loss.
"""

from typing import Optional

import torch

from .fp_registry import check_number


def tolerance_mask(residual: torch.Tensor, tol: float) -> torch.Tensor:
    """True where an entry's residual is below ``tol`` (converged); NaN counts as not converged."""
    check_number(tol, "tol", low=0.0, low_open=True)
    return residual < tol


class ACTAccumulator:
    """Adaptive Computation Time over up to ``max_steps`` steps.

    Args:
        shape: entry shape, e.g. ``(B, T)`` for per-token halting.
        max_steps: the step at which every entry still running is halted with its remainder (>= 1).
        threshold: an entry halts once its cumulative probability would exceed ``threshold`` (``1 - eps``).

    Example:
        >>> act = ACTAccumulator((B, T), max_steps=8)
        >>> for step in range(8):
        ...     state = block(state); act.update(torch.sigmoid(halt_head(state)).squeeze(-1), state)
        ...     if act.all_halted: break
        >>> out, loss = act.output, task_loss + tau * act.ponder_cost.mean()
    """

    def __init__(self, shape, max_steps: int, threshold: float = 0.99, device=None, dtype=torch.float32):
        check_number(max_steps, "max_steps", low=1, integer=True)
        check_number(threshold, "threshold", low=0.0, high=1.0, low_open=True)
        self.max_steps, self.threshold = max_steps, float(threshold)
        self.cumulative = torch.zeros(shape, device=device, dtype=dtype)
        self.remainders = torch.zeros(shape, device=device, dtype=dtype)
        self.n_updates = torch.zeros(shape, device=device, dtype=dtype)
        self.halted = torch.zeros(shape, device=device, dtype=torch.bool)
        self.output: Optional[torch.Tensor] = None
        self.steps = 0

    def update(self, p: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
        """Add one step with halting probabilities ``p`` (entry shape) and ``state`` (entry shape + features).

        Returns the weights given to ``state`` (zero for entries that had already halted).
        """
        if p.shape != self.cumulative.shape:
            raise ValueError(f"p has shape {tuple(p.shape)}; expected the entry shape {tuple(self.cumulative.shape)}.")
        if self.steps >= self.max_steps:
            raise RuntimeError(f"ACTAccumulator.update called more than max_steps={self.max_steps} times.")
        self.steps += 1
        running = ~self.halted
        last = self.steps == self.max_steps
        p = p.to(self.cumulative.dtype)
        would = self.cumulative + p
        halting_now = running & ((would > self.threshold) | last)
        keep_running = running & ~halting_now
        remainder = torch.where(halting_now, 1.0 - self.cumulative, torch.zeros_like(p))
        weight = torch.where(keep_running, p, torch.zeros_like(p)) + remainder
        self.cumulative = self.cumulative + weight
        self.remainders = self.remainders + remainder
        self.n_updates = self.n_updates + running.to(p.dtype)
        self.halted = self.halted | halting_now
        w = weight.reshape(weight.shape + (1,) * (state.dim() - weight.dim())).to(state.dtype)
        self.output = state * w if self.output is None else self.output + state * w
        return weight

    @property
    def all_halted(self) -> bool:
        return bool(self.halted.all())

    @property
    def ponder_cost(self) -> torch.Tensor:
        """``N + R`` per entry (differentiable through the remainders)."""
        return self.n_updates + self.remainders


__all__ = ["ACTAccumulator", "tolerance_mask"]
