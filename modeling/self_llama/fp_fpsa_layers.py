# Source of truth: hf_fixedpoint/core/fp_fpsa_layers.py. Verbatim copies live in modeling/*/ so that checkpoints
# saved with save_pretrained() load with torch + transformers only. Edit here, then run
# `python -m hf_fixedpoint.vendor`. Allowed imports: stdlib, torch, and `from .fp_<x> import ...`.
"""FPSA in a transformers model: the head mixin that threads ``FPSAStats`` through a head's ``forward`` and adds the
FPSA losses, weight initialisation, and spectral normalisation of W_Q / W_K (/ W_O) with its fold for export."""

from typing import Callable, Optional

import torch
from torch import nn

from .fp_fpsa import FPSAHaltingGate
from .fp_fpsa_stats import FPSAStats, ponder_loss, with_jac_penalty
from .fp_settings import call_knobs


def apply_spectral_norm(linears) -> None:
    """Spectral-normalise the weights of ``linears`` in place (torch parametrization; ``remove_spectral_norm`` folds
    them back into plain weights for export)."""
    for lin in linears:
        torch.nn.utils.parametrizations.spectral_norm(lin)


@torch.no_grad()
def warm_up_spectral_norm(module: nn.Module, n_iter: int = 15) -> None:
    """Restart the power iteration of every spectral-norm parametrization under ``module`` from a fixed start vector.

    Its ``_u``/``_v`` are buffers that a plain checkpoint lacks (``from_pretrained`` leaves them uninitialised);
    ``eval()`` mode uses them as they are, so they must match the loaded weight before the first forward pass.
    """
    for mod in module.modules():
        if not torch.nn.utils.parametrize.is_parametrized(mod, "weight"):
            continue
        for p in mod.parametrizations.weight:
            if hasattr(p, "_power_method"):
                w = p._reshape_weight_to_matrix(mod.parametrizations.weight.original)
                p._v.copy_(nn.functional.normalize(torch.ones_like(p._v), dim=0, eps=p.eps))  # deterministic start
                p._u.copy_(nn.functional.normalize(w @ p._v, dim=0, eps=p.eps))
                p._power_method(w, n_iter)


def init_fpsa_weights(model: nn.Module, module: nn.Module) -> None:
    """The FPSA part of a model's ``_init_weights``: temperature 1, halting gate at the ponder budget, and a fresh
    power iteration for spectral-norm vectors a checkpoint lacked (``from_pretrained`` calls it after loading)."""
    if isinstance(getattr(module, "fpsa_log_tau", None), nn.Parameter):
        module.fpsa_log_tau.zero_()  # tau = 1: the base model's softmax scale
    elif isinstance(module, FPSAHaltingGate):
        module.reset_parameters(model.config.fpsa_ponder_budget)
    elif type(module).__name__ == "_SpectralNorm":
        owner = next(m for m in model.modules()
                     if any(p is module for p in getattr(getattr(m, "parametrizations", {}), "weight", ())))
        warm_up_spectral_norm(owner)


class FPSAHeadMixin:
    """Put before a transformers head class (``BertForX``, ``ViTForX``) whose base model is an FPSA model: runs the
    head's own ``forward`` with an ``FPSAStats`` threaded through the base model, returns ``output_class`` (the head's
    output plus ``fp_stats``) and, with learned halting, adds the ponder loss to the task loss."""

    output_class = None

    def __init_subclass__(cls, **kwargs):
        # Trainer(remove_unused_columns=True) and generate() keep only the inputs named in forward's signature: give
        # each head a forward whose signature is the transformers head's own plus the per-call knobs.
        import inspect

        super().__init_subclass__(**kwargs)
        if "forward" in cls.__dict__:
            return
        head = inspect.signature(super(FPSAHeadMixin, cls).forward)
        params = [p for p in head.parameters.values() if p.kind != p.VAR_KEYWORD]
        params += [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=None, annotation=annotation)
                   for name, annotation in (("fp_max_iter", Optional[int]), ("fp_tol", Optional[float]),
                                            ("fp_overrides", Optional[dict]))]
        params += [p for p in head.parameters.values() if p.kind == p.VAR_KEYWORD]

        def forward(self, *args, **kwargs):
            return FPSAHeadMixin.forward(self, *args, **kwargs)

        forward.__signature__ = head.replace(parameters=params, return_annotation=cls.output_class)
        forward.__doc__ = FPSAHeadMixin.forward.__doc__
        forward.__qualname__ = f"{cls.__qualname__}.forward"
        cls.forward = forward

    def fpsa_margin_fn(self) -> Optional[Callable]:
        """Learned halting: the task head applied to an iterate, for the logit-margin feature (None: no margin)."""
        return None

    def forward(self, *args, fp_max_iter: Optional[int] = None, fp_tol: Optional[float] = None,
                fp_overrides: Optional[dict] = None, **kwargs):
        """The transformers head's ``forward`` with the per-call fixed-point knobs (``fp_max_iter``, ``fp_tol``, any
        other ``fp_*`` setting as a keyword, or ``fp_overrides={...}``); the output adds ``fp_stats``.
        ``return_dict=False`` (or ``config.return_dict=False``) gives a tuple."""
        fp_overrides = call_knobs(self.config, kwargs, type(self).__name__, fp_overrides, fp_max_iter, fp_tol)
        stats = FPSAStats()
        learned = self.config.fpsa_halting == "learned"
        if learned and self.fpsa_margin_fn() is not None:
            kwargs["fpsa_margin_fn"] = self.fpsa_margin_fn()
        return_dict = kwargs.pop("return_dict", None)
        return_dict = getattr(self.config, "return_dict", True) if return_dict is None else return_dict
        kwargs["return_dict"] = True
        out = self.output_class(**super().forward(*args, fp_overrides=fp_overrides, fpsa_stats=stats, **kwargs),
                                fp_stats=stats)
        if out.loss is not None and learned:
            out.loss = out.loss + ponder_loss(stats, self.config.fpsa_ponder_budget, self.config.fpsa_ponder_weight)
        out = with_jac_penalty(out, stats, self.config.fpsa_jac_weight)
        return out if return_dict else out.to_tuple()


def remove_spectral_norm(model: nn.Module) -> None:
    """Fold every spectral-norm parametrization of ``model`` into a plain weight (the value used in ``eval()``) and
    record it in ``model.config.fpsa_spectral_norm`` so the saved checkpoint is a plain one."""
    was_training = model.training
    model.eval()
    for mod in list(model.modules()):
        if torch.nn.utils.parametrize.is_parametrized(mod, "weight"):
            torch.nn.utils.parametrize.remove_parametrizations(mod, "weight", leave_parametrized=True)
    model.train(was_training)
    if hasattr(getattr(model, "config", None), "fpsa_spectral_norm"):
        model.config.fpsa_spectral_norm = "none"


__all__ = ["FPSAHeadMixin", "apply_spectral_norm", "init_fpsa_weights", "remove_spectral_norm",
           "warm_up_spectral_norm"]
