"""Jacobian tools against exact answers: linear maps f(z) = z A^T with known eigenvalues (float64)."""

import math

import pytest
import torch

from hf_fixedpoint.core.fp_jacobian import PRODUCTS, jacobian_frobenius, spectral_radius

DT = torch.float64


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def symmetric_matrix(eigs, seed=0):
    """``Q diag(eigs) Q^T`` with a random orthogonal ``Q``."""
    eigs = torch.as_tensor(eigs, dtype=DT)
    q, _ = torch.linalg.qr(torch.randn(len(eigs), len(eigs), generator=_gen(seed), dtype=DT))
    return q @ torch.diag(eigs) @ q.T


def nonsymmetric_matrix(eigs, seed=0):
    """``S diag(eigs) S^-1`` with a well-conditioned, non-orthogonal ``S`` (real spectrum, non-normal matrix)."""
    eigs = torch.as_tensor(eigs, dtype=DT)
    n = len(eigs)
    s = torch.eye(n, dtype=DT) + 0.3 * torch.randn(n, n, generator=_gen(seed), dtype=DT) / math.sqrt(n)
    return s @ torch.diag(eigs) @ torch.linalg.inv(s)


def exact_rho(a):
    return torch.linalg.eigvals(a).abs().max().item()


def linear_map(a, scale=None):
    """Per-sample ``f(z) = z A^T`` on the last dim (optionally times a scalar parameter)."""

    def f(z):
        out = z @ a.T
        return out if scale is None else scale * out

    return f


def per_entry_map(mats):
    """``f(z)[e] = A_e z[e]`` with one matrix per entry: ``mats`` is ``entry_shape + (D, D)``."""

    def f(z):
        return torch.einsum("...ij,...j->...i", mats, z)

    return f


SYM_EIGS = [2.0, -1.2, 1.0, 0.7, -0.5, 0.3, 0.1, 0.05]
NEG_EIGS = [-2.0, 1.2, 1.0, 0.7, -0.5, 0.3, 0.1, 0.05]  # dominant eigenvalue negative: rho = 2
NONSYM_EIGS = [1.5, -0.9, 0.8, 0.6, -0.4, 0.2]


# ----------------------------------------------------------------------------------------------- spectral radius


@pytest.mark.parametrize("product", PRODUCTS)
@pytest.mark.parametrize(
    "build, eigs",
    [(symmetric_matrix, SYM_EIGS), (symmetric_matrix, NEG_EIGS), (nonsymmetric_matrix, NONSYM_EIGS)],
    ids=["symmetric", "symmetric-negative", "nonsymmetric"],
)
def test_spectral_radius_linear_map_matches_eigvals(product, build, eigs):
    a = build(eigs)
    rho_true = exact_rho(a)
    assert rho_true == pytest.approx(max(abs(e) for e in eigs), rel=1e-10)
    z = torch.randn(5, a.shape[0], dtype=DT)
    rho = spectral_radius(linear_map(a), z, n_iter=80, product=product, generator=_gen(1))
    assert rho.shape == (5,)
    assert rho.dtype == DT
    torch.testing.assert_close(rho, torch.full((5,), rho_true, dtype=DT), rtol=1e-8, atol=0)
    assert not rho.requires_grad


def test_spectral_radius_does_not_depend_on_z_for_linear_map():
    a = symmetric_matrix(SYM_EIGS)
    r1 = spectral_radius(linear_map(a), torch.zeros(3, 8, dtype=DT), n_iter=60, generator=_gen(0))
    r2 = spectral_radius(linear_map(a), 100 * torch.randn(3, 8, dtype=DT), n_iter=60, generator=_gen(0))
    torch.testing.assert_close(r1, r2, rtol=1e-12, atol=0)


@pytest.mark.parametrize("product", PRODUCTS)
def test_spectral_radius_per_entry_batch_dims_1(product):
    base = symmetric_matrix(SYM_EIGS)
    scales = torch.tensor([0.5, 1.0, -1.5, 3.0], dtype=DT)
    mats = scales[:, None, None] * base
    z = torch.randn(4, 8, dtype=DT)
    rho = spectral_radius(per_entry_map(mats), z, n_iter=80, product=product, batch_dims=1, generator=_gen(2))
    assert rho.shape == (4,)
    expected = torch.tensor([exact_rho(m) for m in mats], dtype=DT)
    torch.testing.assert_close(expected, scales.abs() * 2.0, rtol=1e-10, atol=0)
    torch.testing.assert_close(rho, expected, rtol=1e-8, atol=0)


@pytest.mark.parametrize("product", PRODUCTS)
def test_spectral_radius_per_entry_batch_dims_2(product):
    """Per-token radii: entries are (B, T) and each token has its own Jacobian."""
    B, T, D = 2, 3, 6
    mats = torch.stack(
        [
            nonsymmetric_matrix([s * e for e in NONSYM_EIGS], seed=i)
            for i, s in enumerate([0.3, 0.7, 1.0, 1.4, 2.0, 2.5])
        ]
    ).reshape(B, T, D, D)
    z = torch.randn(B, T, D, dtype=DT)
    rho = spectral_radius(per_entry_map(mats), z, n_iter=100, product=product, batch_dims=2, generator=_gen(3))
    assert rho.shape == (B, T)
    expected = torch.tensor([[exact_rho(mats[b, t]) for t in range(T)] for b in range(B)], dtype=DT)
    torch.testing.assert_close(rho, expected, rtol=1e-8, atol=0)


def test_spectral_radius_batch_dims_0_is_one_global_estimate():
    """batch_dims=0 treats the whole tensor as one vector (STARS' global normalisation)."""
    a = symmetric_matrix(SYM_EIGS)
    z = torch.randn(3, 8, dtype=DT)
    rho = spectral_radius(linear_map(a), z, n_iter=80, batch_dims=0, generator=_gen(4))
    assert rho.shape == ()
    assert rho.item() == pytest.approx(2.0, rel=1e-8)


def test_spectral_radius_batch_dims_entries_are_independent():
    """A per-entry estimate must not mix entries: changing entry 1's matrix leaves entry 0's estimate unchanged."""
    base = symmetric_matrix(SYM_EIGS)
    mats1 = torch.stack([base, base])
    mats2 = torch.stack([base, 5.0 * symmetric_matrix(SYM_EIGS, seed=7)])
    z = torch.randn(2, 8, dtype=DT)
    r1 = spectral_radius(per_entry_map(mats1), z, n_iter=5, generator=_gen(5))
    r2 = spectral_radius(per_entry_map(mats2), z, n_iter=5, generator=_gen(5))
    torch.testing.assert_close(r1[0], r2[0], rtol=1e-14, atol=0)
    assert r2[1].item() == pytest.approx(10.0, rel=0.2)


@pytest.mark.parametrize("product", PRODUCTS)
def test_spectral_radius_warm_start(product):
    # a spectrum that separates moderately, so that 3 iterations leave a visible error (for a symmetric A the
    # estimate ||A v|| increases monotonically: ||A v||^2 = <v, A^2 v> <= ||A^2 v||)
    a = symmetric_matrix([2.0, -1.4, 1.2, 1.0, 0.5, 0.2, -0.1, 0.05], seed=1)
    f = linear_map(a)
    z = torch.randn(4, 8, dtype=DT)
    rho_cold, v = spectral_radius(f, z, n_iter=3, product=product, generator=_gen(6), return_vector=True)
    assert v.shape == z.shape
    torch.testing.assert_close(torch.linalg.vector_norm(v, dim=1), torch.ones(4, dtype=DT), rtol=1e-12, atol=0)
    err_cold = (rho_cold - 2.0).abs()
    errs = [err_cold]
    for _ in range(3):
        rho_warm, v = spectral_radius(f, z, n_iter=3, product=product, v0=v, return_vector=True)
        errs.append((rho_warm - 2.0).abs())
    assert (errs[0] > 1e-3).all()  # the cold estimate really is inaccurate
    for before, after in zip(errs, errs[1:]):
        assert (after < before).all()
    assert (errs[-1] < 0.5 * errs[0]).all()
    assert errs[-1].median() < 1e-2 * errs[0].median()
    # warm-starting is exactly "more iterations": 3 + 3 warm == 6 cold with the same random start
    r3, v3 = spectral_radius(f, z, n_iter=3, product=product, generator=_gen(9), return_vector=True)
    r33 = spectral_radius(f, z, n_iter=3, product=product, v0=v3)
    r6 = spectral_radius(f, z, n_iter=6, product=product, generator=_gen(9))
    torch.testing.assert_close(r33, r6, rtol=1e-10, atol=0)


def test_spectral_radius_v0_is_normalised_and_not_modified():
    a = symmetric_matrix(SYM_EIGS)
    z = torch.randn(2, 8, dtype=DT)
    v0 = torch.randn(2, 8, dtype=DT)
    v0_copy = v0.clone()
    r1 = spectral_radius(linear_map(a), z, n_iter=4, v0=v0)
    r2 = spectral_radius(linear_map(a), z, n_iter=4, v0=123.0 * v0)
    torch.testing.assert_close(r1, r2, rtol=1e-12, atol=0)
    assert torch.equal(v0, v0_copy)


def test_spectral_radius_generator_is_deterministic():
    a = nonsymmetric_matrix(NONSYM_EIGS)
    z = torch.randn(3, 6, dtype=DT)
    r1 = spectral_radius(linear_map(a), z, n_iter=2, generator=_gen(11))
    r2 = spectral_radius(linear_map(a), z, n_iter=2, generator=_gen(11))
    r3 = spectral_radius(linear_map(a), z, n_iter=2, generator=_gen(12))
    assert torch.equal(r1, r2)
    assert not torch.equal(r1, r3)


@pytest.mark.parametrize("product", PRODUCTS)
def test_spectral_radius_create_graph_scale_gradient(product):
    """rho(s * A) = |s| rho(A): the gradient wrt s matches a central finite difference and the exact rho(A)."""
    a = symmetric_matrix(SYM_EIGS)
    z = torch.randn(3, 8, dtype=DT)
    v0 = torch.randn(3, 8, dtype=DT)
    s0, h = 1.3, 1e-6

    def estimate(s, create_graph):
        return spectral_radius(linear_map(a, s), z, n_iter=60, product=product, v0=v0, create_graph=create_graph)

    s = torch.tensor(s0, dtype=DT, requires_grad=True)
    rho = estimate(s, True)
    assert rho.requires_grad
    (grad,) = torch.autograd.grad(rho.sum(), s)
    with torch.no_grad():
        fd = (estimate(torch.tensor(s0 + h, dtype=DT), False) - estimate(torch.tensor(s0 - h, dtype=DT), False)) / (
            2 * h
        )
    assert grad.item() == pytest.approx(fd.sum().item(), rel=1e-6)
    assert grad.item() == pytest.approx(3 * 2.0, rel=1e-8)
    # without create_graph nothing is differentiable
    assert not estimate(s, False).requires_grad


@pytest.mark.parametrize("product", PRODUCTS)
def test_spectral_radius_create_graph_matrix_perturbation(product):
    """d rho(A + t B)/dt at a simple dominant eigenvalue with unit eigenvector u is sign(lambda) u^T B u."""
    a = symmetric_matrix(SYM_EIGS)
    b = torch.randn(8, 8, generator=_gen(21), dtype=DT)
    b = (b + b.T) / 2
    evals, evecs = torch.linalg.eigh(a)
    u = evecs[:, evals.abs().argmax()]
    exact = (u @ b @ u).item()  # dominant eigenvalue +2
    t = torch.tensor(0.0, dtype=DT, requires_grad=True)
    z = torch.randn(2, 8, dtype=DT)
    rho = spectral_radius(lambda x: x @ (a + t * b).T, z, n_iter=100, product=product, create_graph=True)
    (grad,) = torch.autograd.grad(rho.sum(), t)
    assert grad.item() == pytest.approx(2 * exact, rel=1e-6)
    h = 1e-5
    fd = (exact_rho(a + h * b) - exact_rho(a - h * b)) / (2 * h)
    assert grad.item() == pytest.approx(2 * fd, rel=1e-6)


@pytest.mark.parametrize("product", PRODUCTS)
def test_spectral_radius_create_graph_reaches_z_history(product):
    """With create_graph and a z that carries a graph, rho is differentiable wrt what produced z (nonlinear f)."""
    a = symmetric_matrix(SYM_EIGS) / 3
    x = torch.randn(2, 8, dtype=DT, requires_grad=True)

    def f(z):
        return torch.tanh(z @ a.T)

    z = 0.5 * x
    rho = spectral_radius(f, z, n_iter=30, product=product, create_graph=True, generator=_gen(0))
    (g,) = torch.autograd.grad(rho.sum(), x)
    assert g.shape == x.shape and torch.isfinite(g).all() and g.abs().sum() > 0


def test_spectral_radius_products_agree_on_nonlinear_map():
    """For a nonlinear f, all three products give the same estimate of rho(J(z)) (J from autograd.functional)."""
    w = symmetric_matrix(SYM_EIGS, seed=3) / 2

    def f(z):
        return torch.tanh(z @ w.T + 0.1)

    z = torch.randn(3, 8, dtype=DT)
    expected = torch.tensor(
        [exact_rho(torch.autograd.functional.jacobian(lambda v: f(v[None])[0], z[b])) for b in range(3)], dtype=DT
    )
    for product in PRODUCTS:
        rho = spectral_radius(f, z, n_iter=200, product=product, generator=_gen(0))
        torch.testing.assert_close(rho, expected, rtol=1e-6, atol=0)


@pytest.mark.parametrize("product", PRODUCTS)
def test_spectral_radius_one_iteration_is_hutchinson(product):
    """n_iter=1 with random unit v: E[rho^2] = ||J||_F^2 / n; averaged over many independent entries."""
    n = 16
    a = torch.randn(n, n, generator=_gen(31), dtype=DT) / math.sqrt(n) + 0.9 * torch.eye(n, dtype=DT)
    fro2 = (a**2).sum().item()
    n_entries = 4000
    z = torch.zeros(n_entries, n, dtype=DT)
    rho = spectral_radius(linear_map(a), z, n_iter=1, product=product, generator=_gen(32))
    est = rho.pow(2)
    mean, se = est.mean().item(), est.std().item() / math.sqrt(n_entries)
    assert abs(mean - fro2 / n) < 4 * se + 1e-12
    assert mean == pytest.approx(fro2 / n, rel=0.05)


def test_spectral_radius_one_iteration_hutchinson_over_seeds():
    """The same fact with one entry and many generator seeds (the way a training loop would sample it)."""
    n = 8
    a = nonsymmetric_matrix([1.5, -0.9, 0.8, 0.6, -0.4, 0.2, 0.1, 0.0], seed=4)
    fro2 = (a**2).sum().item()
    z = torch.zeros(1, n, dtype=DT)
    est = torch.cat([spectral_radius(linear_map(a), z, n_iter=1, generator=_gen(s)) ** 2 for s in range(600)])
    mean, se = est.mean().item(), est.std().item() / math.sqrt(len(est))
    assert abs(mean - fro2 / n) < 4 * se


@pytest.mark.parametrize("n_iter", [0, -3, 1.5, "2", True, None])
def test_spectral_radius_bad_n_iter(n_iter):
    a = symmetric_matrix(SYM_EIGS)
    with pytest.raises(ValueError, match="n_iter"):
        spectral_radius(linear_map(a), torch.randn(2, 8, dtype=DT), n_iter=n_iter)


@pytest.mark.parametrize("product", ["VJP", "forward", "", None, "jvp "])
def test_spectral_radius_bad_product(product):
    a = symmetric_matrix(SYM_EIGS)
    with pytest.raises(ValueError, match="product") as info:
        spectral_radius(linear_map(a), torch.randn(2, 8, dtype=DT), product=product)
    for name in PRODUCTS:
        assert name in str(info.value)


def test_spectral_radius_under_no_grad_still_works():
    a = symmetric_matrix(SYM_EIGS)
    z = torch.randn(2, 8, dtype=DT)
    with torch.no_grad():
        for product in PRODUCTS:
            rho = spectral_radius(linear_map(a), z, n_iter=80, product=product, generator=_gen(0))
            torch.testing.assert_close(rho, torch.full((2,), 2.0, dtype=DT), rtol=1e-8, atol=0)


# ------------------------------------------------------------------------------------------- Frobenius estimate


def _frobenius_se(a, n_samples):
    """Standard error of the mean of ||e^T A||^2 over ``n_samples`` Gaussian e: Var = 2 tr((A A^T)^2)."""
    m = a @ a.T
    return math.sqrt(2 * torch.trace(m @ m).item() / n_samples)


def test_jacobian_frobenius_linear_map_many_samples():
    a = nonsymmetric_matrix(NONSYM_EIGS)
    fro2 = (a**2).sum().item()
    n_samples = 3000
    z = torch.randn(2, 6, dtype=DT)
    est = jacobian_frobenius(linear_map(a), z, n_samples=n_samples, create_graph=False, generator=_gen(41))
    assert est.shape == (2,)
    se = _frobenius_se(a, n_samples)
    assert (est - fro2).abs().max().item() < 4 * se
    assert not est.requires_grad


def test_jacobian_frobenius_per_entry():
    B, T, D = 2, 2, 6
    scales = torch.tensor([[0.5, 1.0], [2.0, 3.0]], dtype=DT)
    base = nonsymmetric_matrix(NONSYM_EIGS, seed=5)
    mats = scales[..., None, None] * base
    n_samples = 2000
    z = torch.randn(B, T, D, dtype=DT)
    est = jacobian_frobenius(per_entry_map(mats), z, n_samples=n_samples, batch_dims=2, generator=_gen(42))
    assert est.shape == (B, T)
    for b in range(B):
        for t in range(T):
            exact = (mats[b, t] ** 2).sum().item()
            assert abs(est[b, t].item() - exact) < 4 * _frobenius_se(mats[b, t], n_samples)
    # batch_dims=1: one entry per b, the Jacobian is block-diagonal over t
    est1 = jacobian_frobenius(per_entry_map(mats), z, n_samples=n_samples, batch_dims=1, generator=_gen(43))
    assert est1.shape == (B,)
    for b in range(B):
        exact = (mats[b] ** 2).sum().item()
        se = math.sqrt(sum(_frobenius_se(mats[b, t], n_samples) ** 2 for t in range(T)))
        assert abs(est1[b].item() - exact) < 4 * se


def test_jacobian_frobenius_exact_for_orthogonal_map():
    """For an orthogonal A, ||e^T A|| = ||e||, so the estimate is the mean of chi^2_n draws (same generator)."""
    q, _ = torch.linalg.qr(torch.randn(8, 8, generator=_gen(50), dtype=DT))
    z = torch.randn(3, 8, dtype=DT)
    est = jacobian_frobenius(linear_map(q), z, n_samples=5, generator=_gen(51))
    g = _gen(51)
    chi2 = torch.stack([torch.randn(3, 8, generator=g, dtype=DT).pow(2).sum(1) for _ in range(5)]).mean(0)
    torch.testing.assert_close(est, chi2, rtol=1e-12, atol=0)


def test_jacobian_frobenius_differentiable():
    """est(s) = s^2 C for f = s z A^T with a fixed random stream: gradient 2 s C and a finite difference agree."""
    a = nonsymmetric_matrix(NONSYM_EIGS)
    z = torch.randn(2, 6, dtype=DT)
    s0, h = 0.8, 1e-6

    def estimate(s):
        return jacobian_frobenius(linear_map(a, s), z, n_samples=7, generator=_gen(60))

    s = torch.tensor(s0, dtype=DT, requires_grad=True)
    est = estimate(s)
    assert est.requires_grad  # create_graph=True by default
    (grad,) = torch.autograd.grad(est.sum(), s)
    with torch.no_grad():
        fd = (estimate(torch.tensor(s0 + h, dtype=DT)) - estimate(torch.tensor(s0 - h, dtype=DT))) / (2 * h)
    assert grad.item() == pytest.approx(fd.sum().item(), rel=1e-6)
    assert grad.item() == pytest.approx(2 * est.sum().item() / s0, rel=1e-10)


def test_jacobian_frobenius_gradcheck_wrt_matrix():
    a = nonsymmetric_matrix(NONSYM_EIGS).requires_grad_()
    z = torch.randn(2, 6, dtype=DT)

    def fn(m):
        return jacobian_frobenius(lambda x: x @ m.T, z, n_samples=3, generator=_gen(70))

    assert torch.autograd.gradcheck(fn, (a,))


@pytest.mark.parametrize("n_samples", [0, -1, 2.0, None])
def test_jacobian_frobenius_bad_n_samples(n_samples):
    a = symmetric_matrix(SYM_EIGS)
    with pytest.raises(ValueError, match="n_samples"):
        jacobian_frobenius(linear_map(a), torch.randn(2, 8, dtype=DT), n_samples=n_samples)


@pytest.mark.parametrize("product", ["vjp", "double_backward"])
def test_estimates_reuse_a_given_evaluation_fz(product):
    # fz= (the evaluation fixed_point's evaluation_hook hands over) gives the same numbers and gradients, float64.
    torch.manual_seed(0)
    W = (0.3 * torch.randn(6, 6, dtype=torch.float64)).requires_grad_()

    def f(z):
        return torch.tanh(z @ W.T + 0.5)

    z = torch.randn(3, 6, dtype=torch.float64)
    for estimate, kw in ((spectral_radius, {"n_iter": 4, "product": product}), (jacobian_frobenius, {})):
        ref = estimate(f, z, generator=torch.Generator().manual_seed(1), create_graph=True, **kw)
        h = z.clone().requires_grad_()
        fh = f(h)
        shared = estimate(None, h, generator=torch.Generator().manual_seed(1), create_graph=True, fz=fh, **kw)
        torch.testing.assert_close(shared, ref, rtol=1e-12, atol=1e-12)
        (g_ref,) = torch.autograd.grad(ref.sum(), W)
        (g_shared,) = torch.autograd.grad(shared.sum(), W)
        torch.testing.assert_close(g_shared, g_ref, rtol=1e-12, atol=1e-12)


def test_fz_needs_a_graph_from_z_and_no_jvp():
    z = torch.randn(2, 3)
    with pytest.raises(ValueError, match="z must require grad"):
        jacobian_frobenius(None, z, fz=torch.tanh(z))
    h = z.clone().requires_grad_()
    with pytest.raises(ValueError, match="product='jvp'"):
        spectral_radius(None, h, product="jvp", fz=torch.tanh(h))
