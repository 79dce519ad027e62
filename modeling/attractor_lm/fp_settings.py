# Source of truth: hf_fixedpoint/core/fp_settings.py. Verbatim copies live in modeling/*/ so that checkpoints
# saved with save_pretrained() load with torch + transformers only. Edit here, then run
# `python -m hf_fixedpoint.vendor`. Allowed imports: stdlib, torch, and `from .fp_<x> import ...`.
"""The ``fp_*`` knobs every model config carries, their validation, and their translation into ``fixed_point``
arguments.

A config's ``__init__`` calls ``pop_fp_kwargs(kwargs)``: it takes every ``fp_*`` key out of ``kwargs``, fills the
defaults, rejects unknown ``fp_*`` keys (a typo such as ``fp_slover`` is an error, not a new attribute) and validates
the values; ``FixedPointConfigMixin`` validates the settings ``from_pretrained(dir, fp_x=...)`` and later assignments
bring. A forward pass takes per-call knobs as keywords (``model(ids, fp_max_iter=64)``: more test-time compute
without touching the saved config), collects them with ``call_knobs`` and hands them to
``fixed_point_kwargs(config, training, overrides)``.
"""

import copy

from .fp_backward import BACKWARDS
from .fp_registry import CheckedConfigMixin, check_number, reject_prefixed_keywords
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
    "fp_check_every": 1,  # host reads of the convergence state: every k iterations; 0: never inside the solve
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
                        return_mode=s["fp_return"], solver_kwargs=s["fp_solver_kwargs"],
                        check_every=s["fp_check_every"])


def _run_options(s: dict, training: bool) -> SolveOptions:
    max_iter = s["fp_max_iter"] if training or s["fp_eval_max_iter"] is None else s["fp_eval_max_iter"]
    return _options(s, max_iter, min(s["fp_min_iter"], max_iter))


def solve_options(config, training: bool, overrides: dict = None) -> SolveOptions:
    """The ``SolveOptions`` of a config's forward solve (``training`` picks the iteration cap)."""
    return _run_options(fp_settings(config, overrides), training)


# The options a config sets; the others (batch_dims, compact, ...) belong to the model that calls the solver.
CONFIG_OPTIONS = ("solver", "solver_kwargs", "tol", "stop_mode", "norm", "max_iter", "min_iter", "stop_fraction",
                  "return_mode", "check_every")


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


def call_knobs(config, kwargs: dict, where: str, fp_overrides: dict = None, fp_max_iter: int = None,
               fp_tol: float = None, allowed=()) -> dict:
    """The per-call settings of one forward, validated against ``config``.

    The canonical form is keywords, as transformers models take them: ``model(ids, fp_max_iter=8, fp_tol=1e-4)``
    (named parameters of every forward, so ``generate`` and ``Trainer`` pass them on); any other ``fp_*`` setting is
    a keyword too (taken out of ``kwargs`` here), and ``fp_overrides={...}`` takes the same keys as a dict (keywords
    win).
    A per-call ``fp_max_iter`` caps the solve in train and eval mode alike (it replaces ``fp_eval_max_iter`` and lowers
    ``fp_min_iter`` to it, unless those are given in the same call). Any other ``fp*`` keyword in ``kwargs`` (not in
    ``allowed``) is a ValueError naming it, and so is a value out of range.
    """
    named = {k: v for k, v in (("fp_max_iter", fp_max_iter), ("fp_tol", fp_tol)) if v is not None}
    given = {k: kwargs.pop(k) for k in [k for k in kwargs if k in FP_DEFAULTS]}
    reject_unknown_knobs(kwargs, allowed, where)
    overrides = {**(fp_overrides or {}), **given, **named}
    if "fp_max_iter" in overrides:
        overrides.setdefault("fp_eval_max_iter", None)
        min_iter = getattr(config, "fp_min_iter", 0)
        if isinstance(overrides["fp_max_iter"], int):
            overrides.setdefault("fp_min_iter", min(min_iter, overrides["fp_max_iter"]))
    fp_settings(config, overrides)
    return overrides


def generate_knobs(kwargs: dict) -> dict:
    """``generate``'s keywords with every ``fp_*`` setting other than the named ``fp_max_iter`` / ``fp_tol`` moved
    into ``fp_overrides`` (keywords win, as in ``call_knobs``), so that ``generate(ids, fp_check_every=0)`` reaches
    every forward: transformers' ``generate`` hands a model's forward only its named parameters and refuses any other
    keyword as unused by the model. Values are checked by the forwards (``call_knobs``)."""
    moved = {k: kwargs.pop(k) for k in [k for k in kwargs if k in FP_DEFAULTS and k not in ("fp_max_iter", "fp_tol")]}
    if moved:
        kwargs["fp_overrides"] = {**(kwargs.get("fp_overrides") or {}), **moved}
    return kwargs


class GenerateKnobsMixin:
    """``generate`` takes every ``fp_*`` setting as a keyword (``generate_knobs``). Put it before the classes that
    define ``generate`` (``GenerationMixin``, ``SpeculativeGenerationMixin``)."""

    def generate(self, *args, **kwargs):
        return super().generate(*args, **generate_knobs(kwargs))


def host_reads(config, overrides: dict = None) -> bool:
    """Whether a forward with the per-call ``overrides`` (``call_knobs``) may read the device on the host besides
    its solves' checks: not at ``fp_check_every=0`` (``fp_compat.create_causal_mask``'s ``host_reads``)."""
    default = getattr(config, "fp_check_every", FP_DEFAULTS["fp_check_every"])
    return (overrides or {}).get("fp_check_every", default) != 0


def call_max_iter(config, call_kwargs: dict, where: str) -> int:
    """The iteration cap of an eval-mode forward called with ``call_kwargs`` (its ``fp_*`` keywords and
    ``fp_overrides``, as ``generate`` passes them to every step; other keys are ignored), else of the config."""
    knobs = {k: v for k, v in call_kwargs.items() if k in FP_DEFAULTS}
    overrides = call_knobs(config, knobs, where, call_kwargs.get("fp_overrides"))
    return _run_options(fp_settings(config, overrides), training=False).max_iter


def reject_unknown_knobs(kwargs: dict, allowed, where: str) -> None:
    """A ``fp*`` keyword a forward does not know (a typo such as ``fp_max_iters``) is an error, not silently passed
    on to the attention functions."""
    reject_prefixed_keywords(kwargs, "fp", allowed, where,
                             f"Per-call fixed-point settings: {sorted(FP_DEFAULTS)}, as keywords or in "
                             f"fp_overrides={{...}}; other keywords of this forward: {sorted(allowed)}.",
                             kind="fixed-point keyword(s)")


class FixedPointConfigMixin(CheckedConfigMixin):
    """Put before ``PretrainedConfig`` in a config with the ``fp_*`` settings. ``from_pretrained(dir, fp_x=...)``
    keywords join the saved settings before ``__init__`` validates them all together (transformers would set them one
    by one after ``__init__``, unchecked); a later ``config.fp_x = value`` is validated against the other settings."""

    def check_setting(self, key: str, value) -> None:
        if key.startswith("fp_"):
            if key not in FP_DEFAULTS:
                raise _unknown_key_error([key], "the config")
            current = vars(self)
            if all(k in current for k in FP_DEFAULTS):  # constructed: ``__init__`` validated the settings as a whole
                check_fp_settings({**{k: current[k] for k in FP_DEFAULTS}, key: value})
        super().check_setting(key, value)

    @classmethod
    def from_dict(cls, config_dict, **kwargs):
        fp_kwargs = {k: kwargs.pop(k) for k in [k for k in kwargs if k.startswith("fp_")]}
        return super().from_dict({**config_dict, **fp_kwargs}, **kwargs)


__all__ = [
    "CONFIG_OPTIONS",
    "FP_DEFAULTS",
    "FixedPointConfigMixin",
    "GenerateKnobsMixin",
    "call_knobs",
    "call_max_iter",
    "check_fp_settings",
    "fixed_point_kwargs",
    "fp_settings",
    "generate_knobs",
    "host_reads",
    "pop_fp_kwargs",
    "reject_unknown_knobs",
    "solve_options",
]
