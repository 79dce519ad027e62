"""Backward modes against exact gradients (float64 dense adjoint solves) and torch.autograd.gradcheck."""

import warnings

import pytest
import torch

from hf_fixedpoint import BACKWARDS, FixedPointWarning, fixed_point
from tests.core.problems import exact_gradients, rel_err, tanh_problem

SOLVERS = ["picard", "fpopt", "picard_adaptive", "anderson", "broyden"]
MODES = ["ift", "phantom", "one_step", "bptt"]
TIGHT = {"tol": 1e-12, "max_iter": 2000}


@pytest.fixture(scope="module")
def easy():
    f, W, x = tanh_problem(B=3, D=6, norm=0.9)
    c = torch.randn(3, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    zs, gW, gx = exact_gradients(f, W, x, c)
    return f, W, x, c, zs, gW, gx


def _grads(f, W, x, c, **kw):
    W.grad, x.grad = None, None
    z, stats = fixed_point(f, torch.zeros_like(x.detach()), args=(x,), **kw)
    (z * c).sum().backward()
    return z, stats, W.grad.clone(), x.grad.clone()


@pytest.mark.parametrize("solver", SOLVERS)
@pytest.mark.parametrize("backward_solver", SOLVERS)
def test_ift_matches_exact_gradient_for_every_solver_pair(easy, solver, backward_solver):
    f, W, x, c, zs, gW, gx = easy
    z, stats, dW, dx = _grads(f, W, x, c, solver=solver, tol=1e-12, max_iter=2000,
                              backward_kwargs={"solver": backward_solver, **TIGHT})
    assert rel_err(z.detach(), zs) < 1e-10
    assert rel_err(dW, gW) < 1e-10 and rel_err(dx, gx) < 1e-10
    assert stats.backward is not None and stats.backward.converged.all()


def test_ift_hard_case_fp64():
    f, W, x = tanh_problem(B=2, D=6, norm=0.99, symmetric=True, inj=0.1)
    c = torch.randn(2, 6, dtype=torch.float64)
    _, gW, gx = exact_gradients(f, W, x, c)
    _, _, dW, dx = _grads(f, W, x, c, solver="broyden", tol=1e-13, max_iter=3000, backward_kwargs=TIGHT)
    assert rel_err(dW, gW) < 1e-10 and rel_err(dx, gx) < 1e-10


@pytest.mark.parametrize("solver", SOLVERS)
@pytest.mark.parametrize("mode", MODES)
def test_every_solver_backward_pair_runs_and_values_are_z_star(easy, solver, mode):
    # The backward mode changes gradients only: the value is always the solver's z*.
    f, W, x, c, zs, gW, gx = easy
    z, stats, dW, dx = _grads(f, W, x, c, solver=solver, tol=1e-11, max_iter=2000, backward=mode)
    assert rel_err(z.detach(), zs) < 1e-9
    # Full bptt differentiates a Picard unroll as long as the forward solve: exact after a Picard forward, close after
    # an accelerated one (fewer steps than Picard needs).
    exact = mode == "ift" or (mode == "bptt" and solver in ("picard", "fpopt"))
    assert torch.isfinite(dW).all() and rel_err(dW, gW) < (1e-8 if exact else 1e-2 if mode == "bptt" else 0.6)


def test_approximate_modes_have_the_expected_bias(easy):
    # JFB is biased (torchdeq measured 31-38% on easy cases); more phantom steps reduce the bias; full BPTT through a
    # converged Picard unroll equals the implicit gradient.
    f, W, x, c, zs, gW, gx = easy
    err = {}
    for mode, kw in [("one_step", {}), ("phantom", {"steps": 2}), ("phantom", {"steps": 10}), ("bptt", {})]:
        _, _, dW, _ = _grads(f, W, x, c, solver="picard", tol=1e-12, max_iter=500, backward=mode, backward_kwargs=kw)
        err[(mode, kw.get("steps"))] = rel_err(dW, gW)
    assert err[("one_step", None)] > 0.05
    assert err[("phantom", 10)] < err[("phantom", 2)] < err[("one_step", None)]
    assert err[("bptt", None)] < 1e-8


def test_bptt_truncated_equals_phantom(easy):
    f, W, x, c, *_ = easy
    _, _, a, _ = _grads(f, W, x, c, solver="picard", tol=1e-12, backward="bptt", backward_kwargs={"steps": 3})
    _, _, b, _ = _grads(f, W, x, c, solver="picard", tol=1e-12, backward="phantom", backward_kwargs={"steps": 3})
    torch.testing.assert_close(a, b)


def test_full_bptt_reaches_z0():
    W = torch.randn(4, 4, dtype=torch.float64) * 0.2
    z0 = torch.randn(2, 4, dtype=torch.float64, requires_grad=True)
    z, stats = fixed_point(lambda z: torch.tanh(z @ W.T + 1), z0, solver="picard", tol=1e-3, max_iter=3,
                           min_iter=3, backward="bptt", backward_kwargs={"steps": None})
    z.sum().backward()
    assert z0.grad is not None and z0.grad.abs().sum() > 0


@pytest.mark.parametrize("mode", MODES)
def test_gradcheck_every_backward_mode(mode):
    # gradcheck differentiates the whole solve numerically. For ift and full bptt the analytic gradient is the exact
    # one; phantom/one_step define a different (surrogate) gradient, so they are checked against their own
    # definition: the same number of differentiable steps unrolled from the detached z*.
    D = 4
    W = torch.randn(D, D, dtype=torch.float64)
    W = 0.5 * W / torch.linalg.matrix_norm(W, 2)
    x = torch.randn(2, D, dtype=torch.float64, requires_grad=True)
    f = lambda z, x: torch.tanh(z @ W.T + x)
    kw = {"solver": "anderson", "tol": 1e-13, "max_iter": 500}

    def solved(x):
        return fixed_point(f, torch.zeros(2, D, dtype=torch.float64), args=(x,), backward=mode,
                           backward_kwargs=TIGHT if mode == "ift" else None, **kw)[0]

    if mode in ("ift", "bptt"):
        assert torch.autograd.gradcheck(solved, (x,), eps=1e-6, atol=1e-7)
    else:
        steps = 1 if mode == "one_step" else 5
        z_star = solved(x).detach()

        def surrogate(x):
            z = z_star
            for _ in range(steps):
                z = f(z, x)
            return z

        y = torch.randn(2, D, dtype=torch.float64)
        (g_mode,) = torch.autograd.grad((solved(x) * y).sum(), x)
        (g_ref,) = torch.autograd.grad((surrogate(x) * y).sum(), x)
        torch.testing.assert_close(g_mode, g_ref)
        assert torch.autograd.gradcheck(surrogate, (x,))


def test_gradients_flow_in_eval_mode_and_closures():
    # Gradient semantics depend on grad mode only (torchdeq returns no-grad outputs in eval()).
    lin = torch.nn.Linear(4, 4).double().eval()
    with torch.no_grad():
        lin.weight.mul_(0.1)
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)  # closed over, not in args
    z, _ = fixed_point(lambda z: torch.tanh(lin(z) + x), torch.zeros(3, 4, dtype=torch.float64))
    z.sum().backward()
    assert lin.weight.grad is not None and x.grad is not None


def test_ift_backward_under_bf16_autocast():
    # The adjoint reuses the evaluation of f made under the forward's autocast: fp32 weights, bf16 activations.
    torch.manual_seed(0)
    lin = torch.nn.Linear(16, 16)
    with torch.no_grad():
        lin.weight.mul_(0.3)
    x = torch.randn(4, 16)

    def grads(autocast):
        lin.zero_grad()
        dtype = torch.bfloat16 if autocast else torch.float32  # the state and injection are bf16, as in a model
        z0, inj = torch.zeros(4, 16, dtype=dtype), x.to(dtype)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            z, _ = fixed_point(lambda z: torch.tanh(lin(z) + inj), z0, tol=1e-2, backward="ift")
        assert z.dtype == dtype
        z.float().square().sum().backward()
        return lin.weight.grad.clone()

    g32, g16 = grads(False), grads(True)
    assert torch.isfinite(g16).all()
    assert rel_err(g16, g32) < 0.05


def test_no_grad_skips_backward_work():
    calls = []
    W = torch.randn(4, 4, dtype=torch.float64, requires_grad=True)

    def f(z):
        calls.append(1)
        return torch.tanh(z @ (0.1 * W).T + 1)

    with torch.no_grad():
        z, stats = fixed_point(f, torch.zeros(2, 4, dtype=torch.float64))
    assert len(calls) == stats.nfe and not z.requires_grad


def test_two_calls_in_one_graph():
    # torchdeq's hook-based IFT recurses forever here; the Function-based one must add both contributions.
    f, W, x = tanh_problem(B=2, D=5, norm=0.9)
    c = torch.randn(2, 5, dtype=torch.float64)
    _, gW, _ = exact_gradients(f, W, x, c)
    W.grad = None
    z1, _ = fixed_point(f, torch.zeros(2, 5, dtype=torch.float64), args=(x,), tol=1e-12, backward_kwargs=TIGHT)
    z2, _ = fixed_point(f, torch.zeros(2, 5, dtype=torch.float64), args=(x,), tol=1e-12, backward_kwargs=TIGHT)
    ((z1 + z2) * c).sum().backward()
    assert rel_err(W.grad, 2 * gW) < 1e-10


def test_unconverged_adjoint_warns_and_reports():
    f, W, x = tanh_problem(B=2, D=8, norm=0.99, symmetric=True, inj=0.1)
    z, stats = fixed_point(f, torch.zeros(2, 8, dtype=torch.float64), args=(x,), tol=1e-10, max_iter=2000,
                           backward_kwargs={"solver": "picard", "tol": 1e-12, "max_iter": 3})
    with pytest.warns(FixedPointWarning, match="adjoint solve"):
        z.sum().backward()
    assert not stats.backward.converged.all()
    assert stats.summary()["fp_backward_converged_fraction"] < 1


def test_masked_adjoint_excludes_unconverged_entries():
    # Entry 1 is masked out: its adjoint is g (no implicit term); entry 0 keeps the exact implicit gradient.
    f, W, x = tanh_problem(B=2, D=4, norm=0.9)
    c = torch.randn(2, 4, dtype=torch.float64)
    _, gW, gx = exact_gradients(f, W, x, c)
    x.grad = None
    mask = torch.tensor([True, False])
    z, _ = fixed_point(f, torch.zeros(2, 4, dtype=torch.float64), args=(x,), tol=1e-12,
                       backward_kwargs={"mask": mask, **TIGHT})
    (z * c).sum().backward()
    assert rel_err(x.grad[0], gx[0]) < 1e-10
    zs = z.detach()[1:2]
    (one_step,) = torch.autograd.grad((f(zs, x[1:2]) * c[1:2]).sum(), x)
    torch.testing.assert_close(x.grad[1], one_step[1])


def test_masked_adjoint_converged_keyword():
    f, W, x = tanh_problem(B=2, D=4, norm=0.99, symmetric=True, inj=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FixedPointWarning)
        z, stats = fixed_point(f, torch.zeros(2, 4, dtype=torch.float64), args=(x,), tol=1e-14, max_iter=3,
                               solver="picard", backward_kwargs={"mask": "converged"})
        z.sum().backward()
    assert not stats.converged.any()
    assert x.grad is not None


def test_backward_registry():
    assert BACKWARDS.names() == sorted(MODES)


def test_ift_evaluates_f_once_with_gradients_and_shares_it_with_the_hook():
    # One evaluation with a graph serves the adjoint, the parameter gradient and a Jacobian regulariser: a loss with a
    # Hutchinson penalty on it has the gradient of the exact implicit term plus the penalty's own (float64).
    from hf_fixedpoint.core.fp_jacobian import jacobian_frobenius

    f, W, x = tanh_problem(B=3, D=6, norm=0.9)
    c = torch.randn(3, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    zs, gW, _ = exact_gradients(f, W, x, c)
    graph_calls, seen = [], {}

    def counted(z, x):
        graph_calls.append(torch.is_grad_enabled())
        return f(z, x)

    def hook(h, fh):
        seen["h"] = h
        seen["penalty"] = jacobian_frobenius(None, h, batch_dims=0, fz=fh, generator=torch.Generator().manual_seed(2))

    W.grad = None
    z, _ = fixed_point(counted, torch.zeros(3, 6, dtype=torch.float64), args=(x,), tol=1e-12, max_iter=2000,
                       backward_kwargs=TIGHT, evaluation_hook=hook)
    ((z * c).sum() + seen["penalty"]).backward()
    assert sum(graph_calls) == 1  # the forward solve runs without a graph, the backward does not re-evaluate f
    assert rel_err(seen["h"].detach(), zs) < 1e-10
    ref = jacobian_frobenius(lambda v: f(v, x), zs, batch_dims=0, generator=torch.Generator().manual_seed(2))
    (g_pen,) = torch.autograd.grad(ref, W)
    assert rel_err(W.grad, gW + g_pen) < 1e-8


@pytest.mark.parametrize("mode", ["phantom", "one_step", "bptt"])
def test_other_modes_give_the_hook_an_evaluation_at_z_star(easy, mode):
    f, W, x, c, zs, gW, gx = easy
    seen = []
    fixed_point(f, torch.zeros_like(x.detach()), args=(x,), tol=1e-12, max_iter=2000, backward=mode,
                evaluation_hook=lambda h, fh: seen.append((h, fh)))
    ((h, fh),) = seen
    assert h.requires_grad and rel_err(h.detach(), zs) < 1e-10
    torch.testing.assert_close(fh, f(h, x))


def test_ift_under_non_reentrant_checkpointing_recomputes_the_region_once():
    # The adjoint's products run one graph task each on the shared graph: its tensors are kept as they are, not
    # checkpointed, or every product would recompute the region (its forward solve included).
    from torch.utils.checkpoint import checkpoint

    f, W, x = tanh_problem(B=3, D=6, norm=0.9)
    c = torch.randn(3, 6, dtype=torch.float64)
    _, gW, gx = exact_gradients(f, W, x, c)
    calls = []

    def counted(z, x):
        calls.append(1)
        return f(z, x)

    def block(x):
        return fixed_point(counted, torch.zeros_like(x), args=(x,), tol=1e-12, max_iter=2000,
                           backward_kwargs=TIGHT)[0]

    W.grad = x.grad = None
    z = checkpoint(block, x, use_reentrant=False)
    forward_calls = len(calls)
    (z * c).sum().backward()
    assert len(calls) - forward_calls <= forward_calls + 1  # one recompute of the region, then no more evaluations
    assert rel_err(W.grad, gW) < 1e-10 and rel_err(x.grad, gx) < 1e-10


def test_frozen_map_under_enable_grad_gives_an_output_without_grad():
    f, W, x = tanh_problem(B=2, D=5, norm=0.9)
    W.requires_grad_(False)
    z, _ = fixed_point(f, torch.zeros(2, 5, dtype=torch.float64), args=(x.detach(),))
    assert not z.requires_grad
    z, _ = fixed_point(f, torch.zeros(2, 5, dtype=torch.float64), args=(x,))  # the injection still needs a gradient
    assert z.requires_grad


def test_the_leaf_of_the_shared_evaluation_keeps_no_gradient():
    f, W, x = tanh_problem(B=2, D=5, norm=0.9)
    seen = []
    z, _ = fixed_point(f, torch.zeros(2, 5, dtype=torch.float64), args=(x,),
                       evaluation_hook=lambda h, fh: seen.append(h))
    z.sum().backward()
    assert seen[0].grad is None and W.grad is not None


@pytest.mark.parametrize("mode", MODES)
def test_evaluation_context_wraps_the_hook_evaluation_only(easy, mode):
    import contextlib

    f, W, x, c, zs, gW, gx = easy
    inside, calls_inside = [False], []

    @contextlib.contextmanager
    def context():
        inside[0] = True
        yield
        inside[0] = False

    def counted(z, x):
        if torch.is_grad_enabled():
            calls_inside.append(inside[0])
        return f(z, x)

    z, _ = fixed_point(counted, torch.zeros_like(x.detach()), args=(x,), tol=1e-10, max_iter=2000, backward=mode,
                       backward_kwargs={"steps": 3} if mode == "bptt" else None,
                       evaluation_hook=lambda h, fh: None, evaluation_context=context)
    assert calls_inside.count(True) == 1  # the hook's evaluation; a phantom / bptt unroll runs outside it
    assert len(calls_inside) == {"ift": 1, "one_step": 2, "phantom": 6, "bptt": 4}[mode]
    with pytest.raises(ValueError, match="evaluation_context is the context of evaluation_hook"):
        fixed_point(f, torch.zeros_like(x.detach()), args=(x,), evaluation_context=context)
