"""Forward solvers against exact answers (float64), per-entry convergence, compaction and stopping rules."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_fixedpoint import SOLVERS, NonFiniteError, solve
from tests.core.problems import exact_fixed_point, tanh_problem

ALL_SOLVERS = ["picard", "fpopt", "picard_adaptive", "anderson", "broyden"]


def test_newton_map_sqrt2():
    # The Newton map for sqrt(2) (torchdeq's docstring example): a fixed point, not a contraction from far away.
    z, stats = solve(lambda z: 0.5 * (z + 2 / z), torch.ones(1, 1, dtype=torch.float64), solver="picard", tol=1e-14)
    assert abs(float(z) - math.sqrt(2)) < 1e-14
    assert stats.converged.all()


@pytest.mark.parametrize("solver", ALL_SOLVERS)
@pytest.mark.parametrize("symmetric,inj", [(False, 1.0), (True, 0.1)])
def test_solvers_reach_exact_fixed_point(solver, symmetric, inj):
    f, W, x = tanh_problem(B=4, D=8, norm=0.95, symmetric=symmetric, inj=inj)
    ref = exact_fixed_point(f, x, 8)
    z, stats = solve(f, torch.zeros(4, 8, dtype=torch.float64), args=(x.detach(),), solver=solver, tol=1e-12,
                     max_iter=2000)
    assert stats.converged.all(), stats
    assert (z - ref).abs().max() < 1e-9
    assert stats.residual.max() < 1e-12
    assert stats.nstep.shape == (4,) and stats.nfe == int(stats.nstep.max())


def test_anderson_beats_picard_on_hard_case():
    f, W, x = tanh_problem(B=8, D=32, norm=0.99, symmetric=True, inj=0.1)
    z0 = torch.zeros(8, 32, dtype=torch.float64)
    _, sp = solve(f, z0, args=(x.detach(),), solver="picard", tol=1e-8, max_iter=5000)
    _, sa = solve(f, z0, args=(x.detach(),), solver="anderson", tol=1e-8, max_iter=5000)
    _, sb = solve(f, z0, args=(x.detach(),), solver="broyden", tol=1e-8, max_iter=5000)
    assert sa.nfe < sp.nfe / 2 and sb.nfe < sp.nfe / 2


def reference_anderson(f, z, steps, m, beta, lam):
    """Type-II Anderson written out from its definition: min ||sum a_i g_i||^2 + lam * mean(||g_i||^2) * ||a||^2
    subject to sum a_i = 1 over the last m residuals, then z <- sum a_i (z_i + beta g_i)."""
    X, G, iterates = [], [], []
    for _ in range(steps):
        g = f(z) - z
        X, G = (X + [z])[-m:], (G + [g])[-m:]
        Gm, Xm = torch.stack(G, 1), torch.stack(X, 1)
        H = Gm @ Gm.transpose(1, 2)
        ridge = lam * torch.diagonal(H, dim1=1, dim2=2).mean(1) + torch.finfo(H.dtype).tiny
        y = torch.linalg.solve(H + ridge[:, None, None] * torch.eye(len(G), dtype=H.dtype), torch.ones_like(H[..., 0]))
        a = y / y.sum(1, keepdim=True)
        z = (a[..., None] * (Xm + beta * Gm)).sum(1)
        iterates.append(z)
    return iterates


@pytest.mark.parametrize("beta", [1.0, 0.7])
def test_anderson_iterates_match_the_definition(beta):
    # Every step's mixing uses the full Gram matrix of the residuals in its history (the first residual's own
    # entry included), while the history fills up and after it wraps around.
    f, W, x = tanh_problem(B=3, D=6, norm=0.99, symmetric=True, inj=0.1)
    fx = lambda z: f(z, x.detach())
    algo = SOLVERS.get("anderson")(m=3, beta=beta, lam=1e-3)
    z = torch.zeros(3, 6, dtype=torch.float64)
    algo.init(z)
    ours = []
    for k in range(1, 8):
        fz = fx(z)
        z = algo.step(z, fz, fz - z, k)
        ours.append(z)
    for k, (a, b) in enumerate(zip(ours, reference_anderson(fx, torch.zeros(3, 6, dtype=torch.float64), 7, 3, beta,
                                                            1e-3))):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12, msg=lambda m: f"step {k + 1}: {m}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_anderson_stays_at_an_exact_fixed_point(dtype):
    # Every residual in the history is exactly 0, so the ridge system's solution overflows; the step must fall back
    # to a plain one (z stays at the fixed point) rather than mix with all-zero coefficients (z = 0).
    c = torch.tensor([[2.0, -1.0, 0.5]], dtype=dtype)
    z, st = solve(lambda z: c.expand_as(z).clone(), c.clone(), solver="anderson", solver_kwargs={"m": 5}, tol=1e-6,
                  min_iter=8, max_iter=8, track_trace=True)
    assert torch.equal(z, c) and float(st.trace.abs().max()) == 0.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_anderson_falls_back_to_a_plain_step_per_row(dtype):
    # Row 0 sits at an exact fixed point (its residuals are 0: no valid mixing once its ridge system overflows),
    # row 1 iterates: row 0 stays exactly where it is while row 1 follows Anderson's definition, step by step, as
    # the history fills up and wraps around.
    f, W, x = tanh_problem(B=1, D=6, norm=0.99, symmetric=True, inj=0.1)
    c = torch.tensor([[2.0, -1.0, 0.5, 0.25, 1.5, -0.75]], dtype=torch.float64)

    def fx(z):
        return torch.cat([c.to(z.dtype), f(z[1:].double(), x.detach()).to(z.dtype)])

    algo = SOLVERS.get("anderson")(m=5)  # row 0's ridge system overflows once 5 residuals are in its history
    z = torch.cat([c, torch.zeros(1, 6, dtype=torch.float64)]).to(dtype)
    algo.init(z)
    ours = []
    for k in range(1, 11):
        fz = fx(z)
        z = algo.step(z, fz, fz - z, k)
        assert torch.equal(z[0], c[0].to(dtype)), f"step {k}: {z[0]}"
        ours.append(z[1:])
    ref = reference_anderson(lambda z: f(z, x.detach()), torch.zeros(1, 6, dtype=torch.float64), 10, 5, 1.0, 1e-8)
    for k, (a, b) in enumerate(zip(ours, ref)):
        torch.testing.assert_close(a.double(), b, rtol=0, atol=1e-12 if dtype == torch.float64 else 1e-5,
                                   msg=lambda m: f"step {k + 1}: {m}")


def test_anderson_is_scale_invariant():
    # Scaling the state must not change the iteration count (torchdeq's absolute ridge does: 47 / 22 / 12).
    f, W, x = tanh_problem(B=4, D=16, norm=0.99, symmetric=True)
    counts = []
    for s in (1e-2, 1.0, 1e2):
        fs = lambda z, x, s=s: s * f(z / s, x)
        _, stats = solve(fs, torch.zeros(4, 16, dtype=torch.float64), args=(x.detach(),), tol=1e-10, max_iter=500)
        counts.append(stats.nfe)
    assert max(counts) - min(counts) <= 1, counts


def test_per_sample_results_do_not_depend_on_batch_mates():
    f, W, x = tanh_problem(B=6, D=8, norm=0.99, symmetric=True, inj=0.1)
    xb = x.detach()
    z_all, _ = solve(f, torch.zeros(6, 8, dtype=torch.float64), args=(xb,), tol=1e-6, solver="anderson")
    for b in range(6):
        z_one, _ = solve(f, torch.zeros(1, 8, dtype=torch.float64), args=(xb[b : b + 1],), tol=1e-6,
                         solver="anderson")
        # Equal up to floating-point reassociation in batched matmuls (torchdeq differs by ~1e-3 relative here).
        torch.testing.assert_close(z_all[b], z_one[0], rtol=0, atol=1e-13)


@pytest.mark.parametrize("return_mode", ["best", "last"])
@pytest.mark.parametrize("damping", [1.0, 0.5])
def test_picard_samples_that_run_on_after_finishing_keep_their_results(damping, return_mode):
    # Picard on whole samples does not freeze a finished sample (its later iterates feed only its own row): each
    # sample's output, count and residual still equal those of solving it alone.
    f0, W, x = tanh_problem(B=6, D=8, norm=0.99, symmetric=True, inj=0.1)
    scale = torch.tensor([0.05, 0.3, 0.6, 0.9, 0.99, 1.2], dtype=torch.float64)[:, None]
    f = lambda z, x, s: torch.tanh(s * (z @ W.T) + x)
    kw = dict(solver="picard", solver_kwargs={"damping": damping}, tol=1e-8, max_iter=60, return_mode=return_mode)
    z_all, s_all = solve(f, torch.zeros(6, 8, dtype=torch.float64), args=(x.detach(), scale), **kw)
    assert len(set(s_all.nstep.tolist())) > 3
    for b in range(6):
        z_one, s_one = solve(f, torch.zeros(1, 8, dtype=torch.float64), args=(x.detach()[b:b + 1], scale[b:b + 1]),
                             **kw)
        torch.testing.assert_close(z_all[b], z_one[0], rtol=0, atol=1e-13)
        torch.testing.assert_close(s_all.residual[b], s_one.residual[0], rtol=1e-9, atol=1e-15)
        assert int(s_all.nstep[b]) == int(s_one.nstep[0]) and bool(s_all.converged[b]) == bool(s_one.converged[0])


@pytest.mark.parametrize("every", [1, 0])
@pytest.mark.parametrize("return_mode", ["best", "last"])
def test_a_finished_sample_that_runs_on_and_overflows_is_held_not_reported(return_mode, every):
    # Sample 0 finishes at step 1 near the unstable fixed point 0 of z -> 1e10 z; if it ran on, its iterates would
    # overflow (inf, then NaN residuals) long before sample 1 finishes. It is held at its result from then on, as every
    # finished entry used to be, so the batch gives what each sample gives alone instead of a NonFiniteError. With
    # check_every=0 it does run on (no host read to notice the overflow), and its result and count are kept apart.
    a = torch.tensor([[1e10], [0.99]], dtype=torch.float64)
    c = torch.tensor([[0.0], [1.0]], dtype=torch.float64)
    f = lambda z, a, c: a * z + c
    kw = dict(solver="picard", tol=1e-2, stop_mode="abs", max_iter=600, return_mode=return_mode, check_every=every)
    z0 = torch.tensor([[1e-14, 1e-14], [5.0, 5.0]], dtype=torch.float64)
    z, st = solve(f, z0, args=(a, c), **kw)
    assert st.converged.all() and st.nstep.tolist()[0] == 1 and st.nstep.tolist()[1] > 40
    for b in range(2):
        zb, sb = solve(f, z0[b:b + 1], args=(a[b:b + 1], c[b:b + 1]), **kw)
        assert torch.equal(z[b], zb[0]) and int(st.nstep[b]) == int(sb.nstep[0])


def test_finished_entries_that_feed_others_are_frozen():
    # batch_dims=2: tokens of a sample interact through f, so even Picard keeps a finished token at its result and
    # the open tokens see that value (the reference loop below).
    rates = torch.tensor([0.1, 0.4, 0.7], dtype=torch.float64)[None, :, None]
    f = lambda z: rates * z + 0.1 * z.mean(1, keepdim=True).flip(-1) + 1.0
    z, stats = solve(f, torch.zeros(1, 3, 2, dtype=torch.float64), solver="picard", tol=1e-3, stop_mode="abs",
                     batch_dims=2, max_iter=400)
    assert stats.converged.all() and len(set(stats.nstep[0].tolist())) == 3
    zr, done, out = torch.zeros(1, 3, 2, dtype=torch.float64), torch.zeros(3, dtype=torch.bool), None
    for k in range(1, 401):
        fz = f(zr)
        newly = ~done & ((fz - zr).norm(dim=-1)[0] < 1e-3)
        out = fz.clone() if out is None else torch.where(newly[None, :, None], fz, out)
        done |= newly
        if done.all():
            break
        zr = torch.where(done[None, :, None], out, fz)
    torch.testing.assert_close(z, out, rtol=0, atol=1e-15)


@pytest.mark.parametrize("solver", ALL_SOLVERS)
def test_compaction_matches_no_compaction(solver):
    # Half the samples contract fast, half slowly; dropping finished rows must not change any result.
    f0, W, x = tanh_problem(B=8, D=8, norm=0.99)
    scale = torch.tensor([0.05, 0.99] * 4, dtype=torch.float64)[:, None]
    f = lambda z, x, s: torch.tanh(s * (z @ W.T) + x)
    args = (x.detach(), scale)
    z0 = torch.zeros(8, 8, dtype=torch.float64)
    z1, s1 = solve(f, z0, args=args, solver=solver, tol=1e-9, max_iter=500)
    z2, s2 = solve(f, z0, args=args, solver=solver, tol=1e-9, max_iter=500, compact=True)
    torch.testing.assert_close(z1, z2, rtol=0, atol=1e-12)
    assert torch.equal(s1.nstep, s2.nstep)
    assert s1.nstep[0] < s1.nstep[1]


def test_compaction_evaluates_fewer_rows():
    W = torch.randn(8, 8, dtype=torch.float64) * 0.1
    scale = torch.tensor([0.01, 1.0, 0.01, 1.0], dtype=torch.float64)[:, None]
    rows = []

    def f(z, s):
        rows.append(z.shape[0])
        return torch.tanh(s * (z @ W.T) + 1)

    solve(f, torch.zeros(4, 8, dtype=torch.float64), args=(scale,), solver="picard", tol=1e-12, compact=True)
    assert rows[0] == 4 and rows[-1] == 2


def test_per_token_granularity_freezes_converged_tokens():
    # batch_dims=2 on (B, T, D): each token is an entry with its own count.
    rates = torch.tensor([[0.1, 0.5, 0.9]], dtype=torch.float64)[..., None]
    f = lambda z: rates * z + 1.0  # fixed point 1 / (1 - rate) per token
    z, stats = solve(f, torch.zeros(1, 3, 2, dtype=torch.float64), solver="picard", tol=1e-10, stop_mode="abs",
                     batch_dims=2, max_iter=1000)
    assert stats.nstep.shape == (1, 3)
    assert stats.nstep[0, 0] < stats.nstep[0, 1] < stats.nstep[0, 2]
    torch.testing.assert_close(z[0, :, 0], 1 / (1 - rates[0, :, 0]), rtol=0, atol=1e-9)


def test_min_iter_and_stop_fraction():
    rates = torch.tensor([0.1, 0.1, 0.1, 0.95], dtype=torch.float64)[:, None]
    f = lambda z: rates * z + 1.0
    z0 = torch.zeros(4, 2, dtype=torch.float64)
    _, s = solve(f, z0, solver="picard", tol=1e-3, stop_mode="abs", min_iter=40, max_iter=1000)
    assert int(s.nstep.min()) == 40
    # Stop once at most 25% of the entries are unconverged: the slow one is left unconverged.
    _, s = solve(f, z0, solver="picard", tol=1e-6, stop_mode="abs", stop_fraction=0.25, max_iter=1000)
    assert s.converged.tolist() == [True, True, True, False]
    assert s.nfe < 50


def test_fpopt_decays_step_and_halts_on_oscillation():
    # f(z) = -z oscillates under plain iteration; FPRM's optimizer damps the step until it halts or converges.
    f = lambda z: -z + 0.0
    z, s = solve(f, torch.ones(2, 3, dtype=torch.float64), solver="fpopt", tol=1e-8, max_iter=500,
                 solver_kwargs={"patience": 2, "decay": 0.5, "min_step": 1e-3})
    assert s.nfe < 500
    assert bool(s.converged.all()) or int(s.nstep.max()) < 500


def official_fpopt(f, y, steps, s0=1.0, patience=5, decay=0.9, thresh=0.0, margin=0.0):
    """FPRM's FixedPointOptimizer, written out: residual of y, step with the current size, then the patience /
    decay bookkeeping (the decay acts from the next step on, and only while the residual is >= thresh; a new lowest
    residual must lie ``margin`` below the best, 0.01 at the research code's commit 9e0ebf35)."""
    s = torch.full((y.shape[0], 1), s0, dtype=y.dtype)
    best = torch.full((y.shape[0],), math.inf, dtype=y.dtype)
    pat = torch.full((y.shape[0],), float(patience), dtype=y.dtype)
    for _ in range(steps):
        fy = f(y)
        res = (y - fy).abs().amax(-1) / (fy.abs().amax(-1) + 1e-9)
        y = s * fy + (1 - s) * y
        improved = res < best - margin
        best = torch.where(improved, res, best)
        pat = torch.where(improved, float(patience), pat - 1)
        adapt = (pat <= 0) & (res >= thresh)
        pat = torch.where(adapt, float(patience), pat)
        s = torch.where(adapt[:, None], s * decay, s)
    return y


@pytest.mark.parametrize("thresh", [0.0, 0.5])
def test_fpopt_steps_with_the_old_step_size_then_decays_float64(thresh):
    # A rotation-like linear map that never converges: the step size decays every `patience` steps. solve returns
    # f(z_{K-1}) after K evaluations (the image of the last iterate), so z_{K-1} = f^{-1}(out) is compared with the
    # official optimizer's iterate after K - 1 steps. Deciding the decay before the step (the old order) moves
    # z_2 already with the decayed size.
    torch.manual_seed(0)
    A = torch.tensor([[0.0, -1.1], [1.1, 0.0]], dtype=torch.float64)
    f = lambda z: z @ A.T + 0.0
    z0 = torch.randn(3, 2, dtype=torch.float64)
    for K in (2, 3, 4, 7, 12):
        out, _ = solve(f, z0, solver="fpopt", tol=1e-12, stop_mode="rel", norm="linf", max_iter=K,
                       return_mode="last", solver_kwargs={"patience": 1, "decay": 0.5, "min_step": 0.0,
                                                          "threshold": thresh})
        z_last = torch.linalg.solve(A, out.T).T
        torch.testing.assert_close(z_last, official_fpopt(f, z0, K - 1, patience=1, decay=0.5, thresh=thresh),
                                   rtol=1e-12, atol=1e-12)


def test_fpopt_improve_margin_counts_only_clear_improvements_float64():
    # A slow contraction: the relative residual falls by less than 0.05 per step, so with improve_margin=0.05 every
    # step after the first loses patience and the step size halves; with the default any decrease counts.
    A = torch.tensor([[0.97, 0.1], [-0.1, 0.97]], dtype=torch.float64)
    f = lambda z: z @ A.T + 1.0
    z0 = torch.tensor([[5.0, -3.0], [0.5, 2.0]], dtype=torch.float64)
    for margin in (0.0, 0.05):
        kw = {"patience": 1, "decay": 0.5, "min_step": 0.0, "improve_margin": margin}
        for K in (2, 5, 9):
            out, _ = solve(f, z0, solver="fpopt", tol=1e-12, stop_mode="rel", norm="linf", max_iter=K,
                           return_mode="last", solver_kwargs=kw)
            z_last = torch.linalg.solve(A, (out - 1.0).T).T
            ref = official_fpopt(f, z0, K - 1, patience=1, decay=0.5, margin=margin)
            torch.testing.assert_close(z_last, ref, rtol=1e-12, atol=1e-12)
    # the margin changes the iterates (the test above would notice it being ignored)
    assert not torch.allclose(official_fpopt(f, z0, 8, patience=1, decay=0.5, margin=0.05),
                              official_fpopt(f, z0, 8, patience=1, decay=0.5), rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match=r"improve_margin=-0.01 is out of range; allowed values lie in \[0.0, inf\)"):
        solve(f, z0, solver="fpopt", solver_kwargs={"improve_margin": -0.01})


def test_fpopt_halts_entries_whose_step_vanishes():
    # An expanding map never improves: the step shrinks to min_step and the entry halts, unconverged.
    f = lambda z: 2 * z + 1
    _, s = solve(f, torch.zeros(3, 2, dtype=torch.float64), solver="fpopt", tol=1e-8, max_iter=1000,
                 solver_kwargs={"patience": 1, "decay": 0.5, "min_step": 1e-2})
    assert not s.converged.any()
    assert int(s.nstep.max()) < 1000


def test_picard_adaptive_is_picard_while_converging_and_damps_an_oscillation():
    """On a contraction with aligned steps it takes Picard's exact steps. On ``f(z) = -2 z + 3`` (fixed point 1,
    eigenvalue -2: plain iteration oscillates and diverges) every residual reverses the previous one: the fixed half
    step ``z + (f(z) - z) / 2`` has error factor 1 - 3/2 = -1/2 (one halving per step), and the default secant step
    estimates the eigenvalue -2 from the last two residuals and relaxes by 1 / (1 + 2), which lands on 1 at once."""
    A = torch.diag(torch.linspace(0.1, 0.8, 8, dtype=torch.float64))  # positive eigenvalues: residuals stay aligned
    f = lambda z, x: z @ A + x
    x = torch.randn(3, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    z0 = torch.zeros(3, 8, dtype=torch.float64)
    za, sa = solve(f, z0, args=(x,), solver="picard_adaptive", tol=1e-10, max_iter=200, track_trace=True)
    zp, sp = solve(f, z0, args=(x,), solver="picard", tol=1e-10, max_iter=200, track_trace=True)
    torch.testing.assert_close(za, zp, rtol=0, atol=0)
    assert torch.equal(sa.nstep, sp.nstep)
    torch.testing.assert_close(sa.trace, sp.trace, rtol=0, atol=0, equal_nan=True)
    g = lambda z: -2 * z + 3
    z0 = torch.zeros(2, 3, dtype=torch.float64)
    z, s = solve(g, z0, solver="picard_adaptive", solver_kwargs={"damping": 0.5}, tol=1e-10, max_iter=200,
                 stop_mode="abs", norm="linf")
    # |z_k - 1| = 2 (after the plain first step) * (1/2)^(k-2); abs residual |f(z) - z| = 3 |z - 1| < 1e-10
    assert bool(s.converged.all()) and 35 <= int(s.nstep.max()) <= 38
    torch.testing.assert_close(z, torch.ones(2, 3, dtype=torch.float64), rtol=0, atol=1e-9)
    z, s = solve(g, z0, solver="picard_adaptive", tol=1e-10, max_iter=200, stop_mode="abs", norm="linf")
    # z_1 = 3 (plain step), then the secant step 3 + (-6) / 3 = 1: converged at the next evaluation
    assert bool(s.converged.all()) and int(s.nstep.max()) <= 3
    torch.testing.assert_close(z, torch.ones(2, 3, dtype=torch.float64), rtol=0, atol=1e-12)
    _, s = solve(g, z0, solver="picard", tol=1e-10, max_iter=200)
    assert not s.converged.any()
    for bad in (1.0, "half"):
        with pytest.raises(ValueError, match="damping"):
            solve(g, torch.zeros(2, 3), solver="picard_adaptive", solver_kwargs={"damping": bad})


def test_picard_adaptive_secant_step_on_a_mixed_linear_map():
    """Per entry: rows of a diagonal linear map with eigenvalue -0.2 (fast oscillation) and -0.95 (slow) against the
    fixed half step: the secant step is never slower, and much faster on both (float64, exact fixed point 0)."""
    for lam in (-0.2, -0.95):
        f = lambda z: lam * z
        z0 = torch.ones(4, 5, dtype=torch.float64)
        _, auto = solve(f, z0, solver="picard_adaptive", tol=1e-10, max_iter=500, stop_mode="abs")
        _, half = solve(f, z0, solver="picard_adaptive", solver_kwargs={"damping": 0.5}, tol=1e-10, max_iter=500,
                        stop_mode="abs")
        assert bool(auto.converged.all()) and bool(half.converged.all())
        assert int(auto.nstep.max()) <= 4 < int(half.nstep.max()), (lam, auto.nstep, half.nstep)


@pytest.mark.parametrize("mode", ["best", "last"])
def test_return_mode_for_unconverged(mode):
    f, W, x = tanh_problem(B=3, D=8, norm=0.99, symmetric=True, inj=0.1)
    z, s = solve(f, torch.zeros(3, 8, dtype=torch.float64), args=(x.detach(),), solver="picard", tol=1e-14,
                 max_iter=5, return_mode=mode, track_trace=True)
    assert not s.converged.any()
    assert s.trace.shape == (5, 3)
    if mode == "best":
        torch.testing.assert_close(s.residual, s.trace.min(0).values)
    else:
        torch.testing.assert_close(s.residual, s.trace[-1])


def test_stats_summary_and_dtype():
    f, W, x = tanh_problem(B=2, D=4, dtype=torch.float32)
    z, s = solve(f, torch.zeros(2, 4), args=(x.detach(),), tol=1e-4)
    assert z.dtype == torch.float32
    summary = s.summary()
    assert set(summary) >= {"fp_nfe", "fp_nstep_mean", "fp_residual_max", "fp_converged_fraction"}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("solver", ALL_SOLVERS)
def test_low_precision_states(solver, dtype):
    # torchdeq's Anderson fails here ("lu_cpu" not implemented for BFloat16/Half); ours solves in float32.
    f, W, x = tanh_problem(B=4, D=16, norm=0.9, dtype=torch.float32)
    fl = lambda z, x: f(z.float(), x).to(dtype)
    z, s = solve(fl, torch.zeros(4, 16, dtype=dtype), args=(x.detach(),), solver=solver, tol=1e-2, max_iter=100)
    assert z.dtype == dtype and s.converged.all()


def test_registry_lists_solvers():
    assert SOLVERS.names() == sorted(ALL_SOLVERS)


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    norm=st.floats(0.1, 0.9),
    solver=st.sampled_from(ALL_SOLVERS),
    B=st.integers(1, 4),
    D=st.integers(1, 12),
)
def test_property_contractive_maps_converge(seed, norm, solver, B, D):
    # Any map with Lipschitz constant < 1 converges to a point with residual below tol.
    g = torch.Generator().manual_seed(seed)
    A = torch.randn(D, D, generator=g, dtype=torch.float64)
    W = norm * A / torch.linalg.matrix_norm(A, 2)
    x = torch.randn(B, D, generator=g, dtype=torch.float64)
    f = lambda z: torch.tanh(z @ W.T + x)
    z, s = solve(f, torch.zeros(B, D, dtype=torch.float64), solver=solver, tol=1e-10, max_iter=3000)
    assert s.converged.all()
    assert float((f(z) - z).norm(dim=1).max()) <= 1e-9 * max(1.0, float(z.norm(dim=1).max()))


@pytest.mark.parametrize("memory", [3, 10])
def test_broyden_restarts_when_memory_is_full(memory):
    # Dropping only the oldest rank-one update diverged to NaN on this hard case; restarting from -I converges.
    f, W, x = tanh_problem(B=8, D=64, norm=0.99, symmetric=True, inj=0.1, dtype=torch.float32)
    z, s = solve(f, torch.zeros(8, 64), args=(x.detach(),), solver="broyden", tol=1e-4, max_iter=500,
                 solver_kwargs={"memory": memory})
    assert s.converged.all() and s.nfe < 200


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_residual_of_tiny_rows_is_finite(dtype):
    # Rows of size ~1e-4: in float16 their squared entries underflow and 1e-9 rounds to 0, so a residual computed in
    # the input dtype is 0 / 0 = NaN and the solve would be reported as non-finite. It is computed in float32.
    z0 = torch.full((4, 8), 1e-4, dtype=dtype)
    z, stats = solve(lambda z: 0.5 * z + 5e-5, z0, solver="picard", tol=1e-2, max_iter=20)
    assert stats.residual.dtype == torch.float32 and torch.isfinite(stats.residual).all()
    assert stats.converged.all() and z.dtype == dtype


def test_token_linf_residual_is_the_largest_per_token_relative_residual():
    # One sample of 3 tokens x 2 features; f(z) = z + g with a large token 0 and a small token 2 that moves a lot.
    z0 = torch.tensor([[[100.0, 0.0], [1.0, 1.0], [0.1, 0.0]]], dtype=torch.float64)
    g = torch.tensor([[[1.0, 0.0], [0.0, 0.5], [0.2, 0.0]]], dtype=torch.float64)
    f = lambda z: z0 + g  # noqa: E731 -- a constant map: the first residual is exactly g relative to z0 + g
    kwargs = dict(solver="picard", max_iter=1, tol=1e-12)
    _, tok = solve(f, z0, norm="token_linf", **kwargs)
    _, glob = solve(f, z0, norm="linf", **kwargs)
    # per token: 1 / 101, 0.5 / 1.5, 0.2 / 0.3 -> the max is 2/3; the global linf divides 1.0 by 101.
    assert tok.residual.item() == pytest.approx(0.2 / 0.3, rel=1e-8)  # the denominator carries +1e-9
    assert glob.residual.item() == pytest.approx(1.0 / 101.0, rel=1e-8)
    # abs mode: the largest entry of g either way.
    _, tok_abs = solve(f, z0, norm="token_linf", stop_mode="abs", **kwargs)
    assert tok_abs.residual.item() == pytest.approx(1.0, rel=1e-12)
    # per-token entries (batch_dims=2): each token is one row, so token_linf equals linf.
    _, per_tok = solve(f, z0, norm="token_linf", batch_dims=2, **kwargs)
    _, per_tok_linf = solve(f, z0, norm="linf", batch_dims=2, **kwargs)
    assert torch.allclose(per_tok.residual, per_tok_linf.residual, rtol=1e-12, atol=0)


@pytest.mark.parametrize("solver", ALL_SOLVERS)
def test_token_linf_solves_to_the_exact_fixed_point(solver):
    f, W, x = tanh_problem(B=4, D=8, norm=0.95, symmetric=False, inj=1.0)
    ref = exact_fixed_point(f, x, 8)
    # (B, T=2, D=4) view of the same problem: the residual is per token of 4 features.
    g = lambda z, x: f(z.reshape(4, 8), x).reshape(4, 2, 4)  # noqa: E731
    z, stats = solve(g, torch.zeros(4, 2, 4, dtype=torch.float64), args=(x.detach(),), solver=solver,
                     norm="token_linf", tol=1e-12, max_iter=2000)
    assert stats.converged.all() and (z.reshape(4, 8) - ref).abs().max() < 1e-9


def test_token_linf_row_mask_leaves_padding_out_float64():
    # Rows 0-1 of each sample contract to 2b; row 2 (padding) oscillates forever. Counting it, nothing converges;
    # masked out, the samples converge to the exact fixed point of their real rows.
    b = torch.tensor([1.0, -2.0], dtype=torch.float64)

    def f(z):
        return torch.cat([0.5 * z[:, :2] + b, 1.0 - z[:, 2:]], dim=1)

    z0 = torch.zeros(2, 3, 2, dtype=torch.float64)
    _, s = solve(f, z0, solver="picard", tol=1e-10, norm="token_linf", max_iter=200)
    assert not s.converged.any()
    mask = torch.tensor([[True, True, False]] * 2)
    z, s = solve(f, z0, solver="picard", tol=1e-10, norm="token_linf", max_iter=200, row_mask=mask)
    assert s.converged.all()
    torch.testing.assert_close(z[:, :2], (2 * b).expand(2, 2, 2), rtol=1e-9, atol=1e-9)
    with pytest.raises(ValueError, match="row_mask must be a bool tensor of shape"):
        solve(f, z0, solver="picard", norm="l2", row_mask=mask)


@pytest.mark.parametrize("batch_dims", [1, 2])
def test_compaction_in_several_drops_matches_no_compaction(batch_dims):
    # Samples converge at many different steps, in scrambled order: the working set shrinks several times and the
    # dropped rows' results (kept per drop) must come back in entry order, equal to the solve without compaction.
    g = torch.Generator().manual_seed(1)
    W = torch.randn(6, 6, generator=g, dtype=torch.float64)
    W = W / torch.linalg.matrix_norm(W, 2)
    scale = torch.tensor([0.9, 0.05, 0.6, 0.3, 0.95, 0.1, 0.8, 0.45, 0.7, 0.2, 0.85, 0.5], dtype=torch.float64)
    x = torch.randn(12, 3, 6, generator=g, dtype=torch.float64)
    sizes = []

    def f(z, s, xx):
        sizes.append(z.shape[0])
        return torch.tanh(s[:, None, None] * (z @ W.T) + xx)

    kw = dict(args=(scale, x), solver="picard", tol=1e-10, max_iter=300, batch_dims=batch_dims)
    z0 = torch.zeros(12, 3, 6, dtype=torch.float64)
    z1, s1 = solve(f, z0, **kw)
    sizes.clear()
    z2, s2 = solve(f, z0, compact=True, **kw)
    assert len(set(sizes)) >= 4 and sizes[-1] < 4  # several drops
    torch.testing.assert_close(z1, z2, rtol=0, atol=1e-12)
    assert torch.equal(s1.nstep, s2.nstep) and torch.equal(s1.converged, s2.converged)
    torch.testing.assert_close(s1.residual, s2.residual, rtol=1e-9, atol=1e-15)


def _non_normal_rows(B=6, D=4, seed=0):
    """Row-wise affine maps ``z_i <- M_i z_i + b_i`` (float64) with spectral radius < 1 but non-normal ``M_i`` of
    different scales: residuals that fall at different rates, and in some rows rise before they fall."""
    g = torch.Generator().manual_seed(seed)
    M = torch.triu(torch.randn(B, D, D, generator=g, dtype=torch.float64) * 3.0, diagonal=1)
    M = M + torch.diag_embed(torch.linspace(0.1, 0.8, B, dtype=torch.float64)[:, None].expand(B, D))
    b = torch.randn(B, D, generator=g, dtype=torch.float64)
    return lambda z: torch.einsum("bij,bj->bi", M, z.reshape(B, D)).reshape(z.shape) + b.reshape(z.shape)


@pytest.mark.parametrize("shape", [(6, 4), (6, 1, 4)])
@pytest.mark.parametrize("stop_mode", ["rel", "abs"])
@pytest.mark.parametrize("return_mode", ["best", "last"])
def test_fast_path_matches_the_general_path_float64(return_mode, stop_mode, shape):
    """Without a trace, a residual function or per-call extras, the solve takes its fast path (the residual's done
    rows masked in the same op); ``track_trace=True`` takes the general one. Same iterates, results and statistics,
    bit for bit, with rows that converge at different steps, rows that do not converge, and residuals that rise (the
    best iterate then tracked every step)."""
    f = _non_normal_rows()
    kw = dict(solver="picard", tol=1e-6, max_iter=30, stop_mode=stop_mode, return_mode=return_mode)
    z_fast, s_fast = solve(f, torch.zeros(shape, dtype=torch.float64), **kw)
    z_gen, s_gen = solve(f, torch.zeros(shape, dtype=torch.float64), track_trace=True, **kw)
    assert torch.equal(z_fast, z_gen)
    for name in ("nstep", "residual", "converged"):
        assert torch.equal(getattr(s_fast, name), getattr(s_gen, name)), name
    assert 0 < int(s_fast.converged.sum()) < 6 and len(set(s_fast.nstep.tolist())) > 2
    rose = (s_gen.trace[1:] > s_gen.trace[:-1]).any(0)
    assert bool((rose & ~s_fast.converged).any())  # a row whose best iterate is not its last
    if return_mode == "best":
        open_rows = ~s_fast.converged
        torch.testing.assert_close(s_fast.residual[open_rows], s_gen.trace[:, open_rows].min(0).values)


@pytest.mark.parametrize("solver,at", [("picard", 4), ("anderson", 3)])
@pytest.mark.parametrize("track_trace", [False, True])  # the fast path and the general one
@pytest.mark.parametrize("shape", [(4, 3), (4, 1, 3)])
def test_nan_image_of_a_finished_row_is_reported(shape, track_trace, solver, at):
    # Anderson holds a finished row at its result, so the NaN image of that state is reported where it appears
    # (step 3). Picard lets finished samples run on: their first non-finite value makes it hold them, and the held
    # state's image, NaN again, is reported one step later.
    def f(z):
        out = 0.5 * z + torch.arange(1.0, 5.0).reshape(4, *[1] * (z.dim() - 1)) * torch.ones_like(z)
        f.calls += 1
        if f.calls >= 3:  # row 0 converged at the first step (tol 2): its frozen state's image turns NaN
            out = out.clone()
            out[0] = float("nan")
        return out

    f.calls = 0
    with pytest.raises(NonFiniteError, match=rf"iteration {at} for samples \[0\] \(of 4\)"):
        solve(f, torch.full(shape, 2.0), solver=solver, tol=0.3, stop_mode="abs", max_iter=50,
              track_trace=track_trace)
