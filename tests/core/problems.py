"""Test problems with exact answers: f(z) = tanh(z W^T + x U^T) and linear maps."""

import torch


def tanh_problem(B=4, D=8, norm=0.9, symmetric=False, inj=1.0, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    A = torch.randn(D, D, generator=g, dtype=dtype)
    if symmetric:
        A = (A + A.T) / 2
    W = torch.nn.Parameter(norm * A / torch.linalg.matrix_norm(A, 2))
    U = torch.randn(D, D, generator=g, dtype=dtype) / D**0.5 * inj
    x = torch.randn(B, D, generator=g, dtype=dtype).requires_grad_()

    def f(z, x):
        return torch.tanh(z @ W.T + x @ U.T)

    return f, W, x


def exact_fixed_point(f, x, D, tol=1e-14):
    """Newton's method per sample with dense Jacobians (float64)."""
    z = torch.zeros(x.shape[0], D, dtype=x.dtype)
    with torch.no_grad():
        for _ in range(100):
            for b in range(x.shape[0]):
                J = torch.autograd.functional.jacobian(lambda v: f(v[None], x[b : b + 1].detach())[0], z[b])
                r = f(z[b : b + 1], x[b : b + 1].detach())[0] - z[b]
                z[b] = z[b] - torch.linalg.solve(J - torch.eye(D, dtype=x.dtype), r)
            if (f(z, x.detach()) - z).abs().max() < tol:
                break
    return z


def exact_gradients(f, W, x, c):
    """dL/dW and dL/dx for L = sum(c * z*) by a dense adjoint solve per sample."""
    D = W.shape[0]
    zs = exact_fixed_point(f, x, D)
    gW, gx = torch.zeros_like(W), torch.zeros_like(x)
    for b in range(x.shape[0]):
        J = torch.autograd.functional.jacobian(lambda v: f(v[None], x[b : b + 1].detach())[0], zs[b])
        u = torch.linalg.solve((torch.eye(D, dtype=x.dtype) - J).T, c[b])
        out = f(zs[b : b + 1], x[b : b + 1])[0]
        a, bx = torch.autograd.grad(out, [W, x], u)
        gW += a
        gx += bx
    return zs, gW, gx


def rel_err(a, b):
    return float((a - b).norm() / b.norm())
