# Source of truth: hf_fixedpoint/core/fp_fpsa_settings.py. Verbatim copies live in modeling/*/ so that checkpoints
# saved with save_pretrained() load with torch + transformers only. Edit here, then run
# `python -m hf_fixedpoint.vendor`. Allowed imports: stdlib, torch, and `from .fp_<x> import ...`.
"""The ``fpsa_*`` knobs of the FPSA families (FPSA-BERT, FPSA-ViT, SELF-LLaMA / SELF-Mistral): their defaults, the
values each takes, FPSA's own defaults for the shared ``fp_*`` knobs, and the checks a config runs (``fp_fpsa`` is
the operator that uses them)."""

from typing import Optional

from .fp_registry import check_choice, check_number
from .fp_settings import FixedPointConfigMixin

UPDATE_FORMS = ("residual_norm", "plain")
STEP_NORMS = ("none", "tanh")
HALTING_MODES = ("tolerance", "learned")
SPECTRAL_NORMS = ("none", "qk", "qko")
HALT_UNITS = ("head", "token", "state")
JAC_NORMS = ("frobenius", "spectral")

FPSA_DEFAULTS = {
    "fpsa_update": "residual_norm",  # residual_norm | plain (see module docstring)
    "fpsa_update_scale": 1.0,  # in (0, 1]: the iterate re-injects this share of W_O O (1: the paper's form)
    "fpsa_step_norm": "none",  # none | tanh
    "fpsa_learn_temperature": True,  # learned per-head temperature tau_h = exp(log_tau_h), initialised to 1
    "fpsa_spectral_norm": "none",  # none | qk | qko: spectral normalisation of W_Q, W_K (and W_O)
    "fpsa_adjoint_mask": True,  # ift backward: implicit term only for converged (token, head) entries (paper App. D)
    "fpsa_halting": "tolerance",  # tolerance (fp_tol) | learned (FPSA-LH gate + ACT)
    "fpsa_ponder_budget": 4.0,  # learned halting: target mean iterations per (token, head)
    "fpsa_ponder_weight": 0.01,  # learned halting: weight of relu(mean ponder cost - budget) in the loss
    "fpsa_halt_threshold": 0.99,  # learned halting: ACT threshold 1 - eps
    "fpsa_halt_unit": "head",  # head: each (token, head) halts on its own change | token: all heads of a token |
    # state: each token on the relative change of the iterate Z its queries and keys are computed from
    "fpsa_jac_weight": 0.0,  # training: weight of the Jacobian penalty of each layer's FPSA map (0: none)
    "fpsa_jac_norm": "frobenius",  # frobenius: Hutchinson ||J_f||_F^2 / n | spectral: relu(rho(J_f) - target)^2
    "fpsa_jac_target": 0.2,  # spectral penalty: the spectral radius (per-step contraction) left unpenalised
}

# FPSA's own defaults for the shared fp_* knobs: the official code's tolerance and cap, and Picard iteration whose
# per-entry step halves whenever that entry's residual fails to improve (``picard_adaptive``): a converging entry steps
# exactly as plain Picard does; one caught in an oscillation (measured: the non-converging entries of the MiniLM
# retrofit sit in layer 0 and alternate) is damped until it converges.
FPSA_FP_DEFAULTS = {"fp_solver": "picard_adaptive", "fp_tol": 1e-3, "fp_max_iter": 16}


def check_fpsa_settings(s: dict) -> None:
    """Validate a complete dict of ``fpsa_*`` settings; errors name the key and the allowed values."""
    check_choice(s["fpsa_update"], "fpsa_update", UPDATE_FORMS)
    check_choice(s["fpsa_step_norm"], "fpsa_step_norm", STEP_NORMS)
    check_choice(s["fpsa_halting"], "fpsa_halting", HALTING_MODES)
    check_choice(s["fpsa_spectral_norm"], "fpsa_spectral_norm", SPECTRAL_NORMS)
    check_choice(s["fpsa_halt_unit"], "fpsa_halt_unit", HALT_UNITS)
    for key in ("fpsa_learn_temperature", "fpsa_adjoint_mask"):
        check_choice(s[key], key, (True, False))
    check_number(s["fpsa_update_scale"], "fpsa_update_scale", low=0.0, high=1.0, low_open=True)
    check_number(s["fpsa_ponder_budget"], "fpsa_ponder_budget", low=1.0)
    check_number(s["fpsa_ponder_weight"], "fpsa_ponder_weight", low=0.0)
    check_number(s["fpsa_halt_threshold"], "fpsa_halt_threshold", low=0.0, high=1.0, low_open=True, high_open=True)
    check_number(s["fpsa_jac_weight"], "fpsa_jac_weight", low=0.0)
    check_choice(s["fpsa_jac_norm"], "fpsa_jac_norm", JAC_NORMS)
    check_number(s["fpsa_jac_target"], "fpsa_jac_target", low=0.0, high=1.0, high_open=True)
    if s["fpsa_jac_weight"] > 0 and s["fpsa_halting"] == "learned":
        raise ValueError(f"fpsa_jac_weight={s['fpsa_jac_weight']!r} needs fpsa_halting='tolerance': learned halting "
                         "backpropagates through its short loop and builds no Jacobian penalty. Allowed: "
                         "fpsa_jac_weight=0 with fpsa_halting='learned'.")


def pop_fpsa_kwargs(kwargs: dict, defaults: Optional[dict] = None) -> dict:
    """Remove every ``fpsa_*`` key from ``kwargs``; return the complete, validated settings (unknown keys fail).
    ``defaults`` lets a family change a default (e.g. no learned temperature for the decoder retrofits)."""
    given = {k: kwargs.pop(k) for k in [k for k in kwargs if k.startswith("fpsa_")]}
    unknown = (set(given) | set(defaults or {})) - set(FPSA_DEFAULTS)
    if unknown:
        raise ValueError(f"Unknown FPSA setting(s) {sorted(unknown)}. Valid keys: {sorted(FPSA_DEFAULTS)}.")
    settings = {**FPSA_DEFAULTS, **(defaults or {}), **given}
    check_fpsa_settings(settings)
    return settings


def retrofit_config_dict(config_class, config_dict: dict, compatible) -> dict:
    """A checkpoint's config dict for an FPSA config class: its ``model_type`` must be in ``compatible`` (the base
    family or FPSA's own), and it is dropped so the FPSA class's own ``model_type`` applies."""
    model_type = config_dict.get("model_type")
    if model_type is not None and model_type not in compatible:
        raise ValueError(f"{config_class.__name__} cannot load this checkpoint: its model_type={model_type!r} is not "
                         f"one of {tuple(compatible)}.")
    return {k: v for k, v in config_dict.items() if k != "model_type"}


def check_heads(config) -> None:
    if config.hidden_size % config.num_attention_heads:
        raise ValueError(f"hidden_size={config.hidden_size} must be divisible by "
                         f"num_attention_heads={config.num_attention_heads}.")


def check_decoder_fpsa(config) -> None:
    """The FPSA options a causal decoder retrofit supports; errors name the setting and the allowed values."""
    if config.fpsa_halting != "tolerance":
        raise ValueError(f"{type(config).__name__}: fpsa_halting={config.fpsa_halting!r} is not supported by the "
                         "decoder retrofits; allowed: 'tolerance' (learned halting is an encoder feature).")
    if config.fpsa_spectral_norm != "none":
        raise ValueError(f"{type(config).__name__}: fpsa_spectral_norm={config.fpsa_spectral_norm!r} is not "
                         "supported by the decoder retrofits (it would change the pretrained W_Q/W_K); "
                         "allowed: 'none'.")


class FPSAConfigMixin(FixedPointConfigMixin):
    """``FixedPointConfigMixin`` for the FPSA configs, with their ``fpsa_*`` settings too: ``from_pretrained(dir,
    fpsa_x=...)`` keywords join the saved settings before ``__init__`` validates them together, and a later
    ``config.fpsa_x = value`` is validated against the other settings (an unknown ``fpsa_*`` key is an error)."""

    def check_setting(self, key: str, value) -> None:
        if key.startswith("fpsa_"):
            if key not in FPSA_DEFAULTS:
                raise ValueError(f"Unknown FPSA setting {key!r}. Valid keys: {sorted(FPSA_DEFAULTS)}.")
            current = vars(self)
            if all(k in current for k in FPSA_DEFAULTS):  # constructed: ``__init__`` validated them as a whole
                check_fpsa_settings({**{k: current[k] for k in FPSA_DEFAULTS}, key: value})
        super().check_setting(key, value)

    @classmethod
    def from_dict(cls, config_dict, **kwargs):
        fpsa_kwargs = {k: kwargs.pop(k) for k in [k for k in kwargs if k.startswith("fpsa_")]}
        return super().from_dict({**config_dict, **fpsa_kwargs}, **kwargs)


__all__ = [
    "FPSA_DEFAULTS",
    "FPSA_FP_DEFAULTS",
    "HALTING_MODES",
    "HALT_UNITS",
    "JAC_NORMS",
    "SPECTRAL_NORMS",
    "STEP_NORMS",
    "UPDATE_FORMS",
    "FPSAConfigMixin",
    "check_decoder_fpsa",
    "check_fpsa_settings",
    "check_heads",
    "pop_fpsa_kwargs",
    "retrofit_config_dict",
]
