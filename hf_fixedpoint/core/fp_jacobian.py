# Source of truth: hf_fixedpoint/core/fp_jacobian.py. Verbatim copies live in modeling/*/ so that checkpoints
# saved with save_pretrained() load with torch + transformers only. Edit here, then run
# `python -m hf_fixedpoint.vendor`. Allowed imports: stdlib, torch, and `from .fp_<x> import ...`.
"""Jacobian tools: spectral-radius estimate by power iteration, Hutchinson estimate of ``||J||_F^2``.

Both take ``f`` and a point ``z`` and estimate per entry (``batch_dims`` leading dims; per sample by default, where
``J`` is the Jacobian of that sample's output with respect to that sample's input). With ``create_graph=True`` the
estimate is differentiable, so it can be a training regularizer (STARS' JSRR, DEQ Jacobian regularization).

Products with ``J``:
* ``vjp``: ``v^T J`` through ``torch.autograd.grad`` (works everywhere, differentiable with ``create_graph``);
* ``jvp``: ``J v`` through ``torch.func.jvp`` (forward-mode AD; fails on ops without forward AD, e.g. CPU flash SDPA);
* ``double_backward``: ``J v`` as the VJP of a VJP (no forward AD needed).
"""

import math
from typing import Callable, Optional

import torch

from .fp_registry import check_choice, check_number

PRODUCTS = ("vjp", "jvp", "double_backward")


def _entry_norm(v, batch_dims):
    return torch.linalg.vector_norm(v.reshape(math.prod(v.shape[:batch_dims]), -1), dim=1).view(v.shape[:batch_dims])


def _expand(s, like):
    return s.reshape(s.shape + (1,) * (like.dim() - s.dim()))


def _make_product(f, z, product, fz=None):
    """Return ``prod(v, graph)`` computing ``J v`` (``jvp``, ``double_backward``) or ``J^T v`` (``vjp``); ``fz``:
    ``f(z)`` already evaluated with a graph from ``z`` (which requires grad), used instead of evaluating ``f``."""
    if fz is not None:
        if product == "jvp":
            raise ValueError("product='jvp' evaluates f in forward mode and cannot reuse fz; use 'vjp' or "
                             "'double_backward', or pass fz=None.")
        if not (z.requires_grad and fz.requires_grad):
            raise ValueError("fz must be f(z) evaluated with a graph from z, and z must require grad.")
    if product == "jvp":

        def prod(v, graph):
            out = torch.func.jvp(f, (z,), (v,))[1]
            return out if graph else out.detach()

        return prod
    if fz is None:
        z = z if z.requires_grad else z.detach().requires_grad_()
        with torch.enable_grad():
            fz = f(z)
    if product == "vjp":

        def prod(v, graph):
            return torch.autograd.grad(fz, z, v, create_graph=graph, retain_graph=True)[0]

        return prod
    with torch.enable_grad():
        dummy = torch.zeros_like(fz, requires_grad=True)
        (vjp_dummy,) = torch.autograd.grad(fz, z, dummy, create_graph=True)

    def prod(v, graph):  # d/d(dummy) <vjp(dummy), v> = J v
        return torch.autograd.grad(vjp_dummy, dummy, v, create_graph=graph, retain_graph=True)[0]

    return prod


def spectral_radius(
    f: Callable,
    z: torch.Tensor,
    *,
    n_iter: int = 20,
    product: str = "vjp",
    v0: Optional[torch.Tensor] = None,
    batch_dims: int = 1,
    create_graph: bool = False,
    generator: Optional[torch.Generator] = None,
    return_vector: bool = False,
    fz: Optional[torch.Tensor] = None,
):
    """Power-iteration estimate of the spectral radius of ``J = df/dz`` at ``z``, per entry.

    Runs ``n_iter`` normalized products ``v <- P(v) / ||P(v)||``; the estimate is ``||P(v)||`` of the last one (with a
    unit ``v``). For a dominant real eigenvalue this converges to ``rho(J)``; with ``n_iter=1`` and random ``v0`` its
    square is a Hutchinson estimate of ``||J||_F^2 / n``. Only the last product carries a graph when
    ``create_graph=True``.

    Args:
        n_iter: products (>= 1).
        product: ``vjp``, ``jvp`` or ``double_backward``.
        v0: starting vector shaped like ``z`` (warm start: pass the vector returned last time); random if None.
        return_vector: also return the normalized vector for the next warm start.
        fz: ``f(z)`` already evaluated with a graph from ``z`` (``z`` requires grad; e.g. the evaluation that
            ``fixed_point``'s ``evaluation_hook`` receives): the products reuse it instead of evaluating ``f`` again.

    Returns:
        ``rho`` shaped ``z.shape[:batch_dims]`` (and the vector if asked).
    """
    check_number(n_iter, "n_iter", low=1, integer=True)
    check_choice(product, "product", PRODUCTS)
    prod = _make_product(f, z, product, fz)
    v = torch.randn(z.shape, generator=generator, dtype=z.dtype, device=z.device) if v0 is None else v0.detach()
    v = v / _expand(_entry_norm(v, batch_dims) + 1e-12, v)
    for i in range(n_iter):
        last = i == n_iter - 1
        w = prod(v, create_graph and last)
        rho = _entry_norm(w, batch_dims)
        if not last:
            v = (w / _expand(rho + 1e-12, w)).detach()
    rho = rho if create_graph else rho.detach()
    if return_vector:
        return rho, (w / _expand(rho.detach() + 1e-12, w)).detach()
    return rho


def jacobian_frobenius(
    f: Callable,
    z: torch.Tensor,
    *,
    n_samples: int = 1,
    batch_dims: int = 1,
    create_graph: bool = True,
    generator: Optional[torch.Generator] = None,
    fz: Optional[torch.Tensor] = None,
):
    """Hutchinson estimate of ``||J||_F^2`` per entry: mean over Gaussian ``e`` of ``||e^T J||^2``.

    Divide by the entry size for the normalization of torchdeq's ``jac_reg`` (mean of ``||J||_F^2 / d``). ``fz``:
    as in ``spectral_radius`` (reuse an evaluation ``f(z)`` with its graph).
    """
    check_number(n_samples, "n_samples", low=1, integer=True)
    prod = _make_product(f, z, "vjp", fz)
    total = 0.0
    for _ in range(n_samples):
        e = torch.randn(z.shape, generator=generator, dtype=z.dtype, device=z.device)
        w = prod(e, create_graph)
        total = total + _entry_norm(w, batch_dims) ** 2
    return total / n_samples


__all__ = ["PRODUCTS", "jacobian_frobenius", "spectral_radius"]
