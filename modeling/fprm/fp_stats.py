# Source of truth: hf_fixedpoint/core/fp_stats.py. Verbatim copies live in modeling/*/ so that checkpoints
# saved with save_pretrained() load with torch + transformers only. Edit here, then run
# `python -m hf_fixedpoint.vendor`. Allowed imports: stdlib, torch, and `from .fp_<x> import ...`.
"""What a fixed-point solve reports: per-entry iteration counts, residuals and convergence flags."""

from dataclasses import dataclass, field
from typing import Optional

import torch


class FixedPointWarning(UserWarning):
    """Warned when a solve (forward or adjoint) ends without meeting its tolerance."""


class NonFiniteError(FloatingPointError):
    """Raised when an iterate of a fixed-point solve contains NaN or Inf."""


@dataclass
class FixedPointStats:
    """Statistics of one fixed-point solve.

    Per-entry tensors have the shape ``z.shape[:batch_dims]``: one entry per sample by default, per token or per head
    when the caller asks for that granularity.

    Attributes:
        nstep: number of f-evaluations after which each entry stopped (converged, halted or hit ``max_iter``).
        residual: residual of the returned iterate (``stop_mode`` and ``norm`` as configured).
        converged: whether each entry met the tolerance.
        nfe: number of calls of ``f`` made by the solver (compaction makes some calls cheaper, not fewer).
        solver: solver name; ``tol`` and ``stop_mode`` as used.
        trace: ``(n_iter, *entries)`` residual per iteration (NaN once an entry stopped), when asked for.
        backward: stats of the adjoint solve, filled in by the ``ift`` backward once it has run.
        options: the ``fp_solvers.SolveOptions`` the solve ran with (None for statistics built outside ``solve``).
    """

    nstep: torch.Tensor
    residual: torch.Tensor
    converged: torch.Tensor
    nfe: int
    solver: str
    tol: float
    stop_mode: str
    trace: Optional[torch.Tensor] = None
    backward: Optional["FixedPointStats"] = field(default=None, repr=False)
    options: Optional[object] = field(default=None, repr=False)

    @property
    def all_converged(self) -> bool:
        return bool(self.converged.all())

    @property
    def converged_fraction(self) -> float:
        return float(self.converged.float().mean()) if self.converged.numel() else 1.0

    def summary(self) -> dict:
        """Plain floats for logging (``accelerator.log(stats.summary())``)."""
        out = {
            "fp_nfe": float(self.nfe),
            "fp_nstep_mean": float(self.nstep.float().mean()),
            "fp_nstep_max": float(self.nstep.max()) if self.nstep.numel() else 0.0,
            "fp_residual_max": float(self.residual.max()) if self.residual.numel() else 0.0,
            "fp_converged_fraction": self.converged_fraction,
        }
        if self.backward is not None:
            out.update({f"fp_backward_{k[3:]}": v for k, v in self.backward.summary().items() if k != "fp_nfe"})
            out["fp_backward_nfe"] = float(self.backward.nfe)
        return out


def merge_stats(stats_list) -> dict:
    """Average the summaries of several solves (e.g. one per layer) into one dict of floats."""
    stats_list = [s for s in stats_list if s is not None]
    if not stats_list:
        return {}
    summaries = [s.summary() for s in stats_list]
    keys = summaries[0].keys()
    out = {k: sum(s.get(k, 0.0) for s in summaries) / len(summaries) for k in keys}
    out["fp_nstep_max"] = max(s["fp_nstep_max"] for s in summaries)
    out["fp_residual_max"] = max(s["fp_residual_max"] for s in summaries)
    return out


__all__ = ["FixedPointStats", "FixedPointWarning", "NonFiniteError", "merge_stats"]
