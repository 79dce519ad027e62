"""hf-fixedpoint: fixed-point and looped models for the Hugging Face ecosystem.

``import hf_fixedpoint`` makes every model family known to the transformers Auto classes by its ``model_type``; a
family's code is imported on first use (``hf_fixedpoint.modeling``), so the import costs little more than
``import torch, transformers`` (``python -m benchmarks.bench_import``). accelerate, peft, lm-eval and evaluate are
imported by the modules that need them (``hf_fixedpoint.hub``, ``hf_fixedpoint.eval``).
"""

from . import modeling  # noqa: F401  (announces the families' model types to the Auto classes; loads none)
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
    defer_finite_checks,
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
    "defer_finite_checks",
    "fixed_point",
    "get_sampler",
    "jacobian_frobenius",
    "merge_stats",
    "solve",
    "spectral_radius",
    "tolerance_mask",
]
