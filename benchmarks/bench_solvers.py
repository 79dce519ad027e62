"""Side-by-side CPU benchmark of hf_fixedpoint's solvers and backward modes against a bare loop and torchdeq.

Run from the repository root::

    python -m benchmarks.bench_solvers            # full run (~10 min budget on 2 cores)
    python -m benchmarks.bench_solvers --quick    # fewer repeats (~2 min budget)
    python -m benchmarks.bench_solvers --profile  # also count torch ops per iteration of each loop

Everything is measured in this run; only the targets (thresholds) are constants. Problem (torchdeq anchor notes
section 2.1): ``f(z) = tanh(z W^T + x U^T)`` with the injection ``x U^T`` precomputed once, B=32, D=256, fp32,
rel tol 1e-4, z0 = 0. One float64 generator (seed 0) draws A, U, x and the loss weights c, in that order.

* (a) Gaussian W, ||W||_2 = 0.90;  (b) Gaussian W, ||W||_2 = 0.99;
* (c) symmetric W = (A + A^T)/2 rescaled to ||W||_2 = 0.99, injection scale 0.1 (rho(J*) ~ 0.97).

Timings: ``torch.set_num_threads(1)``, warm-up calls, then repeats interleaved across the compared methods (so
background load hits all of them alike); min and median are reported, and targets are judged on the ratio of minimums
(the least noisy statistic on a shared machine; the median ratio is printed beside it). Peak memory is measured in a
fresh subprocess per configuration (peak RSS increment over the post-warm-up RSS, glibc mmap threshold lowered so
freed tensors return to the OS). torchdeq (``pip install -c constraints.txt torchdeq==0.1.0``, the ``bench`` extra)
is optional: without it its rows are skipped with a note.
"""

import argparse
import gc
import json
import math
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional

import torch

import hf_fixedpoint
from hf_fixedpoint import fixed_point, solve

try:  # optional comparison
    import torchdeq
    from torchdeq.solver.anderson import anderson_solver as td_anderson
    from torchdeq.solver.broyden import broyden_solver as td_broyden
    from torchdeq.solver.fp_iter import fixed_point_iter as td_fixed_point_iter

    TORCHDEQ_ERROR = None
except Exception as exc:  # pragma: no cover - depends on the environment
    torchdeq = td_anderson = td_broyden = td_fixed_point_iter = None
    TORCHDEQ_ERROR = f"{type(exc).__name__}: {exc}"

B, D = 32, 256
TOL = 1e-4
MAX_ITER = 500
CASES = {
    # name: (symmetric W, spectral norm of W, injection scale)
    "a": (False, 0.90, 1.0),
    "b": (False, 0.99, 1.0),
    "c": (True, 0.99, 0.1),
}
CASE_LABEL = {"a": "(a) gauss |W|=0.90", "b": "(b) gauss |W|=0.99", "c": "(c) sym |W|=0.99 inj 0.1"}

# Targets (the only constants; every measured number below comes from this run).
T1_OVERHEAD = 1.2  # our picard solve / bare loop
T2_NFE = 40  # our Anderson NFE on case (c)
T2_TIME = 0.5  # our Anderson / torchdeq's fastest solver on case (c)
T3_TIME = 0.7  # per-sample stopping with compaction / batch-wide stopping
T6_FIXED = 3.0  # solve of a converged input (1 evaluation) / one bare evaluation of f
T4_FLAT = 1.1  # ift/phantom/one_step peak memory at 64 iterations / at 8
T4_BPTT = 10.0  # bptt(64) / ift(64) peak memory
T5_FP32 = 1e-4
T5_FP64 = 1e-10

SUMMARY: List[tuple] = []


def _loadavg() -> str:
    try:
        return "/".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def _torchdeq_version() -> str:
    if torchdeq is None:
        return "not installed"
    try:
        from importlib.metadata import version

        return version("torchdeq")
    except Exception:
        return "installed (version unknown)"


def record(target: str, what: str, value: Optional[float], op: str, threshold: float, fmt: str = "{:.3g}") -> None:
    """Print one PASS/FAIL line and keep it for the summary table."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        verdict, shown = "SKIP", "n/a"
    else:
        ok = value <= threshold if op == "<=" else value >= threshold
        verdict, shown = ("PASS" if ok else "FAIL"), fmt.format(value)
    SUMMARY.append((target, what, shown, f"{op} {threshold:g}", verdict))
    print(f"  [{verdict}] {target}: {what} = {shown} (target {op} {threshold:g})")


# ---------------------------------------------------------------------------------------------------------------------
# Problems and references
# ---------------------------------------------------------------------------------------------------------------------


@dataclass
class Problem:
    name: str
    W: torch.Tensor  # float64 master copies
    U: torch.Tensor
    x: torch.Tensor
    c: torch.Tensor

    @property
    def inj(self) -> torch.Tensor:
        return self.x @ self.U.T

    def f(self, dtype=torch.float32) -> Callable:
        W, inj = self.W.to(dtype), self.inj.to(dtype)
        return lambda z: torch.tanh(z @ W.T + inj)


def make_problem(case: str, batch: int = B, dim: int = D, seed: int = 0) -> Problem:
    sym, sn, inj_scale = CASES[case]
    g = torch.Generator().manual_seed(seed)
    A = torch.randn(dim, dim, generator=g, dtype=torch.float64) / math.sqrt(dim)
    if sym:
        A = (A + A.T) / 2
    W = A * (sn / torch.linalg.matrix_norm(A, 2))
    U = torch.randn(dim, dim, generator=g, dtype=torch.float64) / math.sqrt(dim) * inj_scale
    x = torch.randn(batch, dim, generator=g, dtype=torch.float64)
    c = torch.randn(batch, dim, generator=g, dtype=torch.float64)
    return Problem(case, W, U, x, c)


def newton_reference(W: torch.Tensor, inj: torch.Tensor, tol: float = 1e-13, max_steps: int = 100) -> torch.Tensor:
    """z* of tanh(z W^T + inj) by float64 Newton with dense per-sample Jacobians."""
    z = torch.zeros_like(inj)
    eye = torch.eye(W.shape[0], dtype=W.dtype)
    for _ in range(max_steps):
        t = torch.tanh(z @ W.T + inj)
        F = z - t
        if float((F.norm(dim=1) / (t.norm(dim=1) + 1e-300)).max()) < tol:
            break
        JF = eye - (1 - t * t)[:, :, None] * W[None]
        z = z - torch.linalg.solve(JF, F)
    return z


def dense_jacobian(W: torch.Tensor, inj: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    t = torch.tanh(z @ W.T + inj)
    return (1 - t * t)[:, :, None] * W[None]  # (B, D, D): J_b = diag(tanh') W


def spectral_radius_dense(J: torch.Tensor) -> torch.Tensor:
    return torch.linalg.eigvals(J).abs().amax(1)


def exact_gradients(p: Problem) -> Dict[str, torch.Tensor]:
    """dL/d{W,U,x} for L = sum(c * z*) in float64: u_b = (I - J_b)^{-T} c_b, then the VJP of f at z*."""
    W, U, x = (t.detach().clone().requires_grad_() for t in (p.W, p.U, p.x))
    zref = newton_reference(p.W, p.inj)
    J = dense_jacobian(p.W, p.inj, zref)
    eye = torch.eye(J.shape[1], dtype=J.dtype)
    u = torch.linalg.solve((eye - J).transpose(1, 2), p.c)
    out = torch.tanh(zref @ W.T + x @ U.T)
    gW, gU, gx = torch.autograd.grad(out, (W, U, x), u)
    return {"W": gW, "U": gU, "x": gx}


# ---------------------------------------------------------------------------------------------------------------------
# Timing helpers and baselines
# ---------------------------------------------------------------------------------------------------------------------


def bench(fns: Dict[str, Callable], reps: int, warmup: int = 3) -> Dict[str, tuple]:
    """Interleaved timing: {name: (min_ms, median_ms)}."""
    with torch.no_grad():
        for _ in range(warmup):
            for fn in fns.values():
                fn()
        times = {k: [] for k in fns}
        gc.collect()
        gc.disable()
        try:
            for _ in range(reps):
                for k, fn in fns.items():
                    t0 = time.perf_counter()
                    fn()
                    times[k].append(time.perf_counter() - t0)
        finally:
            gc.enable()
    return {k: (min(v) * 1e3, statistics.median(v) * 1e3) for k, v in times.items()}


class CountingF:
    """Wrap f to count its evaluations."""

    def __init__(self, f: Callable):
        self.f, self.n = f, 0

    def __call__(self, *args, **kwargs):
        self.n += 1
        return self.f(*args, **kwargs)


def nfe_of(run: Callable[[Callable], object], f: Callable) -> int:
    cf = CountingF(f)
    with torch.no_grad():
        run(cf)
    return cf.n


def bare_loop(f: Callable, z0: torch.Tensor, tol: float = TOL, max_iter: int = MAX_ITER):
    """Minimal Picard loop with the per-sample relative stop test, batch-wide: stop when the max is < tol."""
    z = z0
    for k in range(1, max_iter + 1):
        fz = f(z)
        res = torch.linalg.vector_norm(fz - z, dim=1) / (torch.linalg.vector_norm(fz, dim=1) + 1e-9)
        z = fz
        if res.max() < tol:
            break
    return z, k


def td_solve(name: str):
    fn = {"fixed_point_iter": td_fixed_point_iter, "anderson": td_anderson, "broyden": td_broyden}[name]
    return lambda f, z0: fn(f, z0, max_iter=MAX_ITER, tol=TOL, stop_mode="rel")


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def fmt_ms(t: tuple) -> str:
    return f"{t[0]:8.3f} {t[1]:8.3f}"


# ---------------------------------------------------------------------------------------------------------------------
# 0. Problems: spectral radius of J* from dense per-sample Jacobians
# ---------------------------------------------------------------------------------------------------------------------


def section_problems(problems: Dict[str, Problem]) -> Dict[str, torch.Tensor]:
    print("\n## 0. Problems (B=32, D=256, fp32; rho(J*) and ||J*||_2 from dense per-sample Jacobians at the fp64 "
          "Newton fixed point)")
    refs = {}
    for name, p in problems.items():
        zref = newton_reference(p.W, p.inj)
        J = dense_jacobian(p.W, p.inj, zref)
        rho = spectral_radius_dense(J)
        nrm = torch.linalg.matrix_norm(J, 2)
        refs[name] = zref
        print(f"  {CASE_LABEL[name]:28s} rho(J*) max {float(rho.max()):.3f} (mean {float(rho.mean()):.3f}), "
              f"||J*||_2 max {float(nrm.max()):.3f}")
    return refs


# ---------------------------------------------------------------------------------------------------------------------
# 1. Solver overhead: solve(picard) vs a bare Python loop (and torchdeq's fixed_point_iter)
# ---------------------------------------------------------------------------------------------------------------------


def section_overhead(problems, reps):
    print("\n## 1. Solver overhead: solve(solver='picard') vs a bare loop with the same per-sample rel stop test "
          f"(tol {TOL:g}, max_iter {MAX_ITER}); times in ms (min, median of {reps})")
    z0 = torch.zeros(B, D)
    for name, p in problems.items():
        f = p.f()
        runs = {
            "bare loop": lambda f_: bare_loop(f_, z0),
            "ours picard best": lambda f_: solve(f_, z0, solver="picard", tol=TOL, max_iter=MAX_ITER,
                                                 return_mode="best"),
            "ours picard last": lambda f_: solve(f_, z0, solver="picard", tol=TOL, max_iter=MAX_ITER,
                                                 return_mode="last"),
        }
        if torchdeq is not None:
            runs["torchdeq fixed_point_iter"] = lambda f_: td_solve("fixed_point_iter")(f_, z0)
        nfe = {k: nfe_of(r, f) for k, r in runs.items()}
        t = bench({k: (lambda r=r: r(f)) for k, r in runs.items()}, reps)
        base = t["bare loop"]
        print(f"  {CASE_LABEL[name]}")
        print(f"    {'method':28s} {'NFE':>4s} {'min ms':>8s} {'med ms':>8s} {'us/NFE':>7s} {'ratio min':>9s} "
              f"{'ratio med':>9s}")
        for k in runs:
            print(f"    {k:28s} {nfe[k]:4d} {fmt_ms(t[k])} {t[k][0] * 1e3 / nfe[k]:7.1f} {t[k][0] / base[0]:9.2f} "
                  f"{t[k][1] / base[1]:9.2f}")
        if len({nfe[k] for k in runs}) != 1:
            print(f"    note: NFE differ between methods: {nfe}")
        for rm in ("best", "last"):
            record("1 overhead", f"{name} picard/{rm} / bare loop (min)", t[f"ours picard {rm}"][0] / base[0], "<=",
                   T1_OVERHEAD, "{:.2f}x")
        if torchdeq is not None:
            td = t["torchdeq fixed_point_iter"][0]
            print(f"    info: torchdeq fixed_point_iter / bare loop = {td / base[0]:.2f}x (min); "
                  f"ours picard best / torchdeq = {t['ours picard best'][0] / td:.2f}x")
        else:
            print("    note: torchdeq not installed; its row is skipped")


# ---------------------------------------------------------------------------------------------------------------------
# 1b. Per-call fixed cost: a solve whose input is already converged (one evaluation of f)
# ---------------------------------------------------------------------------------------------------------------------


def section_fixed_cost(problems, reps):
    print(f"\n## 1b. Per-call fixed cost: solve() of an input already at its fixed point (1 evaluation of f; B={B}, "
          f"D={D}) vs one bare evaluation of f; times in ms (min, median of {reps})")
    for name in ("a",):
        p = problems[name]
        f = p.f()
        z_star, st = solve(f, torch.zeros(B, D), solver="picard", tol=TOL, max_iter=MAX_ITER)
        z_star = f(z_star)  # one more step: the residual of z_star is far below the tolerance
        calls = {"bare f(z)": lambda f_: f_(z_star)}
        for s in ("picard", "anderson"):
            for rm in ("best", "last"):
                calls[f"ours {s} {rm}"] = lambda f_, s=s, rm=rm: solve(f_, z_star, solver=s, tol=TOL,
                                                                       max_iter=MAX_ITER, return_mode=rm)
        nfe = {k: nfe_of(c, f) for k, c in calls.items()}
        t = bench({k: (lambda c=c: c(f)) for k, c in calls.items()}, reps * 4)
        base = t["bare f(z)"]
        print(f"  {CASE_LABEL[name]}")
        print(f"    {'method':22s} {'NFE':>4s} {'min ms':>8s} {'med ms':>8s} {'ratio min':>9s} {'ratio med':>9s}")
        for k in calls:
            print(f"    {k:22s} {nfe[k]:4d} {fmt_ms(t[k])} {t[k][0] / base[0]:9.2f} {t[k][1] / base[1]:9.2f}")
        for k in calls:
            if k != "bare f(z)":
                record("6 fixed cost", f"{name} {k[5:]} (converged input) / bare f (min)", t[k][0] / base[0], "<=",
                       T6_FIXED, "{:.2f}x")


# ---------------------------------------------------------------------------------------------------------------------
# 2. Hard case (c): NFE and time of each solver
# ---------------------------------------------------------------------------------------------------------------------


def section_hard(p: Problem, zref: torch.Tensor, reps: int):
    print(f"\n## 2. Hard case {CASE_LABEL['c']}: solvers at rel tol {TOL:g}, max_iter {MAX_ITER} (torchdeq with its "
          f"default solver settings); times in ms (min, median of {reps})")
    f = p.f()
    z0 = torch.zeros(B, D)
    zref32 = zref.float()
    runs = {}
    for s in ("anderson", "broyden", "picard"):
        runs[f"ours {s}"] = lambda f_, s=s: solve(f_, z0, solver=s, tol=TOL, max_iter=MAX_ITER)
    if torchdeq is not None:
        for s in ("fixed_point_iter", "anderson", "broyden"):
            runs[f"torchdeq {s}"] = lambda f_, s=s: td_solve(s)(f_, z0)
    runs["bare loop (picard)"] = lambda f_: bare_loop(f_, z0)
    nfe, err, resid, failed = {}, {}, {}, {}
    for k, r in list(runs.items()):
        cf = CountingF(f)
        try:
            with torch.no_grad():
                out = r(cf)
        except Exception as exc:  # a solver failure is a result, not a crash of the benchmark
            failed[k] = f"{type(exc).__name__} after {cf.n} f-evaluations: {str(exc)[:150]}"
            del runs[k]
            continue
        nfe[k] = cf.n
        z = out[0]
        fz = f(z)
        resid[k] = float(((fz - z).norm(dim=1) / (fz.norm(dim=1) + 1e-9)).max())
        err[k] = float(((z - zref32).norm(dim=1) / zref32.norm(dim=1)).max())
    t = bench({k: (lambda r=r: r(f)) for k, r in runs.items()}, reps, warmup=2)
    print(f"    {'method':26s} {'NFE':>4s} {'min ms':>8s} {'med ms':>8s} {'us/NFE':>7s} {'max rel res':>11s} "
          f"{'max rel err':>11s}")
    for k in runs:
        print(f"    {k:26s} {nfe[k]:4d} {fmt_ms(t[k])} {t[k][0] * 1e3 / nfe[k]:7.1f} {resid[k]:11.2e} {err[k]:11.2e}")
    for k, msg in failed.items():
        print(f"    {k:26s} FAILED: {msg}")
    if "ours anderson" not in runs:
        record("2 hard NFE", "c ours anderson NFE", None, "<=", T2_NFE)
        record("2 hard time", "c ours anderson / torchdeq fastest", None, "<=", T2_TIME)
        return
    record("2 hard NFE", "c ours anderson NFE", float(nfe["ours anderson"]), "<=", T2_NFE, "{:.0f}")
    if torchdeq is not None:
        td = {k: t[k] for k in runs if k.startswith("torchdeq")}
        fastest = min(td, key=lambda k: td[k][0])
        fastest_med = min(td, key=lambda k: td[k][1])
        ratio = t["ours anderson"][0] / td[fastest][0]
        print(f"    torchdeq fastest (min): {fastest} {td[fastest][0]:.2f} ms; ours anderson / it = {ratio:.3f}x "
              "(min), "
              f"{t['ours anderson'][1] / td[fastest_med][1]:.3f}x (median vs fastest median, {fastest_med})")
        for s in ("broyden", "picard"):
            if f"ours {s}" in runs:
                print(f"    info: ours {s} / torchdeq fastest = {t[f'ours {s}'][0] / td[fastest][0]:.3f}x (min)")
        record("2 hard time", f"c ours anderson / torchdeq fastest ({fastest.split()[1]}) (min)", ratio, "<=",
               T2_TIME, "{:.3f}x")
    else:
        print("    note: torchdeq not installed; torchdeq rows skipped")
        record("2 hard time", "c ours anderson / torchdeq fastest", None, "<=", T2_TIME)


# ---------------------------------------------------------------------------------------------------------------------
# 3. Per-sample stopping: half the batch needs ~5 Picard steps, half ~50
# ---------------------------------------------------------------------------------------------------------------------


def _scaled_map(W: torch.Tensor) -> Callable:
    def f(z, s, inj):  # row b depends only on row b of z, s and inj (row-separable)
        return torch.tanh(s[:, None] * (z @ W.T) + inj)

    return f


def _calibrate_scale(f, inj, target: float) -> float:
    """Smallest per-sample scale s (bisection) whose mean Picard nstep reaches ``target``."""
    z0 = torch.zeros_like(inj)
    lo, hi = 0.01, 1.0
    for _ in range(30):
        mid = (lo + hi) / 2
        s = torch.full((inj.shape[0],), mid)
        _, st = solve(f, z0, args=(s, inj), solver="picard", tol=TOL, max_iter=MAX_ITER)
        if float(st.nstep.float().mean()) < target:
            lo = mid
        else:
            hi = mid
    return hi


def f_loop(f, z0, s, inj, nstep, compacted: bool):
    """``f`` alone, no stop test and no bookkeeping, for as many steps as the solve took: on exactly the rows a
    compacted solve evaluates at each step (``compacted``; rows sorted by their step count, so each step is a
    contiguous slice) or on every row. Their time ratio is the floor of what compaction can save."""
    order = torch.argsort(nstep, descending=True, stable=True)
    z, s, inj = z0[order], s[order], inj[order]
    steps = range(1, int(nstep.max()) + 1)
    counts = [int((nstep >= k).sum()) if compacted else len(nstep) for k in steps]

    def run():
        zz = z.clone()
        for n in counts:
            zz[:n] = f(zz[:n], s[:n], inj[:n])
        return zz

    return run


def section_per_sample(reps: int, dims=(D,)):
    print("\n## 3. Per-sample stopping: f(z) = tanh(s_b * z W^T + x U^T), W of case (c), s_b chosen so half the "
          f"batch needs ~5 Picard steps and half ~50 (rows interleaved); picard, tol {TOL:g}; times in ms "
          f"(min, median of {reps})")
    for dim in dims:
        p = make_problem("c", B, dim)
        W, inj = p.W.float(), p.inj.float()
        f = _scaled_map(W)
        s_fast = _calibrate_scale(f, inj, 5)
        s_slow = _calibrate_scale(f, inj, 50)
        slow = torch.arange(B) % 2 == 1
        s = torch.where(slow, torch.tensor(s_slow), torch.tensor(s_fast))
        z0 = torch.zeros(B, dim)
        kw = dict(args=(s, inj), solver="picard", tol=TOL, max_iter=MAX_ITER)
        _, st_c = solve(f, z0, compact=True, **kw)
        _, st_n = solve(f, z0, compact=False, **kw)
        ns = st_c.nstep
        print(f"  B={B}, D={dim}: s_fast={s_fast:.4f}, s_slow={s_slow:.4f}; stats.nstep fast half min/mean/max = "
              f"{int(ns[~slow].min())}/{float(ns[~slow].float().mean()):.1f}/{int(ns[~slow].max())}, slow half = "
              f"{int(ns[slow].min())}/{float(ns[slow].float().mean()):.1f}/{int(ns[slow].max())}; "
              f"same nstep without compaction: {bool((st_n.nstep == ns).all())}")
        fb = lambda z: f(z, s, inj)
        runs = {
            "ours compact=True": lambda: solve(f, z0, compact=True, **kw),
            "ours compact=False": lambda: solve(f, z0, compact=False, **kw),
            "bare batch-wide loop": lambda: bare_loop(fb, z0),
            "f on the running rows": f_loop(f, z0, s, inj, ns, compacted=True),
            "f on every row": f_loop(f, z0, s, inj, ns, compacted=False),
        }
        _, k_bare = bare_loop(fb, z0)
        sample_evals = int(ns.sum())
        print(f"    NFE (calls of f): ours {st_c.nfe}, bare loop {k_bare}; sample-evaluations with compaction "
              f"{sample_evals} vs {B * st_n.nfe} without ({sample_evals / (B * st_n.nfe):.2f} of the work)")
        t = bench(runs, reps)
        for k in runs:
            print(f"    {k:24s} {fmt_ms(t[k])}")
        r_n = t["ours compact=True"][0] / t["ours compact=False"][0]
        r_b = t["ours compact=True"][0] / t["bare batch-wide loop"][0]
        print(f"    ratios (min): compact / compact=False = {r_n:.3f}x, compact / bare batch-wide loop = {r_b:.3f}x; "
              f"(median: {t['ours compact=True'][1] / t['ours compact=False'][1]:.3f}x, "
              f"{t['ours compact=True'][1] / t['bare batch-wide loop'][1]:.3f}x)")
        r_f = t["f on the running rows"][0] / t["f on every row"][0]
        print(f"    floor (not a target): f alone on the running rows / f alone on every row, same steps = {r_f:.3f}x "
              f"(min): what compaction saves with no solver around f (f's cost is not linear in the rows)")
        tag = "" if dim == D else f" [info, D={dim}]"
        if dim == D:
            record("3 per-sample", "compact / same solve compact=False (min)", r_n, "<=", T3_TIME, "{:.3f}x")
            record("3 per-sample", "compact / bare batch-wide loop (min)", r_b, "<=", T3_TIME, "{:.3f}x")
        else:
            print(f"   {tag} (not a target; shows the ratio when f dominates the per-iteration cost)")


# ---------------------------------------------------------------------------------------------------------------------
# 4. Peak training memory (forward + backward), one fresh subprocess per configuration
# ---------------------------------------------------------------------------------------------------------------------

MEM_B, MEM_D = 512, 256  # state (B*D*4 bytes = 512 KiB) >= W (256 KiB), so activations dominate the parameters


def _status_kib(field: str) -> Optional[int]:
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)
        return True
    except OSError:
        return False


def mem_child(cfg: dict) -> dict:
    """Runs inside the subprocess: one training step (fixed_point forward + loss.backward()), measured after one
    warm-up step. Returns the peak RSS increment in KiB."""
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    p = make_problem("b", MEM_B, MEM_D)
    W = torch.nn.Parameter(p.W.float())
    U = torch.nn.Parameter(p.U.float())
    x, c = p.x.float(), p.c.float()

    def train_step():
        if cfg["backward"] == "forward only":  # no-grad solve only: the solver's own working set
            with torch.no_grad():
                inj = x @ U.T
                z, st = solve(lambda z: torch.tanh(z @ W.T + inj), torch.zeros(MEM_B, MEM_D), solver="picard",
                              tol=TOL, min_iter=cfg["iters"], max_iter=cfg["iters"])
                (c * z).sum()
            return st
        inj = x @ U.T
        f = lambda z: torch.tanh(z @ W.T + inj)
        z, st = fixed_point(f, torch.zeros(MEM_B, MEM_D), solver="picard", tol=TOL, min_iter=cfg["iters"],
                            max_iter=cfg["iters"], backward=cfg["backward"], backward_kwargs=cfg["backward_kwargs"])
        (c * z).sum().backward()
        return st

    train_step()
    W.grad = U.grad = None
    gc.collect()
    method = "VmHWM after clear_refs"
    if _reset_peak() and _status_kib("VmRSS") is not None:
        base = _status_kib("VmRSS")
        st = train_step()
        peak = _status_kib("VmHWM")
    else:  # fallback: lifetime peak RSS (an increment can then be underestimated)
        method = "ru_maxrss"
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        st = train_step()
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"inc_kib": peak - base, "base_kib": base, "nfe": st.nfe, "method": method}


def _run_mem_child(cfg: dict) -> dict:
    env = dict(os.environ)
    env["MALLOC_MMAP_THRESHOLD_"] = "65536"  # tensors >= 64 KiB are mmapped, so freeing them lowers RSS
    env["OMP_NUM_THREADS"] = "1"
    cmd = [sys.executable, "-m", "benchmarks.bench_solvers", "--mem-child", json.dumps(cfg)]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=os.path.dirname(os.path.dirname(
        os.path.abspath(__file__))))
    if out.returncode != 0:
        raise RuntimeError(f"memory subprocess failed for {cfg}:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def section_memory(repeats: int):
    state_kib = MEM_B * MEM_D * 4 / 1024
    print(f"\n## 4. Peak training memory (forward + backward), B={MEM_B}, D={MEM_D}, fp32, forward picard forced to N "
          f"iterations (min_iter=max_iter=N); case (b) matrices; one fresh subprocess per configuration, peak RSS "
          f"increment over the post-warm-up RSS; min over {repeats} subprocess(es); 1 state = {state_kib:.0f} KiB")
    rows = {  # label: (backward, backward_kwargs)
        "ift": ("ift", {"max_iter": 64}),
        "phantom": ("phantom", {}),
        "one_step": ("one_step", {}),
        "bptt": ("bptt", {"steps": None}),
        "info: ift, picard adjoint": ("ift", {"max_iter": 64, "solver": "picard"}),
        "info: no-grad forward only": ("forward only", {}),
    }
    jobs = [(label, {"backward": bw, "backward_kwargs": bkw, "iters": n})
            for label, (bw, bkw) in rows.items() for n in (8, 64) for _ in range(repeats)]
    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(lambda job: _run_mem_child(job[1]), jobs))
    inc = {}
    for (label, cfg), res in zip(jobs, results):
        key = (label, cfg["iters"])
        inc[key] = min(inc.get(key, math.inf), res["inc_kib"])
    print(f"    measured with: {results[0]['method']}; NFE check: {sorted({(r['nfe']) for r in results})}")
    print(f"    {'backward':28s} {'N=8 MiB':>8s} {'(states)':>8s} {'N=64 MiB':>9s} {'(states)':>8s} {'64/8':>6s}")
    for label in rows:
        a, b = inc[(label, 8)], inc[(label, 64)]
        print(f"    {label:28s} {a / 1024:8.2f} {a / state_kib:8.1f} {b / 1024:9.2f} {b / state_kib:8.1f} "
              f"{b / max(a, 1):6.2f}")
    slope = (inc[("bptt", 64)] - inc[("bptt", 8)]) / 56 / state_kib
    print(f"    bptt grows by {slope:.2f} states per unrolled step; ift/phantom/one_step use "
          "backward_kwargs={'max_iter': 64} (ift) so that only the forward length differs; the ift adjoint solver is "
          "the default (Anderson) unless noted")
    fwd = inc[("info: no-grad forward only", 64)]
    ba = {label: inc[(label, 64)] - fwd for label in ("bptt", "ift", "info: ift, picard adjoint")}
    print(f"    info (not a target): backward-attributable memory = peak - no-grad forward peak at N=64: bptt "
          f"{ba['bptt'] / state_kib:.1f}, ift {ba['ift'] / state_kib:.1f}, ift with picard adjoint "
          f"{ba['info: ift, picard adjoint'] / state_kib:.1f} states -> bptt/ift "
          f"{ba['bptt'] / max(ba['ift'], 1):.2f}x, "
          f"bptt/ift(picard adjoint) {ba['bptt'] / max(ba['info: ift, picard adjoint'], 1):.2f}x")
    for bw in ("ift", "phantom", "one_step"):
        record("4 memory", f"{bw} peak(64 it) / peak(8 it)", inc[(bw, 64)] / max(inc[(bw, 8)], 1), "<=", T4_FLAT,
               "{:.2f}x")
    record("4 memory", "bptt(64) / ift(64)", inc[("bptt", 64)] / max(inc[("ift", 64)], 1), ">=", T4_BPTT, "{:.2f}x")


# ---------------------------------------------------------------------------------------------------------------------
# 5. Gradient accuracy of the ift backward vs the dense exact gradient
# ---------------------------------------------------------------------------------------------------------------------


def _ift_grads(p: Problem, dtype, tol: float, max_iter: int):
    W, U, x = (t.to(dtype).detach().requires_grad_() for t in (p.W, p.U, p.x))
    inj = x @ U.T
    f = lambda z: torch.tanh(z @ W.T + inj)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        z, st = fixed_point(f, torch.zeros(p.x.shape, dtype=dtype), solver="anderson", tol=tol, max_iter=max_iter,
                            backward="ift", backward_kwargs={"tol": tol, "max_iter": max_iter})
        (p.c.to(dtype) * z).sum().backward()
    return {"W": W.grad, "U": U.grad, "x": x.grad}, st, caught


def section_gradients():
    print("\n## 5. Gradient accuracy: ift (Anderson forward and adjoint) vs the dense exact gradient (fp64 Newton z*, "
          "u_b = (I - J_b)^-T c_b by torch.linalg.solve, then the VJP), loss = sum(c * z*)")
    setups = [("b", torch.float32, B, D, 1e-6, T5_FP32), ("c", torch.float32, B, D, 1e-6, T5_FP32),
              ("b", torch.float64, 4, 16, 1e-12, T5_FP64), ("c", torch.float64, 4, 16, 1e-12, T5_FP64)]
    for case, dtype, bsz, dim, tol, target in setups:
        p = make_problem(case, bsz, dim)
        exact = exact_gradients(p)
        grads, st, caught = _ift_grads(p, dtype, tol, 2000)
        errs = {k: rel_err(grads[k], exact[k]) for k in exact}
        bst = st.backward
        dt = str(dtype).replace("torch.", "")
        print(f"  {CASE_LABEL[case]} {dt} B={bsz} D={dim} tol {tol:g}: forward NFE {st.nfe} (converged "
              f"{st.all_converged}), adjoint NFE {bst.nfe if bst else '-'} (converged "
              f"{bst.all_converged if bst else '-'}); rel.err dL/dW {errs['W']:.2e}, dL/dU {errs['U']:.2e}, "
              f"dL/dx {errs['x']:.2e}" + (f"; warnings: {[str(w.message)[:80] for w in caught]}" if caught else ""))
        record("5 gradient", f"{case} {dt} ift max rel.err", max(errs.values()), "<=", target, "{:.2e}")


# ---------------------------------------------------------------------------------------------------------------------
# Optional: where does the per-iteration time go (torch ops per iteration)
# ---------------------------------------------------------------------------------------------------------------------


def section_profile(p: Problem):
    from torch.profiler import ProfilerActivity, profile

    print("\n## P. Torch ops per iteration (torch.profiler, case (a), picard; top-level aten ops only)")
    f = p.f()
    z0 = torch.zeros(B, D)
    runs = {
        "bare loop": lambda: bare_loop(f, z0),
        "ours picard best": lambda: solve(f, z0, solver="picard", tol=TOL, max_iter=MAX_ITER, return_mode="best"),
        "ours picard last": lambda: solve(f, z0, solver="picard", tol=TOL, max_iter=MAX_ITER, return_mode="last"),
        "ours anderson": lambda: solve(f, z0, solver="anderson", tol=TOL, max_iter=MAX_ITER),
    }
    if torchdeq is not None:
        runs["torchdeq fixed_point_iter"] = lambda: td_solve("fixed_point_iter")(f, z0)
    with torch.no_grad():
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            f(z0)
        f_ops = sum(e.name.startswith("aten::") and (e.cpu_parent is None or not e.cpu_parent.name.startswith(
            "aten::")) for e in prof.events())
        print(f"  f itself: {f_ops} top-level aten ops per evaluation")
        for k, r in runs.items():
            r()
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                r()
            top = [e for e in prof.events() if e.name.startswith("aten::")
                   and (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::"))]
            counts: Dict[str, int] = {}
            for e in top:
                counts[e.name] = counts.get(e.name, 0) + 1
            nfe = counts.get("aten::tanh", 1)
            busiest = sorted(counts.items(), key=lambda kv: -kv[1])[:12]
            print(f"  {k:26s} NFE {nfe:3d}: {len(top) / nfe:5.1f} top-level aten ops / iteration; "
                  + ", ".join(f"{name[6:]}:{cnt / nfe:.1f}" for name, cnt in busiest))


# ---------------------------------------------------------------------------------------------------------------------


# ---------------------------------------------------------------------------------------------------------------------
# 6. check_every: the solve loop's own cost on a cheap map against a bare loop of the same evaluations
# ---------------------------------------------------------------------------------------------------------------------

T7_CHECK = 1.2  # solve with a check every few iterations / bare loop of the same evaluations of f


def section_check_every(reps: int, batch: int = 24, dim: int = 320, n_eval: int = 10):
    """Plain Picard for exactly ``n_eval`` evaluations (a tolerance it does not reach) with ``check_every`` 1, 4, 8
    and 0 against ``for _ in range(n_eval): z = f(z)``, on ``tanh(z W^T + x)`` (B=24, D=320: one evaluation is about
    0.15 ms on one quiet CPU thread)."""
    p = make_problem("a", batch=batch, dim=dim)
    f = p.f()
    z0 = torch.zeros(batch, dim)

    def bare():
        z = z0
        for _ in range(n_eval):
            z = f(z)
        return z

    calls = {"bare loop": bare}
    for every in (1, 4, 8, 0):
        calls[f"picard check_every={every}"] = lambda every=every: solve(
            f, z0, solver="picard", tol=1e-30, max_iter=n_eval, check_every=every)
    t = bench(calls, reps * 4)
    base = t["bare loop"]
    print(f"\n## 6. check_every: plain Picard, {n_eval} evaluations of tanh(z W^T + x) (B={batch}, D={dim}) against a "
          f"bare loop of the same evaluations; times in ms (min, median of {reps * 4})")
    print(f"    {'method':28s} {'min ms':>8s} {'med ms':>8s} {'ratio min':>9s} {'ratio med':>9s}")
    for k in calls:
        print(f"    {k:28s} {fmt_ms(t[k])} {t[k][0] / base[0]:9.2f} {t[k][1] / base[1]:9.2f}")
    for every in (4, 8, 0):
        record("7 check_every", f"picard check_every={every} / bare loop (min)",
               t[f"picard check_every={every}"][0] / base[0], "<=", T7_CHECK, "{:.2f}x")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer repeats (~2 min)")
    ap.add_argument("--profile", action="store_true", help="also count torch ops per solver iteration")
    ap.add_argument("--sections", default="0,1,1b,2,3,4,5,6",
                    help="comma-separated sections to run (default: all; the op profile is --profile)")
    ap.add_argument("--mem-child", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.mem_child is not None:
        print(json.dumps(mem_child(json.loads(a.mem_child))))
        return 0

    torch.set_num_threads(1)
    t_start = time.perf_counter()
    reps_fast = 15 if a.quick else 60  # ~1-3 ms per call
    reps_slow = 5 if a.quick else 15  # up to ~100 ms per call (torchdeq anderson on case c)
    mem_repeats = 1 if a.quick else 2
    print(f"# bench_solvers{' --quick' if a.quick else ''}: hf_fixedpoint {hf_fixedpoint.__version__}, torch "
          f"{torch.__version__}, torchdeq {_torchdeq_version()}, "
          f"python {platform.python_version()}, {os.cpu_count()} CPUs, torch threads {torch.get_num_threads()}, "
          f"load average {_loadavg()}")
    if torchdeq is None:
        print(f"# note: torchdeq is not importable ({TORCHDEQ_ERROR}); install it with "
              "`pip install -c constraints.txt torchdeq==0.1.0` for the comparison rows. They are skipped.")
    problems = {k: make_problem(k) for k in CASES}
    sections = set(a.sections.split(","))
    unknown = sections - {"0", "1", "1b", "2", "3", "4", "5", "6"}
    if unknown:
        raise ValueError(f"--sections has unknown entries {sorted(unknown)}; allowed: 0, 1, 1b, 2, 3, 4, 5, 6.")
    refs = section_problems(problems) if sections & {"0", "2"} else {}
    if "1" in sections:
        section_overhead(problems, reps_fast)
    if "1b" in sections:
        section_fixed_cost(problems, reps_fast)
    if "2" in sections:
        section_hard(problems["c"], refs["c"], reps_slow)
    if "3" in sections:
        section_per_sample(reps_fast, dims=(D,) if a.quick else (D, 1024))
    if "4" in sections:
        section_memory(mem_repeats)
    if "5" in sections:
        section_gradients()
    if "6" in sections:
        section_check_every(reps_fast)
    if a.profile:
        section_profile(problems["a"])

    print("\n## Summary (ratios are min-over-repeats ratios measured in this run)")
    w = [max(len(r[i]) for r in SUMMARY + [("target", "measurement", "value", "goal", "result")]) for i in range(5)]
    head = ("target", "measurement", "value", "goal", "result")
    print("  " + " | ".join(h.ljust(w[i]) for i, h in enumerate(head)))
    print("  " + "-+-".join("-" * x for x in w))
    for r in SUMMARY:
        print("  " + " | ".join(str(v).ljust(w[i]) for i, v in enumerate(r)))
    n_fail = sum(r[4] == "FAIL" for r in SUMMARY)
    n_pass = sum(r[4] == "PASS" for r in SUMMARY)
    n_skip = sum(r[4] == "SKIP" for r in SUMMARY)
    print(f"\n  {n_pass} PASS, {n_fail} FAIL, {n_skip} SKIP; total wall time {time.perf_counter() - t_start:.0f} s; "
          f"load average at the end {_loadavg()} (other processes on the machine inflate times; ratios are "
          "interleaved)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
