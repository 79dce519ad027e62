# Source of truth: hf_fixedpoint/core/fp_fpsa_stats.py. Verbatim copies live in modeling/*/ so that checkpoints
# saved with save_pretrained() load with torch + transformers only. Edit here, then run
# `python -m hf_fixedpoint.vendor`. Allowed imports: stdlib, torch, and `from .fp_<x> import ...`.
"""What an FPSA forward pass reports: ``FPSAResult`` (one layer's call of the operator), ``FPSAStats`` (every layer's
per-(token, head) iteration counts, the paper's compute tables, the Jacobian penalty), the ``FPSAStatsSink`` a model
hands its layers, and the losses built from them (``with_jac_penalty``, ``ponder_loss``)."""

from dataclasses import dataclass, field
from typing import List, Optional

import torch
from torch import nn

from .fp_registry import check_number
from .fp_stats import FixedPointStats


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


def with_jac_penalty(output, stats: FPSAStats, weight: float):
    """Add ``weight *`` the mean per-layer Jacobian penalty to ``output.loss`` (when both exist); return ``output``.

    A loss that will be backpropagated (it requires grad) from layers that iterated but recorded no penalty means the
    layers ran without gradients, as under reentrant activation checkpointing: the penalty would be silently missing
    from the loss, so that is an error."""
    if output.loss is None or weight <= 0:
        return output
    penalty = stats.jac_penalty()
    if penalty is None:
        if output.loss.requires_grad and stats.max_iter > 1:
            raise ValueError(
                f"fpsa_jac_weight={weight:g} is set but no FPSA layer built its Jacobian penalty: the layers ran "
                "without gradients while the loss has them, as under reentrant gradient checkpointing. Use "
                "gradient_checkpointing_enable(gradient_checkpointing_kwargs={'use_reentrant': False}) or "
                "fpsa_jac_weight=0.")
        return output
    output.loss = output.loss + weight * penalty.to(output.loss.dtype)
    return output


def ponder_loss(stats: FPSAStats, budget: float, weight: float) -> torch.Tensor:
    """``weight * relu(mean ponder cost - budget)`` (FPSA-LH): no cost while the model stays within its budget."""
    return weight * torch.relu(stats.mean_ponder_cost() - budget)


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


__all__ = ["FPSAResult", "FPSAStats", "FPSAStatsSink", "ponder_loss", "with_jac_penalty"]
