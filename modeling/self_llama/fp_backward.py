# Source of truth: hf_fixedpoint/core/fp_backward.py. Verbatim copies live in modeling/*/ so that checkpoints
# saved with save_pretrained() load with torch + transformers only. Edit here, then run
# `python -m hf_fixedpoint.vendor`. Allowed imports: stdlib, torch, and `from .fp_<x> import ...`.
"""``fixed_point``: a differentiable fixed-point solve, and the backward (gradient) modes behind it.

The forward solve never builds a graph. How gradients reach the parameters and inputs of ``f`` is the backward mode:

* ``ift`` -- implicit function theorem: ``dL/dtheta = u^T df/dtheta`` with ``u = J^T u + dL/dz*`` solved by any
  registered solver (its own tolerance and cap). An adjoint that misses its tolerance is warned about and reported in
  ``stats.backward`` (the warning needs a host read: with the forward's ``check_every != 1`` the adjoint, solved with
  the same ``check_every``, is reported in ``stats.backward`` only). ``adjoint_mask`` (or ``"converged"``) drops
  the implicit term for masked-out entries, as FPSA does for tokens that did not converge: ``u = g + M * (J^T u)``.
* ``phantom`` -- ``steps`` damped steps ``z <- (1 - damping) z + damping f(z)`` from ``z*`` with gradient.
* ``one_step`` -- Jacobian-free backprop (JFB): one step ``f(z*)`` with gradient.
* ``bptt`` -- backprop through a Picard unroll: the last ``steps`` steps from ``z*``, or, with ``steps=None`` (or at
  least the number of forward evaluations), the whole unroll from ``z0`` (then ``z0`` gets a gradient too).

A mode in ``BACKWARDS`` is called as ``mode(f, z0, z_star, stats, **its_options, _forward=SolveOptions,
_evaluation=(h, f(h)) or None)``; ``_evaluation`` is the graph ``fixed_point`` built for its ``evaluation_hook``.

The returned value is always the solver's ``z*``; the mode changes gradients only, never values. Gradients depend on
``torch.is_grad_enabled()`` alone, never on ``module.training``: a model loaded with ``from_pretrained`` (which is
put in ``eval()`` mode) trains as expected.
"""

import collections
import contextlib
import warnings
from typing import Callable, Optional, Sequence

import torch
from torch.autograd.function import once_differentiable

from .fp_registry import Registry, check_keywords, check_number, keyword_options
from .fp_solvers import SolveOptions, resolve_options, solve, solver_kwargs_check
from .fp_stats import FixedPointWarning

BACKWARDS = Registry("backward mode")


class _ImplicitGrad(torch.autograd.Function):
    """Identity on ``z*`` in the forward; in the backward, solves the adjoint system with the graph of ``fh = f(h)``
    (``h = z*`` as a leaf that requires grad, built once in the forward) and sends ``u`` into ``fh``."""

    @staticmethod
    def forward(ctx, z_star, fh, h, options, clip, stats, mask):
        ctx.options, ctx.clip, ctx.stats, ctx.mask = options, clip, stats, mask
        with _kept_as_is():
            ctx.save_for_backward(fh, h)
        return z_star.clone()

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        fh, h = ctx.saved_tensors
        mask, clip = ctx.mask, ctx.clip

        def adjoint_map(u):
            # Re-entrant: the outer backward reaches fh's graph only after this returns, so it is still whole.
            (jtu,) = torch.autograd.grad(fh, h, u.to(fh.dtype), retain_graph=True)
            jtu = jtu.to(u.dtype)
            if clip is not None:  # per sample: ||J^T u|| <= clip * ||u|| keeps the adjoint map contractive
                un = torch.linalg.vector_norm(u.flatten(1), dim=1)
                jn = torch.linalg.vector_norm(jtu.flatten(1), dim=1)
                scale = (clip * un / jn.clamp_min(torch.finfo(jn.dtype).tiny)).clamp(max=1.0)
                jtu = jtu * scale.view((-1,) + (1,) * (jtu.dim() - 1))
            return grad + (jtu if mask is None else mask * jtu)

        opts = ctx.options
        u, bstats = solve(adjoint_map, grad, options=opts, check=False)
        if ctx.stats is not None:
            ctx.stats.backward = bstats
        if opts.check_every == 1 and not bool(bstats.converged.all()):  # else: no host read, see stats.backward
            # A constant message, so Python's default filter shows it once per call site instead of every step;
            # the numbers are in stats.backward.
            warnings.warn(
                f"implicit backward: the adjoint solve ({opts.solver}) did not reach rel tol {opts.tol:g} "
                f"within {opts.max_iter} steps for some samples; gradients are approximate (see stats.backward). "
                f"Raise fp_backward_max_iter, use another fp_backward_solver, or regularize the Jacobian.",
                FixedPointWarning,
                stacklevel=2,
            )
        return None, u, None, None, None, None, None


def _keep(t):
    return t


def _kept_as_is():
    """Saved-tensor hooks that keep tensors as they are, over any outer ones. Non-reentrant activation checkpointing
    recomputes its region once per backward graph task; the adjoint solve runs one graph task per product on the shared
    graph, so a checkpointed graph would recompute the whole layer (its forward solve included) per product."""
    return torch.autograd.graph.saved_tensors_hooks(_keep, _keep)


def differentiable_evaluation(f: Callable, z_star: torch.Tensor, context: Optional[Callable] = None):
    """``(h, f(h))`` with ``h`` a leaf copy of ``z*`` that requires grad: the graph an implicit backward and a
    Jacobian regulariser at the fixed point can share (``fixed_point``'s ``evaluation_hook``). Its saved tensors are
    kept as they are (not checkpointed, see ``_kept_as_is``); ``context()``, if given, is entered around ``f``."""
    h = z_star.detach().requires_grad_()
    with _kept_as_is(), (context() if context is not None else contextlib.nullcontext()):
        return h, f(h)


def _reaches_other_leaves(fh: torch.Tensor, h: torch.Tensor) -> bool:
    """Whether the graph of ``fh`` reaches a tensor that requires grad other than the leaf ``h``: breadth first, so
    the parameters of ``f`` are found after a few nodes; a frozen ``f`` is walked whole (its own graph, then whatever
    its other inputs came from)."""
    queue, seen = collections.deque([fh.grad_fn]), set()
    while queue:
        node = queue.popleft()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)  # an AccumulateGrad node: a leaf that requires grad
        if variable is not None:
            if variable is not h:
                return True
            continue
        queue.extend(nxt for nxt, _ in node.next_functions)
    return False


def _drop_grad(t):
    t.grad = None


def _straight_through(z_star, z_grad):
    """Value of ``z_star``, gradient of ``z_grad``."""
    return z_star + (z_grad - z_grad.detach())


def _picard_unroll(f, z, steps, damping):
    for _ in range(steps):
        z = f(z) if damping == 1.0 else z + damping * (f(z) - z)
    return z


@BACKWARDS.register("ift")
def ift(f, z0, z_star, stats, *, solver="anderson", tol=None, max_iter=None, solver_kwargs=None, mask=None,
        clip=None, _forward=None, _evaluation=None):
    """Implicit differentiation; defaults: forward tolerance and cap (``_forward``, the forward ``SolveOptions``),
    Anderson adjoint. One evaluation ``(h, f(h))`` with a graph serves the adjoint's products and the gradient of what
    ``f`` uses: ``_evaluation``, the one ``fixed_point`` made for its ``evaluation_hook``, or a new one.

    ``clip`` (adjoint gradient clipping, as in the Attractor models' code): inside the adjoint map, rescale ``J^T u``
    per sample so that ``||J^T u|| <= clip * ||u||``; with ``clip < 1`` the adjoint iteration stays a contraction even
    when training has pushed ``f`` towards a non-contractive regime. ``None`` (default) leaves ``J^T u`` unchanged.
    """
    options = SolveOptions(solver=solver, tol=_forward.tol if tol is None else tol, stop_mode="rel",
                           max_iter=_forward.max_iter if max_iter is None else max_iter,
                           solver_kwargs=solver_kwargs or None, return_mode="last",
                           check_every=_forward.check_every)
    h, fh = differentiable_evaluation(f, z_star) if _evaluation is None else _evaluation
    h.register_post_accumulate_grad_hook(_drop_grad)  # the outer backward also reaches h: nothing needs dL/dh
    if not _reaches_other_leaves(fh, h):  # nothing f uses requires grad (a frozen model under enable_grad)
        return z_star
    if isinstance(mask, str):
        mask = stats.converged
    if mask is not None:
        mask = mask.to(z_star.dtype).reshape(mask.shape + (1,) * (z_star.dim() - mask.dim()))
    return _ImplicitGrad.apply(z_star, fh, h, options, clip, stats, mask)


@BACKWARDS.register("phantom")
def phantom(f, z0, z_star, stats, *, steps=5, damping=1.0, _forward=None, _evaluation=None):
    """Phantom gradient: ``steps`` damped steps from ``z*`` with gradient."""
    return _straight_through(z_star, _picard_unroll(f, z_star, steps, damping))


@BACKWARDS.register("one_step")
def one_step(f, z0, z_star, stats, *, _forward=None, _evaluation=None):
    """Jacobian-free backprop: one step ``f(z*)`` with gradient."""
    return _straight_through(z_star, f(z_star))


@BACKWARDS.register("bptt")
def bptt(f, z0, z_star, stats, *, steps=None, damping=1.0, _forward=None, _evaluation=None):
    """Backprop through a Picard unroll (see module docstring)."""
    if steps is None or steps >= stats.nfe:
        return _straight_through(z_star, _picard_unroll(f, z0, stats.nfe, damping))
    return _straight_through(z_star, _picard_unroll(f, z_star, steps, damping))


def backward_kwargs_check(backward: str, kwargs: Optional[dict], argument: str = "backward_kwargs") -> dict:
    """Validate the options of a backward mode (errors list the allowed keys and values)."""
    fn = BACKWARDS.get(backward)
    kwargs = dict(kwargs or {})
    if not kwargs:
        return kwargs
    check_keywords(kwargs, keyword_options(fn, keyword_only=True), argument, f"backward {backward!r}")
    if "steps" in kwargs and not (backward == "bptt" and kwargs["steps"] is None):
        check_number(kwargs["steps"], f"{argument}['steps']", low=1, integer=True)
    if "damping" in kwargs:
        check_number(kwargs["damping"], f"{argument}['damping']", low=0.0, high=1.0, low_open=True)
    if backward == "ift":
        if kwargs.get("solver") is not None:
            solver_kwargs_check(kwargs["solver"], kwargs.get("solver_kwargs"), f"{argument}['solver_kwargs']")
        if kwargs.get("tol") is not None:
            check_number(kwargs["tol"], f"{argument}['tol']", low=0.0, low_open=True)
        if kwargs.get("max_iter") is not None:
            check_number(kwargs["max_iter"], f"{argument}['max_iter']", low=1, integer=True)
        if kwargs.get("clip") is not None:
            check_number(kwargs["clip"], f"{argument}['clip']", low=0.0, low_open=True)
        mask = kwargs.get("mask")
        if isinstance(mask, str) and mask != "converged":
            raise ValueError(f"{argument}['mask']={mask!r} is not allowed. Allowed values: None, 'converged', "
                             "or a bool tensor shaped like the entries.")
    return kwargs


def fixed_point(f: Callable, z0: torch.Tensor, *, args: Sequence = (), options: Optional[SolveOptions] = None,
                backward: str = "ift", backward_kwargs: Optional[dict] = None, row_mask: Optional[torch.Tensor] = None,
                residual_fn: Optional[Callable] = None, check: bool = True,
                evaluation_hook: Optional[Callable] = None, evaluation_context: Optional[Callable] = None,
                **option_changes):
    """Find ``z* = f(z*, *args)`` and make it differentiable with respect to everything ``f`` uses.

    Args:
        f: the map, called as ``f(z, *args)``; it may close over parameters and tensors. Samples must not interact
            through it where ``solve`` says so (``compact``; ``picard`` with ``batch_dims=1``).
        z0: initial iterate. The first ``batch_dims`` dims index entries whose convergence is judged separately.
        args, options, row_mask, residual_fn, check, **option_changes: see ``fp_solvers.solve``; the solve options
            (``solver``, ``tol``, ``max_iter``, ...) are the fields of ``fp_solvers.SolveOptions`` (the backward calls
            ``f`` without ``active``).
        backward: ``ift`` (default), ``phantom``, ``one_step`` or ``bptt`` (see the module docstring).
        backward_kwargs: options of the backward mode: ``ift``: ``solver``, ``tol``, ``max_iter``,
            ``solver_kwargs``, ``mask``, ``clip``; ``phantom``: ``steps``, ``damping``; ``bptt``: ``steps``,
            ``damping``.
        evaluation_hook: with gradients enabled, called as ``evaluation_hook(h, fh)`` with ``h`` a leaf copy of
            ``z*`` that requires grad and ``fh = f(h, *args)`` with its graph: a Jacobian regulariser at the fixed
            point (``fp_jacobian``'s ``fz=``) reuses it. ``ift`` builds its backward on the same evaluation, so the
            regulariser costs no extra evaluation of ``f``; the other modes evaluate once more for it. The regulariser
            and the loss on ``z*`` must go through one backward (or the first with ``retain_graph=True``): they share
            the graph.
        evaluation_context: with ``evaluation_hook``, a callable returning the context manager that evaluation runs
            in (e.g. ``lambda: sdpa_kernel(SDPBackend.MATH)`` where the regulariser needs a double backward).

    Returns:
        ``(z_star, stats)``: ``z_star`` shaped like ``z0``; ``stats`` a ``FixedPointStats``.

    Example:
        >>> W = torch.randn(8, 8) * 0.1; x = torch.randn(4, 8, requires_grad=True)
        >>> z, stats = fixed_point(lambda z: torch.tanh(z @ W.T + x), torch.zeros(4, 8))
        >>> z.sum().backward()   # implicit gradient into x
    """
    opts = resolve_options(options, check, **option_changes)
    if check:
        backward_kwargs = backward_kwargs_check(backward, backward_kwargs)
    if evaluation_context is not None and evaluation_hook is None:
        raise ValueError("evaluation_context is the context of evaluation_hook's evaluation; pass evaluation_hook too "
                         "(or evaluation_context=None).")
    z_star, stats = solve(f, z0, args=args, options=opts, row_mask=row_mask, residual_fn=residual_fn, check=False)
    if not torch.is_grad_enabled():
        return z_star, stats
    args = tuple(args)
    fn = (lambda z: f(z, *args)) if args else f
    mode = BACKWARDS.get(backward)
    evaluation = None
    if evaluation_hook is not None:  # ift builds its backward on this evaluation; the other modes build none at z*
        evaluation = differentiable_evaluation(fn, z_star, evaluation_context)
        evaluation_hook(*evaluation)
    z_out = mode(fn, z0, z_star, stats, **(backward_kwargs or {}), _forward=opts, _evaluation=evaluation)
    return z_out, stats


__all__ = ["BACKWARDS", "backward_kwargs_check", "differentiable_evaluation", "fixed_point"]
