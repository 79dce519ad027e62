# Source of truth: hf_fixedpoint/core/fp_settings.py. Verbatim copies live in modeling/*/ so that checkpoints
# saved with save_pretrained() load with torch + transformers only. Edit here, then run
# `python -m hf_fixedpoint.vendor`. Allowed imports: stdlib, torch, and `from .fp_<x> import ...`.
"""The ``fp_*`` knobs every model config carries, their validation, and their translation into ``fixed_point``
arguments.

A config's ``__init__`` calls ``pop_fp_kwargs(kwargs)``: it takes every ``fp_*`` key out of ``kwargs``, fills the
defaults, rejects unknown ``fp_*`` keys (a typo such as ``fp_slover`` is an error, not a new attribute) and validates
the values. A forward pass calls ``fixed_point_kwargs(config, training, overrides)`` with per-call overrides such as
``{"fp_max_iter": 64}`` (more test-time compute without touching the saved config).
"""

import copy

from .fp_backward import BACKWARDS
from .fp_registry import check_number
from .fp_solvers import SOLVERS, SolveOptions, solver_kwargs_check

FP_DEFAULTS = {
    "fp_solver": "anderson",  # forward solver: picard | fpopt | picard_adaptive | anderson | broyden
    "fp_solver_kwargs": None,  # e.g. {"m": 5} (Anderson), {"damping": 0.8} (Picard), {"memory": 20} (Broyden)
    "fp_tol": 1e-4,  # tolerance on the residual
    "fp_stop_mode": "rel",  # rel | abs
    "fp_norm": "l2",  # l2 | linf | token_linf (largest per-token relative l-inf residual)
    "fp_max_iter": 30,  # cap on f-evaluations in training
    "fp_eval_max_iter": None,  # cap when the model is in eval() mode (None: fp_max_iter)
    "fp_min_iter": 0,
    "fp_stop_fraction": 0.0,  # stop once at most this fraction of entries is unconverged
    "fp_return": "best",  # best | last iterate for unconverged entries
    "fp_backward": "ift",  # ift | phantom | one_step | bptt
    "fp_backward_solver": "anderson",  # ift: adjoint solver
    "fp_backward_tol": None,  # ift: adjoint tolerance (None: fp_tol)
    "fp_backward_max_iter": None,  # ift: adjoint cap (None: fp_max_iter)
    "fp_backward_solver_kwargs": None,
    "fp_backward_steps": 5,  # phantom / bptt: differentiated steps (bptt: None = the whole unroll)
    "fp_backward_damping": 1.0,  # phantom / bptt: step size
}


def check_fp_settings(settings: dict) -> None:
    """Validate a complete dict of ``fp_*`` settings; every error names the ``fp_*`` key and the allowed values."""
    s = settings
    _options(s, s["fp_max_iter"], s["fp_min_iter"]).check(prefix="fp_", names={"return_mode": "fp_return"})
    if s["fp_eval_max_iter"] is not None:
        check_number(s["fp_eval_max_iter"], "fp_eval_max_iter", low=1, integer=True)
        if s["fp_min_iter"] > s["fp_eval_max_iter"]:
            raise ValueError(
                f"fp_min_iter={s['fp_min_iter']} must not exceed fp_eval_max_iter={s['fp_eval_max_iter']}."
            )
    BACKWARDS.check(s["fp_backward"], "fp_backward")
    SOLVERS.check(s["fp_backward_solver"], "fp_backward_solver")
    solver_kwargs_check(s["fp_backward_solver"], s["fp_backward_solver_kwargs"], "fp_backward_solver_kwargs")
    if s["fp_backward_tol"] is not None:
        check_number(s["fp_backward_tol"], "fp_backward_tol", low=0.0, low_open=True)
    if s["fp_backward_max_iter"] is not None:
        check_number(s["fp_backward_max_iter"], "fp_backward_max_iter", low=1, integer=True)
    if not (s["fp_backward_steps"] is None and s["fp_backward"] == "bptt"):
        check_number(s["fp_backward_steps"], "fp_backward_steps", low=1, integer=True)
    check_number(s["fp_backward_damping"], "fp_backward_damping", low=0.0, high=1.0, low_open=True)


def _unknown_key_error(keys, where):
    return ValueError(f"Unknown fixed-point setting(s) {sorted(keys)} in {where}. Valid keys: {sorted(FP_DEFAULTS)}.")


def pop_fp_kwargs(kwargs: dict, defaults: dict = None) -> dict:
    """Remove every ``fp_*`` key from ``kwargs``; return the complete, validated settings.

    ``defaults`` lets a family change a default (e.g. ``{"fp_solver": "fpopt"}``) while keeping the same keys.
    """
    base = dict(FP_DEFAULTS)
    if defaults:
        unknown = set(defaults) - set(FP_DEFAULTS)
        if unknown:
            raise _unknown_key_error(unknown, "the family defaults")
        base.update(defaults)
    given = {k: kwargs.pop(k) for k in [k for k in kwargs if k.startswith("fp_")]}
    unknown = set(given) - set(FP_DEFAULTS)
    if unknown:
        raise _unknown_key_error(unknown, "the config")
    base.update(given)
    check_fp_settings(base)
    return copy.deepcopy(base)


def fp_settings(config, overrides: dict = None) -> dict:
    """The config's ``fp_*`` settings with per-call ``overrides`` applied and validated."""
    settings = {k: getattr(config, k, v) for k, v in FP_DEFAULTS.items()}
    if overrides:
        unknown = set(overrides) - set(FP_DEFAULTS)
        if unknown:
            raise _unknown_key_error(unknown, "fp_overrides")
        settings.update(overrides)
        check_fp_settings(settings)
    return settings


def _options(s: dict, max_iter: int, min_iter: int) -> SolveOptions:
    return SolveOptions(solver=s["fp_solver"], tol=s["fp_tol"], stop_mode=s["fp_stop_mode"], norm=s["fp_norm"],
                        max_iter=max_iter, min_iter=min_iter, stop_fraction=s["fp_stop_fraction"],
                        return_mode=s["fp_return"], solver_kwargs=s["fp_solver_kwargs"])


def _run_options(s: dict, training: bool) -> SolveOptions:
    max_iter = s["fp_max_iter"] if training or s["fp_eval_max_iter"] is None else s["fp_eval_max_iter"]
    return _options(s, max_iter, min(s["fp_min_iter"], max_iter))


def solve_options(config, training: bool, overrides: dict = None) -> SolveOptions:
    """The ``SolveOptions`` of a config's forward solve (``training`` picks the iteration cap)."""
    return _run_options(fp_settings(config, overrides), training)


# The options a config sets; the others (batch_dims, compact, ...) belong to the model that calls the solver.
CONFIG_OPTIONS = ("solver", "solver_kwargs", "tol", "stop_mode", "norm", "max_iter", "min_iter", "stop_fraction",
                  "return_mode")


def fixed_point_kwargs(config, training: bool, overrides: dict = None) -> dict:
    """Keyword arguments for ``fixed_point`` from a config: the ``CONFIG_OPTIONS`` fields of ``solve_options`` and
    the backward mode with its options."""
    s = fp_settings(config, overrides)
    opts = _run_options(s, training)
    backward = s["fp_backward"]
    if backward == "ift":
        bkw = {"solver": s["fp_backward_solver"], "tol": s["fp_backward_tol"], "max_iter": s["fp_backward_max_iter"],
               "solver_kwargs": s["fp_backward_solver_kwargs"]}
    elif backward in ("phantom", "bptt"):
        bkw = {"steps": s["fp_backward_steps"], "damping": s["fp_backward_damping"]}
    else:
        bkw = {}
    return {**{name: getattr(opts, name) for name in CONFIG_OPTIONS}, "backward": backward, "backward_kwargs": bkw}


def call_overrides(fp_overrides: dict = None, fp_max_iter: int = None, fp_tol: float = None) -> dict:
    """Per-call overrides from a forward's named knobs (``generate(..., fp_max_iter=8, fp_tol=1e-4)``) and its
    ``fp_overrides`` dict. A per-call ``fp_max_iter`` caps the solve in train and eval mode alike (it also replaces
    ``fp_eval_max_iter``, unless ``fp_overrides`` sets that)."""
    overrides = dict(fp_overrides or {})
    if fp_max_iter is not None:
        overrides["fp_max_iter"] = fp_max_iter
        overrides.setdefault("fp_eval_max_iter", None)
    if fp_tol is not None:
        overrides["fp_tol"] = fp_tol
    return overrides


def reject_unknown_knobs(kwargs: dict, allowed, where: str) -> None:
    """A ``fp*`` keyword a forward does not know (a typo such as ``fp_max_iters``) is an error, not silently passed
    on to the attention functions."""
    unknown = sorted(k for k in kwargs if k.startswith("fp") and k not in allowed)
    if unknown:
        raise ValueError(f"{where} got unknown fixed-point keyword(s) {unknown}. Per-call knobs: {sorted(allowed)}; "
                         f"any other setting goes in fp_overrides={{...}} (keys: {sorted(FP_DEFAULTS)}).")


__all__ = [
    "CONFIG_OPTIONS",
    "FP_DEFAULTS",
    "call_overrides",
    "check_fp_settings",
    "fixed_point_kwargs",
    "fp_settings",
    "pop_fp_kwargs",
    "reject_unknown_knobs",
    "solve_options",
]
