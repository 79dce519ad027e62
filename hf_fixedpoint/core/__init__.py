"""The fixed-point core: solvers, backward modes, Jacobian tools, loop samplers and halting.

Files here import only the standard library, torch and each other (``from .fp_x import y``), except ``fp_compat``
(the shims over transformers releases, which imports transformers); ``python -m hf_fixedpoint.vendor`` copies them
into ``modeling/<family>/`` so saved checkpoints are self-contained.
"""

from .fp_backward import BACKWARDS, fixed_point
from .fp_halting import ACTAccumulator, tolerance_mask
from .fp_jacobian import jacobian_frobenius, spectral_radius
from .fp_samplers import SAMPLERS, LoopSampler, get_sampler
from .fp_settings import FP_DEFAULTS, fixed_point_kwargs, pop_fp_kwargs
from .fp_solvers import SOLVERS, defer_finite_checks, solve
from .fp_stats import FixedPointStats, FixedPointWarning, NonFiniteError, merge_stats

__all__ = [
    "BACKWARDS",
    "FP_DEFAULTS",
    "SAMPLERS",
    "SOLVERS",
    "ACTAccumulator",
    "FixedPointStats",
    "FixedPointWarning",
    "LoopSampler",
    "NonFiniteError",
    "defer_finite_checks",
    "fixed_point",
    "fixed_point_kwargs",
    "get_sampler",
    "jacobian_frobenius",
    "merge_stats",
    "pop_fp_kwargs",
    "solve",
    "spectral_radius",
    "tolerance_mask",
]
