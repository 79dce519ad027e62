# Source of truth: hf_fixedpoint/core/fp_solvers.py. Verbatim copies live in modeling/*/ so that checkpoints
# saved with save_pretrained() load with torch + transformers only. Edit here, then run
# `python -m hf_fixedpoint.vendor`. Allowed imports: stdlib, torch, and `from .fp_<x> import ...`.
"""Forward fixed-point solvers: ``picard``, ``fpopt``, ``picard_adaptive``, ``anderson`` and ``broyden``, and the loop
they share.

``solve(f, z0, ...)`` finds ``z* = f(z*)`` without building an autograd graph. Convergence is judged per *entry*:
the first ``batch_dims`` dimensions of ``z`` index independent entries (samples by default; ``batch_dims=2`` on a
``(B, T, D)`` state means per token, ``batch_dims=3`` on ``(B, H, T, d)`` means per head and token). An entry that
meets the tolerance keeps the result of that step while the others go on (selective update), so an entry's result
does not depend on how long its batch-mates take. Its state is frozen at that result (it feeds the other entries of
its sample through ``f``), except with ``picard``, one entry per sample (``batch_dims=1``) and an ``f`` that is not
told which entries are open (no ``pass_active``): there the result is already kept and a sample's later iterates
feed only its own row (samples of a batch do not interact), so finished samples run on unchanged instead of paying
an op on the whole state per step (one whose iterates turn non-finite is held from then on). With ``compact=True``
the solver also drops finished *samples* from the working set, so ``f`` and the solver's own algebra run only on
unfinished rows; this requires ``f`` to act on each sample independently (row ``i`` of its output depends only on row
``i`` of ``z`` and of the batch-sized tensors in ``args``).

Each solver is a small class registered in ``SOLVERS``: ``step(z, fz, gz, k)`` returns the next iterate from the
current one, its image ``fz = f(z)`` and the residual ``gz = fz - z``; the per-entry state it keeps is a dict of
tensors whose first dimension indexes entries, so the loop can drop finished rows from it.
"""

import functools
import math
import threading
from dataclasses import dataclass, fields, replace
from typing import Callable, Optional, Sequence, Union

import torch

from .fp_registry import Registry, check_choice, check_keywords, check_number, keyword_options
from .fp_stats import FixedPointStats, NonFiniteError

SOLVERS = Registry("solver")
STOP_MODES = ("rel", "abs")
NORMS = ("l2", "linf", "token_linf")
RETURN_MODES = ("best", "last")


class _Solver:
    """Base class: the per-entry state is ``self.state`` (tensors with a leading entry dimension).

    ``host_reads``: whether ``step`` may read a tensor back to the host to skip work (True by default); the loop of a
    solve with ``check_every != 1`` sets it to False, so a step then issues device ops only."""

    host_reads = True

    def __init__(self):
        self.state = {}

    def init(self, z: torch.Tensor) -> None:
        self.state = {}

    def select(self, rows: torch.Tensor) -> None:
        self.state = {k: v[rows] for k, v in self.state.items()}

    def step(self, z, fz, gz, k):  # pragma: no cover - interface
        raise NotImplementedError

    def halted(self) -> Optional[torch.Tensor]:
        """Entries the solver gave up on (not converged); None when it never gives up."""
        return None


@SOLVERS.register("picard")
class Picard(_Solver):
    """Fixed-point (Picard / Krasnoselskii-Mann) iteration ``z <- (1 - damping) z + damping f(z)``.

    Args:
        damping: step size in (0, 1]; 1 is plain iteration.
    """

    def __init__(self, damping: float = 1.0):
        super().__init__()
        check_number(damping, "damping", low=0.0, high=1.0, low_open=True)
        self.damping = float(damping)

    def step(self, z, fz, gz, k):
        return fz if self.damping == 1.0 else z + self.damping * gz


@SOLVERS.register("fpopt")
class FPOpt(_Solver):
    """FPRM's damped fixed-point optimizer: Picard with a per-entry step size that decays when progress stalls.

    As in FPRM's ``FixedPointOptimizer``: each step moves with the current step size, ``z <- z + s (f(z) - z)``;
    after the step the residual of ``z`` (passed to ``observe`` before ``step``) updates the lowest residual seen and
    a patience counter, and an entry that went ``patience`` steps without a new lowest residual while its residual is
    still ``>= threshold`` has its step size multiplied by ``decay`` (so the decay acts from the next step on). An
    entry whose step size falls below ``min_step`` is halted (reported as not converged). Use with
    ``norm="token_linf"`` and ``stop_mode="rel"`` for FPRM's per-token relative l-infinity residual.

    Args:
        step_size: initial step size in (0, 1].
        patience: non-improving steps tolerated before a decay (>= 1).
        decay: multiplicative decay in (0, 1) (FPRM: 0.9 in training, 0.99 at evaluation).
        min_step: entries halt once their step size is below this (>= 0).
        threshold: no decay while the residual is below this (>= 0; FPRM: its ``fp_thresh``, 0.1).
        improve_margin: a residual counts as a new lowest only when ``res < best - improve_margin`` (>= 0; 0: any
            decrease; the FPRM research code at commit 9e0ebf35 uses 0.01, so a slow drift loses patience).
    """

    def __init__(self, step_size: float = 1.0, patience: int = 5, decay: float = 0.9, min_step: float = 1e-3,
                 threshold: float = 0.0, improve_margin: float = 0.0):
        super().__init__()
        check_number(step_size, "step_size", low=0.0, high=1.0, low_open=True)
        check_number(patience, "patience", low=1, integer=True)
        check_number(decay, "decay", low=0.0, high=1.0, low_open=True, high_open=True)
        check_number(min_step, "min_step", low=0.0)
        check_number(threshold, "threshold", low=0.0)
        check_number(improve_margin, "improve_margin", low=0.0)
        self.step_size, self.patience, self.decay, self.min_step = float(step_size), patience, float(decay), min_step
        self.threshold, self.improve_margin = float(threshold), float(improve_margin)
        self._res = None

    def init(self, z):
        n = z.shape[0]
        self.state = {
            "s": z.new_full((n, 1), self.step_size),
            "best": z.new_full((n,), math.inf),
            "patience": torch.full((n,), self.patience, dtype=torch.long, device=z.device),
        }

    def observe(self, res):
        """The residual of the iterate the next ``step`` moves from."""
        self._res = res

    def step(self, z, fz, gz, k):
        st = self.state
        out = z + st["s"] * gz
        res, self._res = self._res, None
        if res is not None:
            improved = res < (st["best"] - self.improve_margin if self.improve_margin else st["best"])
            st["best"] = torch.where(improved, res, st["best"])
            patience = torch.where(improved, self.patience, st["patience"] - 1)
            decay = (patience <= 0) & (res >= self.threshold)
            st["patience"] = torch.where(decay, self.patience, patience)
            st["s"] = torch.where(decay[:, None], st["s"] * self.decay, st["s"])
        return out

    def halted(self):
        return self.state["s"][:, 0] < self.min_step


@SOLVERS.register("picard_adaptive")
class AdaptivePicard(_Solver):
    """Picard iteration, relaxed per entry where it oscillates.

    An entry whose residual ``g_k = f(z_k) - z_k`` points against its previous one (``g_k . g_{k-1} < 0``: the iterate
    overshoots and comes back, a Jacobian eigenvalue below 0) takes the relaxed step ``z + w g_k``; every other entry
    takes the plain step ``f(z)``. A contracting map with aligned steps is iterated exactly as ``picard`` does.

    With ``damping="auto"`` (default) ``w = 1 / (1 - lam)`` where ``lam = g_k . g_{k-1} / ||g_{k-1}||^2`` is the
    secant estimate of the eigenvalue along the previous residual: the relaxation that would cancel that mode of a
    linear map in one step (``lam = -1``: ``w = 1/2``; ``lam = -0.2``: ``w = 0.83``, nearly the plain step, where a
    fixed half step would slow the iteration from a factor 0.2 to 0.4 per step). An entry that also flipped at its
    previous step oscillates persistently (complex eigenvalues, or a mode the one-direction estimate misses) and takes
    at most the half step; ``w`` is kept >= ``MIN_STEP``. A number is a fixed step size for every oscillating entry.

    Args:
        damping: ``"auto"`` or a step size in (0, 1) for oscillating entries.
    """

    MIN_STEP = 0.1

    def __init__(self, damping: Union[float, str] = "auto"):
        super().__init__()
        if damping != "auto":
            if isinstance(damping, str):
                raise ValueError(f"damping={damping!r} must be 'auto' or a number in (0.0, 1.0).")
            check_number(damping, "damping", low=0.0, high=1.0, low_open=True, high_open=True)
            damping = float(damping)
        self.damping = damping

    def init(self, z):
        self.state = {"prev": torch.zeros_like(z), "flipped": torch.zeros(z.shape[0], dtype=torch.bool,
                                                                           device=z.device)}

    def step(self, z, fz, gz, k):
        prev, flipped = self.state["prev"], self.state["flipped"]
        dot = (gz * prev).sum(-1)
        flips = dot < 0  # the zero initial state counts as aligned
        self.state["prev"], self.state["flipped"] = gz, flips
        if self.host_reads and not bool(flips.any()):
            return fz
        step = self.damping
        if step == "auto":
            lam = dot / (prev * prev).sum(-1).clamp_min(torch.finfo(dot.dtype).tiny)
            step = (1.0 / (1.0 - lam)).clamp(min=self.MIN_STEP)
            step = torch.where(flipped, step.clamp(max=0.5), step)[:, None]
        return torch.where(flips[:, None], z + step * gz, fz)


@SOLVERS.register("anderson")
class Anderson(_Solver):
    """Type-II Anderson acceleration with a ridge scaled to the residuals.

    Solves ``min ||sum_i a_i g_i||^2 + lam * s * ||a||^2`` subject to ``sum_i a_i = 1`` over the last ``m`` residuals,
    with ``s`` the mean squared norm of those residuals. Scaling the ridge by ``s`` makes the method invariant to the
    scale of the state; torchdeq's absolute ``lam=1e-4`` stalls once ``||g||^2`` falls below it (313 evaluations on a
    case plain iteration solves in 115). The small linear systems are solved in float32 at least, so bf16/fp16 states
    work on every device; a singular system falls back to a plain step for that entry.

    Args:
        m: history size (>= 1).
        beta: mixing parameter in (0, 1]: ``z <- beta * sum a_i f(z_i) + (1 - beta) * sum a_i z_i``.
        lam: relative ridge (>= 0).
    """

    def __init__(self, m: int = 5, beta: float = 1.0, lam: float = 1e-8):
        super().__init__()
        check_number(m, "m", low=1, integer=True)
        check_number(beta, "beta", low=0.0, high=1.0, low_open=True)
        check_number(lam, "lam", low=0.0)
        self.m, self.beta, self.lam = m, float(beta), float(lam)

    def init(self, z):
        self.count = 0
        self.state = {}  # the history, made at the first step (a solve whose first evaluation converges needs none)
        self.consts = {}  # per history length: the right-hand side of ones and the one-hot rows of the plain step

    def _consts(self, n, mm, H):
        """``(ones (n, mm), eye (mm, mm))`` in the solve's dtype, made once per history length and row count."""
        key = (n, mm)
        if key not in self.consts:
            self.consts[key] = (H.new_ones(n, mm), torch.eye(mm, dtype=H.dtype, device=H.device))
        return self.consts[key]

    def step(self, z, fz, gz, k):
        st, m, beta = self.state, self.m, self.beta
        if self.count == 0:  # only slots already written are read: no need to zero the states
            n, d = z.shape
            st["F"], st["G"] = z.new_empty(n, m, d), z.new_empty(n, m, d)  # images f(z_i) and residuals g_i
            if beta != 1.0:
                st["X"] = z.new_empty(n, m, d)
            solve_dtype = torch.promote_types(z.dtype, torch.float32)
            st["H"] = torch.zeros(n, m, m, dtype=solve_dtype, device=z.device)  # Gram matrix of the residuals
        slot = self.count % m
        self.count += 1
        st["F"][:, slot] = fz
        st["G"][:, slot] = gz
        if beta != 1.0:
            st["X"][:, slot] = z
        mm = min(self.count, m)
        H = st["H"]
        if mm == 1:
            H[:, 0, 0] = torch.linalg.vector_norm(gz, dim=1, dtype=H.dtype).square()
            return fz if beta == 1.0 else z + beta * gz
        n = z.shape[0]
        row = torch.bmm(st["G"][:, :mm], gz[:, :, None]).view(n, mm)  # (n, mm): new row of the Gram matrix
        if row.dtype != H.dtype:
            row = row.to(H.dtype)
        H[:, slot, :mm] = row
        H[:, :mm, slot] = row
        Hm = H[:, :mm, :mm]
        ones, eye = self._consts(n, mm, H)
        # min ||sum a_i g_i||^2 + ridge ||a||^2 s.t. sum a_i = 1  =>  a = y / sum(y) with (H + ridge I) y = 1.
        ridge = self.lam * torch.diagonal(Hm, dim1=1, dim2=2).mean(1) + torch.finfo(Hm.dtype).tiny
        A = torch.addcmul(Hm, ridge[:, None, None], eye)  # H + ridge I
        if self.host_reads:
            y, info = torch.linalg.solve_ex(A, ones)
        else:  # LAPACK's solve reads a value back to the host on the CPU; elimination is device ops only
            y, info = _solve_spd(A, ones), None
        y_sum = y.sum(1)
        alpha = y / y_sum[:, None]
        # A singular system (or, at an exact fixed point, a sum of y that overflows): a plain step for that entry.
        # alpha sums to 1 where it is finite, so the product is finite iff both alpha's sum and y's sum are.
        ok = torch.isfinite(alpha.sum(1) * y_sum)
        if info is not None:
            ok = ok & (info == 0)
        alpha = torch.where(ok[:, None], alpha, eye[slot])  # eye[slot]: the plain step's weights
        # (n, 1, mm). Not unsqueeze(1): same strides, and bmm alone times the same, yet 40 steps of a B=32, D=256
        # solve ran 1.25-1.7x slower with it on CPU (torch 2.13, measured; cause not found).
        alpha = (alpha if alpha.dtype == z.dtype else alpha.to(z.dtype))[:, None, :].contiguous()
        # beta * sum a_i f(z_i) + (1 - beta) * sum a_i z_i
        mixed = torch.bmm(alpha, st["F"][:, :mm])[:, 0]
        if beta == 1.0:
            return mixed
        return torch.lerp(torch.bmm(alpha, st["X"][:, :mm])[:, 0], mixed, beta)


def _solve_spd(A: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``y`` with ``A y = b`` for a batch of small symmetric positive definite ``A`` (``(n, m, m)``, ``b`` ``(n, m)``)
    by Gauss-Jordan elimination without pivoting (stable for such matrices), in ``O(m)`` elementwise ops; a singular
    system gives a non-finite ``y``."""
    m = A.shape[1]
    aug = torch.cat([A, b[:, :, None]], 2)  # (n, m, m + 1)
    for j in range(m):
        pivot_row = aug[:, j:j + 1] / aug[:, j:j + 1, j:j + 1]  # row j scaled to a unit pivot
        aug = aug - aug[:, :, j:j + 1] * pivot_row  # column j eliminated from every row (row j becomes zero)
        aug[:, j:j + 1] = pivot_row
    return aug[:, :, m]


@SOLVERS.register("broyden")
class Broyden(_Solver):
    """Limited-memory "good" Broyden method on ``g(z) = f(z) - z``.

    The inverse Jacobian of ``g`` is kept as ``-I + U V^T`` with at most ``memory`` rank-one updates, so memory is
    ``2 * memory`` states rather than torchdeq's ``2 * max_iter``. When the buffer is full the approximation restarts
    from ``-I`` (dropping only the oldest update would leave later updates inconsistent and diverges on hard cases).
    Updates with a vanishing denominator are skipped for that entry.

    Args:
        memory: number of rank-one updates kept (>= 1).
    """

    def __init__(self, memory: int = 20):
        super().__init__()
        check_number(memory, "memory", low=1, integer=True)
        self.memory = memory

    def init(self, z):
        n, d = z.shape
        self.count = 0
        self.state = {
            "U": z.new_zeros(n, d, self.memory),
            "VT": z.new_zeros(n, self.memory, d),
            "x": z.new_zeros(n, d),
            "g": z.new_zeros(n, d),
        }

    def _matvec(self, v):  # (-I + U V^T) v
        st = self.state
        return -v + torch.bmm(st["U"], torch.bmm(st["VT"], v[:, :, None]))[:, :, 0]

    def _rmatvec(self, v):  # v^T (-I + U V^T)
        st = self.state
        return -v + torch.bmm(torch.bmm(v[:, None, :], st["U"]), st["VT"])[:, 0]

    def step(self, z, fz, gz, k):
        st = self.state
        if self.count > 0:
            dx = z - st["x"]
            dg = gz - st["g"]
            vT = self._rmatvec(dx)
            den = (vT * dg).sum(1, keepdim=True)
            ok = den.abs() > torch.finfo(den.dtype).tiny * 1e6
            u = torch.where(ok, (dx - self._matvec(dg)) / torch.where(ok, den, torch.ones_like(den)), 0.0)
            vT = torch.where(ok, vT, 0.0)
            slot = (self.count - 1) % self.memory
            if slot == 0 and self.count > 1:  # buffer full: restart from -I
                st["U"].zero_()
                st["VT"].zero_()
            st["U"][:, :, slot] = u
            st["VT"][:, slot] = vT
        self.count += 1
        st["x"] = z
        st["g"] = gz
        return z - self._matvec(gz)


def solver_kwargs_check(solver: str, kwargs: Optional[dict], argument: str = "solver_kwargs") -> dict:
    """Validate extra keyword arguments of ``solver`` against its signature (errors list the allowed names)."""
    cls = SOLVERS.get(solver)
    kwargs = dict(kwargs or {})
    if not kwargs:
        return kwargs
    check_keywords(kwargs, keyword_options(cls), argument, f"solver {solver!r}")
    try:
        cls(**kwargs)  # range checks
    except ValueError as err:
        raise ValueError(f"{argument} for solver {solver!r}: {err}") from None
    return kwargs


@dataclass(frozen=True)
class SolveOptions:
    """The options of a forward solve: how it iterates, when it stops and what it returns.

    One object shared by ``solve``, ``fixed_point`` (and through it the backward modes), the config translation
    (``fp_settings.solve_options``) and the statistics (``FixedPointStats.options``). ``solve(f, z0, tol=1e-6)`` is
    shorthand for ``solve(f, z0, options=SolveOptions(tol=1e-6))``; keywords given with ``options`` replace its fields.

    Attributes:
        solver: a name in ``SOLVERS`` (``picard``, ``fpopt``, ``picard_adaptive``, ``anderson``, ``broyden``).
        tol: tolerance on the residual (> 0).
        stop_mode: ``rel`` (``||f(z) - z|| / ||f(z)||``) or ``abs`` (``||f(z) - z||``).
        norm: ``l2`` or ``linf``, taken over each entry, or ``token_linf``: the largest relative l-inf residual of
            the entry's rows along the last dim of ``z0`` (FPRM's per-token residual; with ``stop_mode="abs"`` it
            equals ``linf``).
        max_iter: cap on evaluations of ``f`` (>= 1).
        min_iter: no entry is declared converged before this many evaluations.
        batch_dims: number of leading dims of ``z0`` that index entries (convergence granularity).
        stop_fraction: stop the whole solve once at most this fraction of entries is unconverged (FPRM's training
            rule; FPSA's "exit when 80% converged" is 0.2). 0 waits for every entry.
        return_mode: for entries that did not converge, return the image of the iterate with the lowest residual
            (``best``) or of the last iterate (``last``). Converged entries return ``f`` of their converged iterate.
        solver_kwargs: extra arguments of the solver (e.g. ``{"m": 5}`` for Anderson).
        compact: evaluate ``f`` only on unfinished samples (``f`` must be row-separable, see module docstring).
        track_trace: keep the residual of every iteration in ``stats.trace``.
        check_every: how often the host reads the convergence state: every ``k`` iterations (1, the default: every
            iteration, the solve stops at the first iteration where it may); ``0``: never inside the loop, which then
            runs ``max_iter`` evaluations with finished entries frozen on the device by masks (Picard's finished
            samples run on, as with 1; no compaction, no ``nonzero``), and the statistics stay device tensors; one
            read at the end checks for non-finite iterates (in a ``torch.compile`` graph a device-side assert does);
            ``stop_fraction`` and a solver's halting act on the device at the iteration they happen. With ``k > 1``
            the convergence test, ``stop_fraction``, halting and compaction run at the checks only, so an entry runs
            fewer than ``k`` evaluations more than with 1 and converged entries end within the tolerance of the same
            fixed point. ``compact`` does nothing with 0 (it needs the host to pick the rows).
        pass_active: call ``f(z, *args, active=mask)`` with ``mask`` the entries still iterating (a bool tensor shaped
            like the working rows' entries, ``(rows, *z0.shape[1:batch_dims])``; None while every entry is open), so
            that ``f`` can skip the work of converged entries: their values in its output are ignored.
    """

    solver: str = "anderson"
    tol: float = 1e-4
    stop_mode: str = "rel"
    norm: str = "l2"
    max_iter: int = 50
    min_iter: int = 0
    batch_dims: int = 1
    stop_fraction: float = 0.0
    return_mode: str = "best"
    solver_kwargs: Optional[dict] = None
    compact: bool = False
    track_trace: bool = False
    pass_active: bool = False
    check_every: int = 1

    def check(self, prefix: str = "", names: Optional[dict] = None) -> "SolveOptions":
        """Validate every option; returns the options with ``solver_kwargs`` checked against the solver.

        Errors name the argument as ``names.get(field, prefix + field)`` (a config passes ``prefix="fp_"`` and
        ``names={"return_mode": "fp_return"}``) and list the allowed values.
        """
        name = {f.name: (names or {}).get(f.name, prefix + f.name) for f in fields(self)}
        SOLVERS.check(self.solver, name["solver"])
        check_number(self.tol, name["tol"], low=0.0, low_open=True)
        check_choice(self.stop_mode, name["stop_mode"], STOP_MODES)
        check_choice(self.norm, name["norm"], NORMS)
        check_number(self.max_iter, name["max_iter"], low=1, integer=True)
        check_number(self.min_iter, name["min_iter"], low=0, integer=True)
        if self.min_iter > self.max_iter:
            raise ValueError(f"{name['min_iter']}={self.min_iter} must not exceed {name['max_iter']}={self.max_iter}.")
        check_number(self.batch_dims, name["batch_dims"], low=1, integer=True)
        check_number(self.stop_fraction, name["stop_fraction"], low=0.0, high=1.0, high_open=True)
        check_choice(self.return_mode, name["return_mode"], RETURN_MODES)
        check_number(self.check_every, name["check_every"], low=0, integer=True)
        kwargs = solver_kwargs_check(self.solver, self.solver_kwargs, name["solver_kwargs"])
        return self if kwargs == (self.solver_kwargs or {}) else replace(self, solver_kwargs=kwargs)

    def replace(self, **changes) -> "SolveOptions":
        """A copy with ``changes`` applied; an unknown name is a ValueError listing the option names."""
        if not changes:
            return self
        check_keywords(changes, OPTION_NAMES, "solve options", "SolveOptions")
        return replace(self, **changes)


OPTION_NAMES = tuple(f.name for f in fields(SolveOptions))


_CHECKED = {}  # keyword changes -> validated SolveOptions (a solve per layer and token validates the same keywords)


_PLAIN = (int, float, bool, str, type(None))  # option values whose type and value say all (no inner values)


def _options_key(changes: dict) -> Optional[tuple]:
    """``changes`` as a key of ``_CHECKED``: the items with the types of their values (``1``, ``1.0`` and ``True`` are
    equal keys of a dict, but not equally valid options), a dict (``solver_kwargs``) as its sorted items with their
    types; None (not cached) where a value is neither plain nor such a dict of plain values (a tuple or list may hold
    values of other types that compare equal). A call site passes its keywords in one order, so they are not sorted."""
    items = []
    for name, v in changes.items():
        if type(v) is dict:
            if not all(type(x) in _PLAIN and type(k) is str for k, x in v.items()):
                return None
            v = tuple(sorted((k, type(x), x) for k, x in v.items()))
        elif type(v) not in _PLAIN:
            return None
        items.append((name, type(v), v))
    return tuple(items)


def resolve_options(options: Optional[SolveOptions] = None, check: bool = True, **changes) -> SolveOptions:
    """``options`` (default ``SolveOptions()``) with keyword ``changes``, validated when ``check``."""
    if options is not None:
        opts = options.replace(**changes)
        return opts.check() if check else opts
    key = _options_key(changes) if check else None
    cached = None if key is None else _CHECKED.get(key)
    if cached is not None:  # its solver_kwargs dict is the caller's to change (stats.options): a copy of its own
        kwargs = cached.solver_kwargs
        return replace(cached, solver_kwargs=dict(kwargs)) if kwargs else cached
    if key is not None:  # the cached options keep dicts of their own (the caller may change its dict later)
        changes = {name: dict(v) if type(v) is dict else v for name, v in changes.items()}
    try:
        opts = SolveOptions(**changes)
    except TypeError:  # an unknown name: the same ValueError as replace() raises
        check_keywords(changes, OPTION_NAMES, "solve options", "SolveOptions")
        raise
    if not check:
        return opts
    opts = opts.check()
    if key is not None and len(_CHECKED) < 256:
        _CHECKED[key] = opts
    return opts


def _residual(gz, fz, stop_mode, norm, row_size=1, row_mask=None, acc=None, eps=1e-9):
    """Per-entry residual of ``gz = f(z) - z`` (shape ``(entries, d)``). ``token_linf`` views each entry as rows of
    ``row_size`` (the tokens of a ``(..., T, D)`` state) and takes the largest per-row relative l-infinity residual:
    FPRM's ``max_t ||g_t||_inf / ||f_t||_inf``, where a token that changes a lot relative to its own size counts
    even if other tokens are larger (``linf`` divides by the largest entry of the whole state instead).
    ``row_mask`` (``(entries, rows)``, bool; ``token_linf`` only): the rows that count (e.g. not padding); an entry
    with no counted row has residual 0. ``acc``: the accumulation dtype (default: ``gz``'s, at least float32).
    ``eps``: the guard added to the denominator (a 0-dim tensor of dtype ``acc`` is a cheaper operand than a float)."""
    # At least float32: in float16 the squares of small entries underflow and 1e-9 rounds to 0, so a tiny row's
    # relative residual would be 0 / 0 = NaN (and be reported as a non-finite iterate).
    acc = torch.promote_types(gz.dtype, torch.float32) if acc is None else acc
    if norm == "token_linf" and stop_mode == "rel":
        rows = (gz.shape[0], -1, row_size)
        per_row = gz.reshape(rows).abs().amax(-1).to(acc) / (fz.reshape(rows).abs().amax(-1).to(acc) + eps)
        if row_mask is not None:
            per_row = per_row.masked_fill(~row_mask.reshape(per_row.shape), 0.0)
        return per_row.amax(-1)
    if norm == "l2":
        if gz.dtype == acc:  # the dtype argument costs a dispatch of its own
            r = torch.linalg.vector_norm(gz, dim=1)
            return r / (torch.linalg.vector_norm(fz, dim=1) + eps) if stop_mode == "rel" else r
        r = torch.linalg.vector_norm(gz, dim=1, dtype=acc)
        return r / (torch.linalg.vector_norm(fz, dim=1, dtype=acc) + eps) if stop_mode == "rel" else r
    r = gz.abs().amax(1).to(acc)
    return r / (fz.abs().amax(1).to(acc) + eps) if stop_mode == "rel" else r


_CONSTANTS = {}


def _constants(dtype: torch.dtype, device: torch.device) -> tuple:
    """``(1e-9, inf, 0, -1)`` as 0-dim tensors of ``dtype`` on ``device``, made once per dtype and device (a solve
    on a small problem pays for every op, and creating them is four)."""
    key = (dtype, device)
    consts = _CONSTANTS.get(key)
    if consts is None:
        consts = tuple(torch.full((), v, dtype=dtype, device=device) for v in (1e-9, math.inf, 0.0, -1.0))
        if type(consts[0]) is torch.Tensor:  # not a tensor subclass of a tracing mode (fake, functional)
            _CONSTANTS[key] = consts
    return consts


def solve(f: Callable, z0: torch.Tensor, *, args: Sequence = (), options: Optional[SolveOptions] = None,
          row_mask: Optional[torch.Tensor] = None, residual_fn: Optional[Callable] = None, check: bool = True,
          **option_changes):
    """Solve ``z = f(z, *args)`` from ``z0`` without autograd; returns ``(z_star, FixedPointStats)``.

    Args:
        f: the map; called as ``f(z, *args)`` with ``z`` shaped like ``z0`` (fewer rows when ``compact``). Samples
            must not interact through it (row ``i`` of its output depends only on row ``i`` of ``z`` and of the
            batch-sized ``args``, as in any batched model) when ``compact`` is on, and with ``picard`` on whole
            samples (``batch_dims=1``), whose finished samples run on; a map with batch statistics gets results
            that depend on the batch-mates there.
        z0: initial iterate; its first ``batch_dims`` dims index independent entries.
        args: extra inputs of ``f``; with ``compact`` their batch-sized tensors are sliced with ``z``.
        options: a ``SolveOptions`` (default: ``SolveOptions()``).
        row_mask: with ``norm="token_linf"``, a bool tensor shaped ``z0.shape[:-1]``: the rows (tokens) whose
            residual counts; padding positions are left out this way (None: every row).
        residual_fn: a residual of the caller's own instead of ``tol``/``stop_mode``/``norm``'s:
            ``residual_fn(fz, z, *args) -> (rows, *entries)`` with ``fz = f(z)`` and ``z`` shaped like the working
            rows of ``z0`` and ``args`` sliced with them (e.g. FPSA's relative change of the state its queries and
            keys are computed from, per token); an entry converges once it is below ``tol``. With ``pass_active`` it
            also gets ``active=`` (as ``f`` does); the residuals of finished entries are ignored.
        check: validate the options (callers that validated them once, such as configs, pass False).
        **option_changes: fields of ``SolveOptions`` (``solver``, ``tol``, ``stop_mode``, ``norm``, ``max_iter``,
            ``min_iter``, ``batch_dims``, ``stop_fraction``, ``return_mode``, ``solver_kwargs``, ``compact``,
            ``track_trace``, ``pass_active``, ``check_every``) that replace those of ``options``.

    Raises:
        NonFiniteError: an iterate contains NaN or Inf (the message names the iteration and the samples).

    Example:
        >>> W = torch.randn(8, 8) * 0.1; x = torch.randn(4, 8)
        >>> z, stats = solve(lambda z: torch.tanh(z @ W.T + x), torch.zeros(4, 8), solver="picard", tol=1e-6)
    """
    opts = resolve_options(options, check, **option_changes)
    if z0.dim() < opts.batch_dims:
        raise ValueError(f"batch_dims={opts.batch_dims} needs z0 with at least that many dims, got {tuple(z0.shape)}.")
    if math.prod(z0.shape[:opts.batch_dims]) == 0 or z0.numel() == 0:
        entry_shape = z0.shape[:opts.batch_dims]
        empty = torch.zeros(entry_shape, dtype=torch.long, device=z0.device)
        residual = z0.new_zeros(entry_shape, dtype=torch.promote_types(z0.dtype, torch.float32))
        return z0.detach().clone(), FixedPointStats(empty, residual, empty.bool(), 0, opts.solver, opts.tol,
                                                     opts.stop_mode, options=opts)
    loop = _SolveLoop if opts.check_every else _MaskedSolveLoop
    if not torch.is_grad_enabled():  # (fixed_point's callers and inference mostly): no context to enter
        return loop(f, z0, tuple(args), opts, row_mask, residual_fn).run()
    with torch.no_grad():
        return loop(f, z0, tuple(args), opts, row_mask, residual_fn).run()


class _SolveLoop:
    """The state of one ``solve``; ``run`` is the loop, the other methods its steps.

    Working rows are every entry, or fewer once ``compact`` drops finished samples (``gidx`` maps them to entries;
    ``results`` lists the dropped rows' results, one ``(entries, out, out_res, nstep, conv)`` per drop, put in entry
    order once at the end). ``done`` marks working rows that converged or were halted (None
    while all are open): their results sit in ``out`` / ``out_res`` / ``nstep`` / ``conv`` and their state is frozen
    at ``out``.
    """

    def __init__(self, f, z0, args, opts: SolveOptions, row_mask, residual_fn=None):
        self.f, self.opts, self.args, self.residual_fn = f, opts, args, residual_fn
        self.shape = shape = z0.shape
        self.B = shape[0]
        self.G = math.prod(shape[:opts.batch_dims])
        self.gps = self.G // self.B  # entries per sample
        self.d = z0.numel() // self.G
        self.row_size = shape[-1] if len(shape) > opts.batch_dims else 1  # token_linf: the rows of an entry
        self.rmask = None
        if row_mask is not None:
            if opts.norm != "token_linf" or tuple(row_mask.shape) != tuple(shape[:-1]):
                raise ValueError(f"row_mask must be a bool tensor of shape {tuple(shape[:-1])} (z0 without its last "
                                 f"dim) and needs norm='token_linf'; got shape {tuple(row_mask.shape)} with "
                                 f"norm={opts.norm!r}.")
            self.rmask = row_mask.reshape(self.G, -1).bool()
        self.algo = SOLVERS.get(opts.solver)(**(opts.solver_kwargs or {}))
        self.algo.host_reads = opts.check_every == 1
        # Plain Picard needs no residual between checks (its step is f(z)); the other solvers use g = f(z) - z.
        self.needs_gz = not (type(self.algo) is Picard and self.algo.damping == 1.0)
        self.observe = getattr(self.algo, "observe", None)
        self.halts = type(self.algo).halted is not _Solver.halted  # a solver that can give up on entries
        self.flat = tuple(shape) == (self.G, self.d)  # f takes the (rows, d) working state as it is
        self.z = z0.detach() if self.flat else z0.detach().reshape(self.G, self.d)
        self.acc = torch.promote_types(z0.dtype, torch.float32)
        # _residual's guard and the loop's other constants, as 0-dim tensor operands (cheaper than Python scalars)
        self.eps, self.inf_t, self.zero_t, self.minus_one = _constants(self.acc, z0.device)
        self.tol_t = None  # opts.tol as such an operand, made at the first step where a row may finish
        self.done = self.conv = self.out = self.out_res = self.nstep = None
        self.frozen = None  # done[:, None], kept while done does not change
        # Freeze finished rows at their result (see the module docstring): not for Picard on whole samples, whose
        # later iterates feed only their own rows, when f computes every row anyway.
        self.freeze = type(self.algo) is not Picard or opts.pass_active or self.gps != 1
        self.best = self.best_res = None
        # eager_best: set once some row's residual went up (then the best iterate is updated every step)
        self.eager_best = False
        self.gidx = self.results = None
        self.n_done_w = 0  # done working rows, counted by _settle (what _compact of single-entry samples drops)
        self.all_done = False  # set by _settle when every entry is done
        self.wshape, self.wargs, self.Bw = shape, args, self.B
        self.trace = [] if opts.track_trace else None
        # The common case (the l2 residual in f's dtype, nothing per call or per step besides f): _evaluate takes a
        # path with the fewest ops and Python lookups, a fixed cost that counts on small problems.
        self.plain = (residual_fn is None and not opts.pass_active and self.trace is None and self.observe is None
                      and opts.norm == "l2" and z0.dtype == self.acc)
        self.inf_done = None  # +inf at the done rows, 0 elsewhere (None while none is done)
        self.algo.init(self.z)

    def run(self):
        opts, algo = self.opts, self.algo
        tol, min_iter, max_iter, every = opts.tol, opts.min_iter, opts.max_iter, opts.check_every
        evaluate, reduce = self._evaluate, self._reduce  # bound once: a small problem pays for every lookup
        k = 0
        for k in range(1, max_iter + 1):
            if every > 1 and k % every and k < max_iter:  # between checks: f and the update only
                self._step_unchecked(k)
                continue
            fz, gz, res = evaluate()
            lo, halted, key = reduce(res, fz)
            if lo != lo:  # NaN propagates through the reduction
                lo = self._nonfinite(res, key, k)
            event = (lo < tol and k >= min_iter) or halted is not None
            if event and self._settle(k, res, key, fz, halted):
                break
            if k == max_iter:
                break
            self.z = algo.step(self.z, fz, gz, k)
            if event and opts.compact:  # before the freeze: the rows it drops need none
                self._compact()
            self._freeze()
        return self._result(k, fz, res)

    def _freeze(self):
        """Hold the done rows at their results (see the module docstring for when they are not held)."""
        if self.done is not None and self.freeze:
            if self.frozen is None:
                self.frozen = self.done[:, None]
            self.z = torch.where(self.frozen, self.out, self.z)

    def _active(self):
        """``f``'s ``active=`` with ``pass_active``: the open entries, None while every entry is open."""
        return None if self.done is None else (~self.done).view(self.wshape[:self.opts.batch_dims])

    def _closed(self):
        """The working rows that converged or were halted; None while every row is open."""
        return self.done

    def _call_f(self):
        """``f`` of the working rows, ``(rows, d)``."""
        z, wshape = self.z, self.wshape
        if self.opts.pass_active:
            fz = self.f(z if self.flat else z.view(wshape), *self.wargs, active=self._active())
        else:
            fz = self.f(z if self.flat else z.view(wshape), *self.wargs)
        if fz.shape != wshape:
            self._raise_shape(fz)
        return fz if self.flat else fz.reshape(z.shape)

    def _evaluate(self):
        """One evaluation of ``f`` on the working rows: ``(f(z), f(z) - z, residual)``, all ``(rows, ...)``."""
        z, wshape = self.z, self.wshape
        fz = self._call_f()
        gz = fz - z
        if self.plain:
            return fz, gz, self._plain_residual(gz, fz)
        if self.residual_fn is None:
            res = _residual(gz, fz, self.opts.stop_mode, self.opts.norm, self.row_size, self.rmask, self.acc, self.eps)
        else:
            extra = {"active": self._active()} if self.opts.pass_active else {}
            res = self.residual_fn(fz.view(wshape), z.view(wshape), *self.wargs, **extra).reshape(-1)
        if self.observe is not None:
            self.observe(res)
        if self.trace is not None:
            row = z.new_full((self.G,), math.nan, dtype=res.dtype)
            closed = self._closed()
            row[slice(None) if self.gidx is None else self.gidx] = (
                res if closed is None else res.masked_fill(closed, math.nan))
            self.trace.append(row)
        return fz, gz, res

    def _step_unchecked(self, k):
        """A step between two checks (``check_every > 1``): no host read, and no residual unless the solver
        records residuals (``fpopt``) or the trace keeps them."""
        z = self.z
        if self.observe is not None or self.trace is not None:
            fz, gz, _ = self._evaluate()
        elif self.needs_gz:
            fz = self._call_f()
            gz = fz - z
        else:  # plain Picard: the step is f(z)
            self.z = self._call_f()
            self._freeze()
            return
        self.z = self.algo.step(z, fz, gz, k)
        self._freeze()

    def _plain_residual(self, gz, fz):
        """The l2 residual with the done rows already at +inf: one op (``addcdiv``) instead of a division here and
        an addition in ``_reduce``, which the general path pays."""
        r, inf_done = torch.linalg.vector_norm(gz, dim=1), self.inf_done
        if self.opts.stop_mode == "abs":
            return r if inf_done is None else r + inf_done
        den = torch.linalg.vector_norm(fz, dim=1).add_(self.eps)  # in place: both norms are new tensors
        return r.div_(den) if inf_done is None else torch.addcdiv(inf_done, r, den)

    def _raise_shape(self, fz):
        raise ValueError(f"f returned shape {tuple(fz.shape)} for an input of shape {tuple(self.wshape)}; "
                         "a fixed-point map must preserve the shape of its input.")

    def _reduce(self, res, fz):
        """The one host sync of an iteration: the smallest residual among open rows (NaN propagates, so it is also
        the NaN check), and the rows the solver halted (None when none). Also tracks the best iterate: while every
        row's residual goes down, the newest image is the best one and a row that got worse shows up as -1 in the
        same reduction; after the first such step the best iterate is updated every step instead. Done rows keep a
        best residual of +inf (``key``), so their frozen residuals never count as worse."""
        # +inf at the done rows by an addition, so a non-finite image of a finished row still shows as NaN
        key = res if self.inf_done is None or self.plain else res + self.inf_done
        red, lazy = key, False
        if self.opts.return_mode == "best":
            if self.best is None:
                self.best, self.best_res = fz, key
            elif self.eager_best:
                self._update_best(key <= self.best_res, fz, key)
            else:
                better = key <= self.best_res  # done rows: +inf on both sides, so "better"
                red, lazy = torch.where(better, key, self.minus_one), True
        halted = self.algo.halted() if self.halts else None
        if halted is None:
            lo, halt_any = red.min().item(), 0.0  # min(): a full reduction, cheaper than amin()
        else:
            lo, halt_any = torch.stack([red.amin(), halted.any().to(red.dtype)]).tolist()
        if lazy:
            if lo != -1.0:
                self.best, self.best_res = fz, key
            else:
                self.eager_best = True
                self._update_best(better, fz, key)
                lo = key.amin().item()
        return lo, (halted if halt_any > 0 else None), key

    def _update_best(self, better, fz, res):
        self.best = torch.where(better[:, None], fz, self.best)
        self.best_res = torch.where(better, res, self.best_res)

    def _nonfinite(self, res, key, k) -> float:
        """A NaN or Inf in this step's residuals. Finished samples that run on (no freeze, see the module docstring)
        may leave the region where they converged: they are held at their results from now on, as other solves
        hold every finished entry, and the smallest residual of the open rows is returned. Anything else raises."""
        if not self.freeze and self.done is not None and not bool((~torch.isfinite(res) & ~self.done).any()):
            self.freeze = True  # (their best residuals are +inf since they finished: not compared any more)
            return key.masked_fill(self.done, math.inf).min().item()
        self._raise_nonfinite(res, k)

    def _raise_nonfinite(self, res, k):
        bad = ~torch.isfinite(res)
        if self.done is not None and bool((bad & ~self.done).any()):
            bad = bad & ~self.done  # the open rows; else a finished row's frozen state has a non-finite image
        bad_rows = bad.nonzero()[:, 0]
        ent = bad_rows if self.gidx is None else self.gidx[bad_rows]
        bad = sorted({int(i) for i in (ent // self.gps).tolist()})
        raise NonFiniteError(
            f"fixed-point solve ({self.opts.solver}) produced NaN/Inf at iteration {k} for samples {bad[:20]}"
            f"{' ...' if len(bad) > 20 else ''} (of {self.B}). Lower the learning rate, add damping or a stability "
            f"regularizer, or check the inputs."
        )

    def _settle(self, k, res, key, fz, halted) -> bool:
        """Freeze the rows that converged (or were halted) at step ``k``; True when the solve should stop.

        ``key`` is ``res`` with done rows at +inf, so ``key < tol`` are the open rows that converged now. ``conv``
        stays None (meaning: equal to ``done``) until the solver halts a row."""
        opts = self.opts
        if self.tol_t is None:
            self.tol_t = torch.full((), opts.tol, dtype=key.dtype, device=key.device)
        newly = key < self.tol_t if k >= opts.min_iter else torch.zeros_like(key, dtype=torch.bool)
        if self.done is None:
            self.done, self.out, self.out_res = newly, fz, res
            # k for every row: open rows get theirs when they finish or at the end (cheaper than a where)
            self.nstep = torch.full_like(res, k, dtype=torch.long)
        else:
            self.out = torch.where(newly[:, None], fz, self.out)
            self.out_res = torch.where(newly, res, self.out_res)
            self.nstep = self.nstep.masked_fill(newly, k)
            self.done = self.done | newly
            if self.conv is not None:
                self.conv = self.conv | newly
        if halted is not None:
            newly_halted = halted & ~self.done
            src, src_res = (self.best, self.best_res) if opts.return_mode == "best" else (fz, res)
            self.out = torch.where(newly_halted[:, None], src, self.out)
            self.out_res = torch.where(newly_halted, src_res, self.out_res)
            self.nstep = self.nstep.masked_fill(newly_halted, k)
            self.conv = self.done if self.conv is None else self.conv
            self.done = self.done | newly_halted
        self.frozen = None
        n_done = self.n_done_w = int(torch.count_nonzero(self.done))
        if self.gidx is not None:
            n_done += self.G - self.gidx.numel()
        self.all_done = n_done == self.G
        stop = self.G - n_done <= opts.stop_fraction * self.G  # the fraction counts every entry, finished or not
        if not stop and k < opts.max_iter:
            self.inf_done = torch.where(self.done, self.inf_t, self.zero_t)
            if self.best_res is not None:
                # A frozen row's later residuals must not count as "got worse" (that would switch to eager tracking).
                self.best_res = self.best_res.masked_fill(self.done, math.inf)
        return stop

    def _converged(self):
        return self.done if self.conv is None else self.conv

    def _compact(self):
        """Drop the samples whose entries are all done from the working set, once they are at least a quarter of it:
        a drop costs a few small ops per buffer, about one evaluation of f on a small problem, so dropping one
        sample at a time as the slow ones finish costs more than it saves (bench_solvers section 3). With one entry
        per sample the count comes from ``_settle`` (no host sync here unless rows are dropped) and one stable sort
        splits the rows; the dropped rows' results are kept as they are and put in entry order once, in
        ``_result``."""
        gps, done, Bw = self.gps, self.done, self.Bw
        if gps == 1:  # working rows are samples: _settle counted the done ones
            n_gone = self.n_done_w
            if 4 * n_gone < Bw or n_gone == 0:
                return
            order = torch.argsort(done.to(torch.uint8), stable=True)  # open rows first, both groups in order
            keep_s = rows = order[:Bw - n_gone]
            gone = order[Bw - n_gone:]
        else:
            keep = (~done).view(Bw, gps).any(1)
            n_gone = Bw - int(keep.sum())
            if 4 * n_gone < Bw or n_gone == 0:
                return
            keep_s = keep.nonzero()[:, 0]
            rows = (keep_s[:, None] * gps + torch.arange(gps, device=done.device)).reshape(-1)
            gone = torch.ones_like(done)
            gone[rows] = False
            gone = gone.nonzero()[:, 0]
        if self.gidx is None:
            self.gidx, self.results = torch.arange(self.G, device=done.device), []
        self.results.append(tuple(t.index_select(0, gone) for t in (
            self.gidx, self.out, self.out_res, self.nstep, self._converged())))
        self.z, self.gidx = self.z.index_select(0, rows), self.gidx.index_select(0, rows)
        if gps == 1:  # every kept row is open: the working set starts afresh
            self.done = self.conv = self.out = self.out_res = self.nstep = self.inf_done = None
            self.n_done_w = 0
        else:
            self.done, self.out, self.out_res, self.nstep = (
                t.index_select(0, rows) for t in (self.done, self.out, self.out_res, self.nstep))
            self.conv = None if self.conv is None else self.conv.index_select(0, rows)
            self.inf_done = None if self.inf_done is None else self.inf_done.index_select(0, rows)
            self.frozen = None
        if self.best is not None:
            self.best, self.best_res = self.best.index_select(0, rows), self.best_res.index_select(0, rows)
        self.algo.select(rows)
        self.rmask = None if self.rmask is None else self.rmask.index_select(0, rows)
        self.wargs = tuple(a.index_select(0, keep_s) if torch.is_tensor(a) and a.dim() > 0 and a.shape[0] == Bw
                           else a for a in self.wargs)
        self.Bw = keep_s.numel()
        self.wshape = (self.Bw,) + tuple(self.shape[1:])

    def _result(self, k, fz, res):
        """Rows still open when the loop ended did not converge: they return the best (or last) iterate's image."""
        opts = self.opts
        src, src_res = (self.best, self.best_res) if opts.return_mode == "best" else (fz, res)
        out, out_res, nstep, done = self.out, self.out_res, self.nstep, self.done
        conv = None if done is None else self._converged()
        if done is None:
            out, out_res = src, src_res
            nstep = torch.full_like(res, k, dtype=torch.long)  # (the *_like factories cost less here)
            conv = torch.zeros_like(res, dtype=torch.bool)
        elif not self.all_done:
            out = torch.where(done[:, None], out, src)
            out_res = torch.where(done, out_res, src_res)
            nstep = torch.where(done, nstep, k)
        if self.gidx is not None:  # the dropped rows' results and the working rows', in entry order
            parts = self.results + [(self.gidx, out, out_res, nstep, conv)]
            order = torch.argsort(torch.cat([p[0] for p in parts]))
            out, out_res, nstep, conv = (torch.cat([p[i] for p in parts]).index_select(0, order) for i in range(1, 5))
        return self._stats(k, out, out_res, nstep, conv)

    def _stats(self, k, out, out_res, nstep, conv):
        """``(z_star, stats)`` from the per-entry results (``(entries, ...)``)."""
        opts = self.opts
        entry_shape = self.shape[:opts.batch_dims]
        if opts.batch_dims > 1:  # a view costs about as much as a small op: only where the shape changes
            nstep, out_res, conv = (t.view(entry_shape) for t in (nstep, out_res, conv))
        stats = FixedPointStats(
            nstep=nstep,
            residual=out_res,
            converged=conv,
            nfe=k,
            solver=opts.solver,
            tol=opts.tol,
            stop_mode=opts.stop_mode,
            trace=torch.stack(self.trace).view(-1, *entry_shape) if self.trace else None,
            options=opts,
        )
        return (out if self.flat else out.view(self.shape)), stats


class _MaskedSolveLoop(_SolveLoop):
    """The loop of ``check_every=0``: no host read until the loop has run ``max_iter`` evaluations.

    After every evaluation the convergence state is settled on the device by masks: entries below the tolerance (or
    halted by the solver, or stopped by ``stop_fraction``) are closed and frozen (as in the default loop, Picard's
    finished samples run on instead), and the largest residual each open entry had is kept, so a NaN or Inf shows in
    the one read after the loop. ``out`` holds one image per entry: its result once it is closed, the best (lowest
    residual) image so far while it is open (``return_mode="best"``), so one ``where`` per step keeps both.
    """

    def __init__(self, *args):
        super().__init__(*args)
        self.open = None  # the entries still iterating (None until the first evaluation: all of them)
        self.worst = None  # per entry, the largest residual while open (NaN / Inf propagate)
        # Entries that can close without converging (a halting solver, stop_fraction) need conv of their own;
        # otherwise the converged entries are the closed ones.
        self.stops = self.halts or self.opts.stop_fraction > 0

    def run(self):
        max_iter, algo, evaluate, settle = self.opts.max_iter, self.algo, self._evaluate, self._settle_masked
        k = 0
        for k in range(1, max_iter + 1):
            fz, gz, res = evaluate()
            settle(k, fz, res)
            if k == max_iter:
                break
            z = algo.step(self.z, fz, gz, k)
            self.z = torch.where(self.open[:, None], z, self.out) if self.freeze else z
        self._check(k)
        return self._result(k, fz, res)

    def _active(self):
        return None if self.open is None else self.open.view(self.wshape[:self.opts.batch_dims])

    def _closed(self):
        return None if self.open is None else ~self.open

    def _settle_masked(self, k, fz, res):
        """Device ops only: update ``out`` with the image of step ``k``, close the entries that finish at it."""
        opts, open_ = self.opts, self.open
        if self.tol_t is None:
            self.tol_t = torch.full((), opts.tol, dtype=res.dtype, device=res.device)
        if open_ is None:  # the first evaluation: every entry open, its image the best so far
            newly = res < self.tol_t if k >= opts.min_iter else None
            self.out, self.out_res, self.worst = fz, res, res
            self.nstep = torch.ones_like(res, dtype=torch.long)
            open_ = torch.ones_like(res, dtype=torch.bool) if newly is None else ~newly
        else:
            self.nstep = self.nstep + open_  # an entry's count grows while it is open
            self.worst = torch.maximum(self.worst, torch.where(open_, res, self.zero_t))
            # The closed entries at +inf, so that neither comparison holds for them. (One whose result has an
            # infinite residual would take the new image: it had that residual while open, and the solve raises.)
            key = torch.where(open_, res, self.inf_t)
            newly = key < self.tol_t if k >= opts.min_iter else None
            if opts.return_mode == "best":  # a better image, or the converged one (with min_iter, maybe not better)
                update = key <= self.out_res
                update = update if newly is None else update | newly
            else:
                update = newly
            if update is not None:
                self.out = torch.where(update[:, None], fz, self.out)
                self.out_res = torch.where(update, res, self.out_res)
            if newly is not None:
                open_ = open_ ^ newly
        if self.stops:
            self.conv = newly if self.conv is None else (self.conv if newly is None else self.conv | newly)
            open_ = self._stop(fz, res, open_)
        self.open = open_

    def _stop(self, fz, res, open_):
        """Close the entries the solver halted, or every open entry once ``stop_fraction`` is reached; they return the
        best (or last) image."""
        stop = self.algo.halted() if self.halts else None
        if self.opts.stop_fraction > 0:
            few = open_.sum() <= self.opts.stop_fraction * self.G
            stop = few if stop is None else stop | few
        stopped = stop & open_
        if self.opts.return_mode == "last":
            self.out = torch.where(stopped[:, None], fz, self.out)
            self.out_res = torch.where(stopped, res, self.out_res)
        return open_ ^ stopped

    def _check(self, k):
        """The one host read, after the loop: a non-finite residual of an open entry raises. Inside a
        ``torch.compile`` graph a device-side assert replaces the read; inside a forward wrapped by
        ``defer_finite_checks`` the test waits for the forward's end, where all its solves are read at once."""
        finite = self.worst.amax() < self.inf_t  # False for NaN and Inf
        if torch.compiler.is_compiling():
            torch._assert_async(finite, "fixed-point solve produced NaN/Inf (NonFiniteError; check_every=0)")
            return
        # what the error needs, not the loop (whose iterates and solver history a deferred test would keep alive)
        fail = functools.partial(_raise_nonfinite, self.opts.solver, self.worst, self.inf_t, self.gps, self.B, k)
        if getattr(_DEFERRED, "checks", None) is not None:
            _DEFERRED.checks.append((finite, fail))
        elif not finite.item():
            fail()

    def _result(self, k, fz, res):
        out, out_res, open_ = self.out, self.out_res, self.open
        if self.opts.return_mode == "last":  # the open entries return the last image ("best": out holds the best)
            out = torch.where(open_[:, None], fz, out)
            out_res = torch.where(open_, res, out_res)
        return self._stats(k, out, out_res, self.nstep, self.conv if self.stops else ~open_)


def _raise_nonfinite(solver: str, worst: torch.Tensor, inf_t: torch.Tensor, gps: int, B: int, k: int):
    """``NonFiniteError`` naming the samples whose entries had a non-finite residual (``worst``) while open."""
    bad = sorted({int(i) for i in ((~(worst < inf_t)).nonzero()[:, 0] // gps).tolist()})
    raise NonFiniteError(
        f"fixed-point solve ({solver}) produced NaN/Inf by iteration {k} (check_every=0: checked after the loop) for "
        f"samples {bad[:20]}{' ...' if len(bad) > 20 else ''} (of {B}). Lower the learning rate, add damping or a "
        f"stability regularizer, or check the inputs."
    )


# The NaN/Inf tests of check_every=0 solves waiting for the end of a forward (see ``defer_finite_checks``).
_DEFERRED = threading.local()


def defer_finite_checks(forward: Callable) -> Callable:
    """Decorate a model's ``forward`` so that the ``check_every=0`` solves inside it (one per layer, say) are tested
    for NaN / Inf by one host read when it returns, instead of one read each: the first non-finite solve raises
    ``NonFiniteError`` then, as it would have alone. Nested decorated forwards join the outermost one; inside a
    ``torch.compile`` graph each solve keeps its device-side assert. Solves with ``check_every >= 1`` read at
    their checks as before."""

    @functools.wraps(forward)
    def wrapper(*args, **kwargs):
        if torch.compiler.is_compiling() or getattr(_DEFERRED, "checks", None) is not None:
            return forward(*args, **kwargs)
        _DEFERRED.checks = []
        try:
            out = forward(*args, **kwargs)
            checks = _DEFERRED.checks
        finally:
            _DEFERRED.checks = None
        if checks and not torch.stack([finite for finite, _ in checks]).all().item():
            for finite, fail in checks:
                if not finite.item():
                    fail()
        return out

    return wrapper


__all__ = ["NORMS", "OPTION_NAMES", "RETURN_MODES", "SOLVERS", "STOP_MODES", "SolveOptions", "defer_finite_checks",
           "resolve_options", "solve", "solver_kwargs_check"]
