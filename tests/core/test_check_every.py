"""``check_every`` (``fp_check_every``): a solve that reads its convergence state back to the host every ``k``
iterations, or never inside the loop (0), gives the default path's answers (float64), reads the host as often as it
says, raises on NaN/Inf, and compiles as one graph."""

import pytest
import torch
from torch.profiler import profile

from hf_fixedpoint import NonFiniteError, defer_finite_checks, fixed_point, solve
from tests.core.problems import exact_fixed_point, tanh_problem

ALL_SOLVERS = ["picard", "fpopt", "picard_adaptive", "anderson", "broyden"]


def host_reads(fn) -> int:
    """Scalar reads to the host while ``fn`` runs (``.item()``, ``bool(t)``: what waits for a GPU)."""
    with profile() as prof:
        fn()
    return sum(e.count for e in prof.key_averages() if e.key == "aten::_local_scalar_dense")


@pytest.mark.parametrize("solver", ALL_SOLVERS)
@pytest.mark.parametrize("every", [0, 3])
def test_same_fixed_point_and_counts_within_a_check(solver, every):
    f, _, x = tanh_problem(B=6, D=16, norm=0.9, inj=0.5)
    z0 = torch.zeros(6, 16, dtype=torch.float64)
    ref_z, ref = solve(f, z0, args=(x.detach(),), solver=solver, tol=1e-10, max_iter=200)
    z, stats = solve(f, z0, args=(x.detach(),), solver=solver, tol=1e-10, max_iter=200, check_every=every)
    exact = exact_fixed_point(f, x, 16)
    assert stats.converged.all() and ref.converged.all()
    assert (z - exact).abs().max() < 1e-8 and (z - ref_z).abs().max() < 1e-8
    extra = stats.nstep - ref.nstep
    if every == 0:  # settled at every iteration on the device: the same counts, the whole budget run
        assert torch.equal(stats.nstep, ref.nstep) and stats.nfe == 200
    else:  # settled at the checks only: a count is the first check at or after the default's
        assert (extra >= 0).all() and (extra < every).all() and (stats.nstep % every == 0).all()
        assert stats.nfe == int(stats.nstep.max())


def test_per_token_entries_are_frozen_at_their_result():
    # Tokens interact (the mean over the sequence), so a finished token's frozen value feeds the open ones.
    torch.manual_seed(0)
    W = torch.randn(8, 8, dtype=torch.float64) * 0.3
    x = torch.randn(3, 5, 8, dtype=torch.float64)

    def f(z):
        return torch.tanh(z @ W.T + x + 0.1 * z.mean(1, keepdim=True))

    z0 = torch.zeros(3, 5, 8, dtype=torch.float64)
    for solver in ("anderson", "picard_adaptive"):
        ref_z, ref = solve(f, z0, batch_dims=2, tol=1e-9, max_iter=80, solver=solver)
        z, stats = solve(f, z0, batch_dims=2, tol=1e-9, max_iter=80, solver=solver, check_every=0)
        assert torch.equal(stats.nstep, ref.nstep)
        assert (z - ref_z).abs().max() < 1e-12


@pytest.mark.parametrize("every,reads", [(0, 1), (4, 3), (1, 10)])
def test_host_reads_per_solve(every, reads):
    # 10 iterations that never converge: k=4 reads at 4, 8 and the last; 0 reads once, after the loop.
    f, _, x = tanh_problem(B=4, D=8, norm=0.99)
    z0 = torch.zeros(4, 8, dtype=torch.float64)
    run = lambda: solve(f, z0, args=(x.detach(),), solver="picard", tol=1e-30, max_iter=10, check_every=every)  # noqa
    run()
    assert host_reads(run) == reads


@pytest.mark.parametrize("every", [0, 2])
def test_non_finite_iterate_raises(every):
    def f(z):
        return torch.where(torch.arange(3)[:, None] == 1, z * float("nan"), 0.5 * z)

    with pytest.raises(NonFiniteError, match=r"samples \[1\]"):
        solve(f, torch.ones(3, 4), solver="anderson", max_iter=6, check_every=every)


def test_a_deferred_forward_reads_all_its_solves_once_and_still_raises():
    # A model forward of n layers, each a check_every=0 solve: one host read at its end, whatever n; a NaN in any
    # layer raises NonFiniteError naming the samples there; a nested decorated forward joins the outer one.
    f, _, x = tanh_problem(B=4, D=8, norm=0.9)

    def nan_in_row_1(z, x):
        return torch.where(torch.arange(4)[:, None] == 1, z * float("nan"), f(z, x))

    @defer_finite_checks
    def layers(z, n, bad_layer=None):
        for i in range(n):
            z, _ = solve(nan_in_row_1 if i == bad_layer else f, z, args=(x.detach(),), max_iter=4, check_every=0)
        return z

    @defer_finite_checks
    def model(n, bad_layer=None):
        return layers(torch.zeros(4, 8, dtype=torch.float64), n, bad_layer)

    assert torch.isfinite(model(2)).all()
    assert host_reads(lambda: model(2)) == host_reads(lambda: model(6)) == 1
    with pytest.raises(NonFiniteError, match=r"samples \[1\]"):
        model(3, bad_layer=1)
    model(2)  # the failed forward left nothing pending behind


def test_stop_fraction_and_solver_halting_act_on_the_device():
    f, _, x = tanh_problem(B=8, D=8, norm=0.95)
    z0 = torch.zeros(8, 8, dtype=torch.float64)
    kw = dict(args=(x.detach(),), solver="picard", tol=1e-12, max_iter=100, stop_fraction=0.5)
    ref_z, ref = solve(f, z0, **kw)
    z, stats = solve(f, z0, **kw, check_every=0)
    assert torch.equal(stats.nstep, ref.nstep) and torch.equal(stats.converged, ref.converged)
    assert torch.equal(z, ref_z)
    # fpopt halts entries whose step size decays below min_step (reported as not converged)
    kw = dict(args=(x.detach(),), solver="fpopt", tol=1e-30, max_iter=60,
              solver_kwargs={"patience": 1, "decay": 0.5, "min_step": 0.05})
    _, ref = solve(f, z0, **kw)
    _, stats = solve(f, z0, **kw, check_every=0)
    assert torch.equal(stats.nstep, ref.nstep) and torch.equal(stats.converged, ref.converged)
    assert not stats.converged.all()


@pytest.mark.parametrize("solver", ["picard", "picard_adaptive"])
@pytest.mark.parametrize("return_mode", ["best", "last"])
@pytest.mark.parametrize("min_iter", [0, 6])
def test_return_modes_and_min_iter_match_the_default_path(solver, return_mode, min_iter):
    # Rows that converge at different steps and rows that never do (their best image is not their last). Row 0 is a
    # constant map, at its fixed point from step 2, moved by 1e-11 at step 5: with min_iter=6 it converges at 6 with
    # a larger residual than its best (0), and returns the image it converged with. check_every=0 keeps one image
    # per entry for all of these.
    _, W, x = tanh_problem(B=8, D=8, norm=0.9)
    scale = torch.tensor([0.0, 0.5, 0.9, 1.0, -1.6, 1.2, 0.3, -2.0], dtype=torch.float64)[:, None]

    def f(z, x):
        f.calls += 1
        out = torch.tanh(scale * (z @ W.T) + x)
        if f.calls == 5:
            out[0] = out[0] * (1 + 1e-11)
        return out

    z0 = torch.zeros(8, 8, dtype=torch.float64)
    kw = dict(args=(x.detach(),), solver=solver, tol=1e-9, max_iter=30, return_mode=return_mode, min_iter=min_iter)
    f.calls = 0
    ref_z, ref = solve(f, z0, **kw)
    f.calls = 0
    z, stats = solve(f, z0, **kw, check_every=0)
    assert 0 < int(ref.converged.sum()) < 8 and int(ref.nstep[0]) == max(min_iter, 2)
    assert torch.equal(stats.nstep, ref.nstep) and torch.equal(stats.converged, ref.converged)
    assert torch.equal(z, ref_z) and torch.equal(stats.residual, ref.residual)
    if min_iter:
        assert float(stats.residual[0]) > 0


def test_check_every_is_validated():
    with pytest.raises(ValueError, match=r"check_every=-1 is out of range; allowed values lie in \[0, inf\)"):
        solve(lambda z: z, torch.zeros(2, 2), check_every=-1)
    with pytest.raises(ValueError, match="check_every"):
        solve(lambda z: z, torch.zeros(2, 2), check_every=1.5)


@pytest.mark.parametrize("backward", ["ift", "phantom", "one_step", "bptt"])
def test_gradients_equal_the_default_path(backward):
    f, W, x = tanh_problem(B=4, D=8, norm=0.8)
    grads = []
    for every in (1, 0):
        W.grad = x.grad = None
        # bptt unrolls its last 5 steps: its whole unroll has as many steps as the forward ran, and 0 runs the budget
        z, _ = fixed_point(f, torch.zeros(4, 8, dtype=torch.float64), args=(x,), solver="anderson", tol=1e-12,
                           max_iter=100, backward=backward, check_every=every,
                           backward_kwargs={"steps": 5} if backward == "bptt" else None)
        (z ** 2).sum().backward()
        grads.append((W.grad.clone(), x.grad.clone()))
    for a, b in zip(*grads):
        assert (a - b).abs().max() < 1e-9


def test_solve_compiles_as_one_graph():
    f, _, x = tanh_problem(B=4, D=8, norm=0.8)
    z0 = torch.zeros(4, 8, dtype=torch.float64)

    def run(z0, x):
        return solve(f, z0, args=(x,), solver="anderson", tol=1e-10, max_iter=12, check_every=0)[0]

    torch._dynamo.reset()
    compiled = torch.compile(run, fullgraph=True, backend="eager")
    with torch.no_grad():
        assert (compiled(z0, x.detach()) - run(z0, x.detach())).abs().max() < 1e-12


def test_fp_check_every_is_validated_wherever_it_enters(tmp_path):
    from hf_fixedpoint.modeling import DEQLMConfig, DEQLMForCausalLM

    bad = r"fp_check_every=-1 is out of range; allowed values lie in \[0, inf\)"
    with pytest.raises(ValueError, match=bad):
        DEQLMConfig(vocab_size=99, hidden_size=32, num_attention_heads=4, fp_check_every=-1)
    model = DEQLMForCausalLM(DEQLMConfig(vocab_size=99, hidden_size=32, num_attention_heads=4)).eval()
    ids = torch.randint(0, 99, (2, 6))
    with pytest.raises(ValueError, match=bad):
        model(ids, fp_check_every=-1)
    model.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=bad):
        DEQLMForCausalLM.from_pretrained(tmp_path, fp_check_every=-1)
    loaded = DEQLMForCausalLM.from_pretrained(tmp_path, fp_check_every=0, fp_max_iter=5)
    with torch.no_grad():  # taken: 0 runs the whole budget
        assert loaded(ids).fp_stats.nfe == 5
        assert loaded(ids, fp_check_every=1, fp_tol=1e9).fp_stats.nfe == 1
