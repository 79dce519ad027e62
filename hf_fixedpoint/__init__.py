"""hf-fixedpoint: fixed-point and looped models for the Hugging Face ecosystem.

``import hf_fixedpoint`` registers every model family with the transformers Auto classes. It imports torch and
transformers only; accelerate, peft, lm-eval and evaluate are imported by the modules that need them
(``hf_fixedpoint.hub``, ``hf_fixedpoint.eval``).
"""

from . import modeling  # noqa: F401  (registers the families with AutoConfig / AutoModel*)
from .core import (
    BACKWARDS,
    FP_DEFAULTS,
    SAMPLERS,
    SOLVERS,
    ACTAccumulator,
    FixedPointStats,
    FixedPointWarning,
    LoopSampler,
    NonFiniteError,
    fixed_point,
    get_sampler,
    jacobian_frobenius,
    merge_stats,
    solve,
    spectral_radius,
    tolerance_mask,
)

__version__ = "0.1.0"

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
    "__version__",
    "fixed_point",
    "get_sampler",
    "jacobian_frobenius",
    "merge_stats",
    "solve",
    "spectral_radius",
    "tolerance_mask",
]
