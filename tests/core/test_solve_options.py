"""``SolveOptions``: one options object for solve, fixed_point, the config translation and the statistics; and the
solve loop's bookkeeping (best-iterate tracking, compaction) against an unrolled per-row reference (float64)."""

import dataclasses

import pytest
import torch

from hf_fixedpoint import fixed_point, solve
from hf_fixedpoint.core.fp_settings import CONFIG_OPTIONS, fixed_point_kwargs, pop_fp_kwargs, solve_options
from hf_fixedpoint.core.fp_solvers import OPTION_NAMES, SolveOptions
from tests.core.problems import tanh_problem


def test_options_object_and_keywords_give_the_same_solve():
    f, W, x = tanh_problem(B=4, D=8, norm=0.9)
    z0 = torch.zeros(4, 8, dtype=torch.float64)
    opts = SolveOptions(solver="picard", tol=1e-10, max_iter=200, return_mode="last")
    z1, s1 = solve(f, z0, args=(x.detach(),), options=opts)
    z2, s2 = solve(f, z0, args=(x.detach(),), solver="picard", tol=1e-10, max_iter=200, return_mode="last")
    assert torch.equal(z1, z2) and torch.equal(s1.nstep, s2.nstep)
    assert s1.options == opts and s2.options == opts  # the statistics carry the options they ran with
    # keywords given with options replace its fields
    _, s3 = solve(f, z0, args=(x.detach(),), options=opts, tol=1e-4)
    assert s3.options == dataclasses.replace(opts, tol=1e-4) and s3.nfe < s1.nfe


def test_cached_keyword_options_are_validated_by_type_and_keep_their_own_dict():
    # Keyword options are validated once and cached; 10.0 equals 10 as a dict key but is not a valid max_iter, and a
    # solver_kwargs dict changed by its owner after the call does not change the options cached from it.
    f, _, x = tanh_problem(B=2, D=4)
    z0 = torch.zeros(2, 4, dtype=torch.float64)
    solve(f, z0, args=(x.detach(),), max_iter=10)
    with pytest.raises(ValueError, match="max_iter must be an integer, got 10.0"):
        solve(f, z0, args=(x.detach(),), max_iter=10.0)
    kwargs = {"m": 3}
    _, first = solve(f, z0, args=(x.detach(),), solver_kwargs=kwargs)
    kwargs["m"] = 2
    _, again = solve(f, z0, args=(x.detach(),), solver_kwargs={"m": 3})
    assert first.options.solver_kwargs == again.options.solver_kwargs == {"m": 3}
    assert solve(f, z0, args=(x.detach(),), solver_kwargs=kwargs)[1].options.solver_kwargs == {"m": 2}
    # the types inside solver_kwargs count too: 5.0 and True equal 5 and 1 as dict values, but are not patiences
    for valid, invalid in ((5, 5.0), (1, True)):
        solve(f, z0, args=(x.detach(),), solver="fpopt", solver_kwargs={"patience": valid})
        with pytest.raises(ValueError, match="patience must be an integer"):
            solve(f, z0, args=(x.detach(),), solver="fpopt", solver_kwargs={"patience": invalid})
    # the options a solve hands out (stats.options) are the caller's: changing them changes no later solve
    again.options.solver_kwargs["m"] = -7
    assert solve(f, z0, args=(x.detach(),), solver_kwargs={"m": 3})[1].options.solver_kwargs == {"m": 3}
    with pytest.raises(ValueError, match="solver_kwargs"):  # keys that are not names: the usual error, not a TypeError
        solve(f, z0, args=(x.detach(),), solver_kwargs={1: 2, "m": 3})


def test_unknown_option_is_a_value_error_listing_the_options():
    f, _, x = tanh_problem(B=2, D=4)
    with pytest.raises(ValueError, match=r"unknown keys \['tolerance'\].*'tol'"):
        solve(f, torch.zeros(2, 4, dtype=torch.float64), args=(x.detach(),), tolerance=1e-6)
    with pytest.raises(ValueError, match=r"unknown keys \['max_iters'\]"):
        fixed_point(f, torch.zeros(2, 4, dtype=torch.float64), args=(x.detach(),), max_iters=3)
    with pytest.raises(ValueError, match=r"unknown keys \['tolerance'\]"):
        SolveOptions().replace(tolerance=1e-6)


@pytest.mark.parametrize("field,value,name", [("return_mode", "worst", "return_mode"), ("norm", "l3", "norm"),
                                              ("tol", 0.0, "tol"), ("max_iter", 0, "max_iter")])
def test_options_check_names_the_field(field, value, name):
    with pytest.raises(ValueError, match=f"{name}="):
        SolveOptions(**{field: value}).check()


def test_config_errors_name_the_config_key():
    with pytest.raises(ValueError, match=r"fp_return='worst' is not allowed. Allowed values: 'best', 'last'"):
        pop_fp_kwargs({"fp_return": "worst"})
    with pytest.raises(ValueError, match="fp_min_iter=5 must not exceed fp_max_iter=3"):
        pop_fp_kwargs({"fp_min_iter": 5, "fp_max_iter": 3})


def test_config_translation_is_the_options_object():
    class Config:
        pass

    config = Config()
    for k, v in pop_fp_kwargs({"fp_solver": "picard", "fp_max_iter": 7, "fp_eval_max_iter": 3,
                               "fp_min_iter": 2}).items():
        setattr(config, k, v)
    train, evaluate = solve_options(config, True), solve_options(config, False)
    assert (train.solver, train.max_iter, train.min_iter) == ("picard", 7, 2)
    assert (evaluate.max_iter, evaluate.min_iter) == (3, 2)
    kw = fixed_point_kwargs(config, False)
    assert {k: kw[k] for k in CONFIG_OPTIONS} == {k: getattr(evaluate, k) for k in CONFIG_OPTIONS}
    assert set(CONFIG_OPTIONS) <= set(OPTION_NAMES)


def _reference(f, z0, tol, max_iter, return_mode):
    """Per-row Picard with the relative l2 stop test, each row alone: (z, residual, nstep)."""
    zs, rs, ns = [], [], []
    for b in range(z0.shape[0]):
        z, best = z0[b : b + 1], None
        for k in range(1, max_iter + 1):
            fz = f(z, b)
            r = float((fz - z).norm() / (fz.norm() + 1e-9))
            if best is None or r < best[1]:
                best = (fz, r)
            if r < tol:
                best = (fz, r)
                break
            z = fz
        out = best if return_mode == "best" or r < tol else (fz, r)
        zs.append(out[0])
        rs.append(out[1])
        ns.append(k)
    return torch.cat(zs), torch.tensor(rs, dtype=torch.float64), torch.tensor(ns)


@pytest.mark.parametrize("compact,every", [(False, 1), (True, 1), (False, 0)])
@pytest.mark.parametrize("return_mode", ["best", "last"])
def test_bookkeeping_matches_a_per_row_reference_float64(compact, every, return_mode):
    # Row 0 converges fast, row 1 slowly, row 2 oscillates (residual goes up and down: the best-iterate tracking
    # switches to updating every step), row 3 never converges within the cap.
    g = torch.Generator().manual_seed(0)
    D = 6
    A = torch.randn(D, D, generator=g, dtype=torch.float64)
    W = A / torch.linalg.matrix_norm(A, 2)
    x = torch.randn(4, D, generator=g, dtype=torch.float64)
    scale = torch.tensor([0.05, 0.9, -1.3, 1.5], dtype=torch.float64)
    rot = torch.linalg.qr(torch.randn(D, D, generator=g, dtype=torch.float64))[0]

    def f_batch(z, s, xx):
        lin = torch.tanh(s[:, None] * (z @ W.T) + xx)
        return torch.where((s < 0)[:, None], -z @ rot.T * 0.97 + 0.1 * lin, lin)

    def f_row(z, b):
        return f_batch(z, scale[b : b + 1], x[b : b + 1])

    tol, max_iter = 1e-8, 40
    z_ref, r_ref, n_ref = _reference(f_row, torch.zeros(4, D, dtype=torch.float64), tol, max_iter, return_mode)
    z, st = solve(f_batch, torch.zeros(4, D, dtype=torch.float64), args=(scale, x), solver="picard", tol=tol,
                  max_iter=max_iter, return_mode=return_mode, compact=compact, track_trace=True, check_every=every)
    trace = st.trace[:, 2]
    steps = trace[~torch.isnan(trace)]
    assert (steps[1:] > steps[:-1]).any(), "row 2 should have a residual that goes up"
    assert st.converged.tolist() == (n_ref < max_iter).tolist() and st.converged[:2].all() and not st.converged[3]
    assert torch.equal(st.nstep, n_ref)
    torch.testing.assert_close(st.residual, r_ref, rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(z, z_ref, rtol=0, atol=1e-12)
