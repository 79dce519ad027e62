"""Optimizers of the puzzle-reasoning recipes, in plain torch (no CUDA extension, so they run on CPU too).

* ``AdamATan2`` -- the update rule of the ``adam-atan2`` CUDA package used by HRM/TRM/URM/FPRM:
  ``atan2(m_hat, sqrt(v_hat))`` replaces ``m_hat / (sqrt(v_hat) + eps)``, so there is no epsilon and the step is
  bounded by ``lr * pi / 2``. Weight decay is decoupled and applied before the update. A learning rate of 0 is allowed
  (the research code builds optimizers with ``lr=0`` and sets it every step).
* ``ema_model`` -- the parameter EMA of TRM/URM/FPRM via ``torch.optim.swa_utils.AveragedModel`` with an EMA
  ``multi_avg_fn`` (``shadow = d * shadow + (1 - d) * p``, every optimizer step). Buffers (the puzzle-embedding
  table, trained by sign-SGD) are not averaged: ``AveragedModel(use_buffers=False)`` copies them from the model at
  every update, as the research code's EMA copy does. The decay warms up, ``d = min(decay, (1 + n) / (warmup + n))``
  after ``n`` updates: the research code's fixed 0.999 over its 50k+ steps forgets the initialization, but over a
  CPU-sized run of a few hundred steps it leaves the evaluated copy close to the random init (A5, FPRM, 400 steps:
  cell accuracy 0.118 with the plain EMA against 0.262 for the raw model). ``warmup=0`` is the plain EMA.
"""

import math

import torch
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn


class AdamATan2(torch.optim.Optimizer):
    r"""Adam with ``atan2`` in place of the division by ``sqrt(v) + eps``.

    For each parameter at step ``t``::

        p <- p * (1 - lr * weight_decay)
        m <- b1 * m + (1 - b1) * g;   v <- b2 * v + (1 - b2) * g^2
        p <- p - lr / (1 - b1^t) * atan2(m, sqrt(v) / sqrt(1 - b2^t))

    Args:
        params: parameters or parameter groups.
        lr: learning rate (>= 0).
        betas: ``(b1, b2)`` in [0, 1).
        weight_decay: decoupled weight decay (>= 0).
    """

    def __init__(self, params, lr: float = 1e-4, betas=(0.9, 0.95), weight_decay: float = 0.1):
        if not (isinstance(lr, (int, float)) and lr >= 0):
            raise ValueError(f"lr must be a number >= 0, got {lr!r}.")
        if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"betas must be two numbers in [0, 1), got {betas!r}.")
        if weight_decay < 0:
            raise ValueError(f"weight_decay must be >= 0, got {weight_decay!r}.")
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, (b1, b2), wd = group["lr"], group["betas"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("AdamATan2 does not support sparse gradients.")
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] += 1
                t = state["step"]
                m, v = state["exp_avg"], state["exp_avg_sq"]
                g = p.grad
                p.mul_(1 - lr * wd)
                m.lerp_(g, 1 - b1)
                v.lerp_(g * g, 1 - b2)
                p.add_(torch.atan2(m, v.sqrt() / math.sqrt(1 - b2**t)), alpha=-lr / (1 - b1**t))
        return loss


def _warmup_ema_fn(decay: float, warmup: int):
    """``multi_avg_fn`` of an EMA whose decay after ``n`` updates is ``min(decay, (1 + n) / (warmup + n))``."""

    @torch.no_grad()
    def update(ema_params, params, num_averaged):
        n = int(num_averaged)
        d = min(decay, (1 + n) / (warmup + n))
        for e, p in zip(ema_params, params):
            e.lerp_(p.to(e.dtype), 1.0 - d)

    return update


def ema_model(model: torch.nn.Module, decay: float = 0.999, warmup: int = 10) -> AveragedModel:
    """An ``AveragedModel`` keeping the EMA of ``model``'s parameters; call ``.update_parameters(model)`` after
    every optimizer step. ``decay`` in [0, 1); ``warmup`` >= 0 (0: the plain EMA with a constant ``decay``; else the
    decay after ``n`` updates is ``min(decay, (1 + n) / (warmup + n))``, so short runs average recent weights)."""
    if not 0.0 <= decay < 1.0:
        raise ValueError(f"decay must lie in [0, 1), got {decay!r}.")
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"warmup must be an integer >= 0, got {warmup!r}.")
    avg_fn = get_ema_multi_avg_fn(decay) if warmup == 0 else _warmup_ema_fn(decay, warmup)
    return AveragedModel(model, multi_avg_fn=avg_fn, use_buffers=False)


__all__ = ["AdamATan2", "ema_model"]
