"""Bad input gets a clear error naming the argument and the allowed values."""

import pytest
import torch

from hf_fixedpoint import NonFiniteError, fixed_point, get_sampler, solve
from hf_fixedpoint.core.fp_settings import pop_fp_kwargs

Z = torch.zeros(2, 3)
F = lambda z: 0.5 * z + 1


@pytest.mark.parametrize(
    "kwargs, pattern",
    [
        ({"solver": "andersn"}, r"solver='andersn'.*Allowed values: 'anderson', 'broyden', 'fpopt', 'picard'"),
        ({"backward": "implicit"}, r"Unknown backward mode 'implicit'.*'bptt', 'ift', 'one_step', 'phantom'"),
        ({"tol": 0.0}, r"tol=0.0 is out of range; allowed values lie in \(0.0, inf\)"),
        ({"tol": -1e-3}, r"tol=-0.001 is out of range"),
        ({"max_iter": 0}, r"max_iter=0 is out of range; allowed values lie in \[1, inf\)"),
        ({"max_iter": 2.5}, r"max_iter must be an integer"),
        ({"min_iter": 5, "max_iter": 4}, r"min_iter=5 must not exceed max_iter=4"),
        ({"stop_mode": "relative"}, r"stop_mode='relative' is not allowed. Allowed values: 'rel', 'abs'"),
        ({"norm": "l1"}, r"norm='l1' is not allowed. Allowed values: 'l2', 'linf'"),
        ({"return_mode": "first"}, r"return_mode='first' is not allowed"),
        ({"stop_fraction": 1.0}, r"stop_fraction=1.0 is out of range"),
        ({"batch_dims": 0}, r"batch_dims=0 is out of range"),
        ({"solver_kwargs": {"m": 0}}, r"m=0 is out of range; allowed values lie in \[1, inf\)"),
        ({"solver_kwargs": {"window": 5}}, r"unknown keys \['window'\] for solver 'anderson'. Allowed keys: \['m'"),
        ({"solver": "picard", "solver_kwargs": {"damping": 1.5}}, r"damping=1.5 is out of range.*\(0.0, 1.0\]"),
        ({"solver": "picard", "solver_kwargs": {"damping": 0.0}}, r"damping=0.0 is out of range"),
        ({"solver": "fpopt", "solver_kwargs": {"step_size": 2.0}}, r"step_size=2.0 is out of range.*\(0.0, 1.0\]"),
        ({"solver": "anderson", "solver_kwargs": {"beta": 0.0}}, r"beta=0.0 is out of range"),
        ({"solver": "broyden", "solver_kwargs": {"memory": 0}}, r"memory=0 is out of range"),
        ({"backward": "phantom", "backward_kwargs": {"steps": 0}}, r"backward_kwargs\['steps'\]=0 is out of range"),
        ({"backward": "phantom", "backward_kwargs": {"damping": 2}}, r"backward_kwargs\['damping'\]=2 is out of"),
        ({"backward": "one_step", "backward_kwargs": {"steps": 2}}, r"unknown keys \['steps'\] for backward"),
        ({"backward_kwargs": {"mask": "yes"}}, r"mask'\]='yes' is not allowed"),
        ({"backward_kwargs": {"solver": "newton"}}, r"Unknown solver 'newton'"),
    ],
)
def test_bad_arguments(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        fixed_point(F, Z, **kwargs)


def test_shape_mismatch():
    with pytest.raises(ValueError, match=r"f returned shape \(2, 4\) for an input of shape \(2, 3\)"):
        solve(lambda z: torch.ones(2, 4), Z)


def test_batch_dims_larger_than_state():
    with pytest.raises(ValueError, match="batch_dims=3 needs z0 with at least that many dims"):
        solve(F, Z, batch_dims=3)


@pytest.mark.parametrize("solver", ["picard", "fpopt", "picard_adaptive", "anderson", "broyden"])
def test_nan_names_iteration_and_samples(solver):
    def f(z):
        out = 0.5 * z + 1
        if f.calls == 1:
            out = out.clone()
            out[1] = float("nan")
            out[3, 0] = float("inf")
        f.calls += 1
        return out

    f.calls = 0
    with pytest.raises(NonFiniteError, match=r"iteration 2 for samples \[1, 3\] \(of 4\)"):
        solve(f, torch.zeros(4, 3), solver=solver, tol=1e-12)


def test_nan_input_is_reported_at_first_iteration():
    with pytest.raises(NonFiniteError, match=r"iteration 1 for samples \[0\]"):
        solve(lambda z, x: z * 0.5 + x, torch.zeros(2, 3), args=(torch.tensor([[float("nan")] * 3, [1.0] * 3]),))


def test_config_settings_reject_typos_and_bad_values():
    with pytest.raises(ValueError, match=r"Unknown fixed-point setting\(s\) \['fp_slover'\].*Valid keys"):
        pop_fp_kwargs({"fp_slover": "picard"})
    with pytest.raises(ValueError, match=r"fp_solver='newton' is not a known solver"):
        pop_fp_kwargs({"fp_solver": "newton"})
    with pytest.raises(ValueError, match=r"fp_tol=0 is out of range"):
        pop_fp_kwargs({"fp_tol": 0})
    with pytest.raises(ValueError, match=r"fp_min_iter=9 must not exceed fp_max_iter=3"):
        pop_fp_kwargs({"fp_min_iter": 9, "fp_max_iter": 3})
    with pytest.raises(ValueError, match=r"fp_solver_kwargs has unknown keys"):
        pop_fp_kwargs({"fp_solver_kwargs": {"mm": 3}})
    with pytest.raises(ValueError, match=r"fp_solver_kwargs for solver 'anderson': m=0 is out of range"):
        pop_fp_kwargs({"fp_solver": "anderson", "fp_solver_kwargs": {"m": 0}})
    with pytest.raises(ValueError, match=r"fp_backward='jfb' is not a known backward mode"):
        pop_fp_kwargs({"fp_backward": "jfb"})
    with pytest.raises(ValueError, match=r"fp_eval_max_iter=0 is out of range"):
        pop_fp_kwargs({"fp_eval_max_iter": 0})
    kwargs = {"fp_max_iter": 7, "other": 1}
    settings = pop_fp_kwargs(kwargs)
    assert kwargs == {"other": 1} and settings["fp_max_iter"] == 7


def test_sampler_errors():
    with pytest.raises(ValueError, match=r"Unknown loop sampler 'gauss'.*'exponential', 'fixed', 'lognormal'"):
        get_sampler("gauss")
