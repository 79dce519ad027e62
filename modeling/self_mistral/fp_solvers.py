# Source of truth: hf_fixedpoint/core/fp_solvers.py. Verbatim copies live in modeling/*/ so that checkpoints
# saved with save_pretrained() load with torch + transformers only. Edit here, then run
# `python -m hf_fixedpoint.vendor`. Allowed imports: stdlib, torch, and `from .fp_<x> import ...`.
"""Forward fixed-point solvers: ``picard``, ``fpopt``, ``picard_adaptive``, ``anderson`` and ``broyden``, and the loop
they share.

``solve(f, z0, ...)`` finds ``z* = f(z*)`` without building an autograd graph. Convergence is judged per *entry*:
the first ``batch_dims`` dimensions of ``z`` index independent entries (samples by default; ``batch_dims=2`` on a
``(B, T, D)`` state means per token, ``batch_dims=3`` on ``(B, H, T, d)`` means per head and token). An entry that
meets the tolerance is frozen at its converged value while the others go on (selective update), so an entry's result
does not depend on how long its batch-mates take. With ``compact=True`` the solver also drops finished *samples* from
the working set, so ``f`` and the solver's own algebra run only on unfinished rows; this requires ``f`` to act on each
sample independently (row ``i`` of its output depends only on row ``i`` of ``z`` and of the batch-sized tensors in
``args``).

Each solver is a small class registered in ``SOLVERS``: ``step(z, fz, gz, k)`` returns the next iterate from the
current one, its image ``fz = f(z)`` and the residual ``gz = fz - z``; the per-entry state it keeps is a dict of
tensors whose first dimension indexes entries, so the loop can drop finished rows from it.
"""

import math
from typing import Callable, Optional, Sequence

import torch

from .fp_registry import Registry, check_choice, check_keywords, check_number, keyword_options
from .fp_stats import FixedPointStats, NonFiniteError

SOLVERS = Registry("solver")
STOP_MODES = ("rel", "abs")
NORMS = ("l2", "linf", "token_linf")
RETURN_MODES = ("best", "last")


class _Solver:
    """Base class: the per-entry state is ``self.state`` (tensors with a leading entry dimension)."""

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
    """

    def __init__(self, step_size: float = 1.0, patience: int = 5, decay: float = 0.9, min_step: float = 1e-3,
                 threshold: float = 0.0):
        super().__init__()
        check_number(step_size, "step_size", low=0.0, high=1.0, low_open=True)
        check_number(patience, "patience", low=1, integer=True)
        check_number(decay, "decay", low=0.0, high=1.0, low_open=True, high_open=True)
        check_number(min_step, "min_step", low=0.0)
        check_number(threshold, "threshold", low=0.0)
        self.step_size, self.patience, self.decay, self.min_step = float(step_size), patience, float(decay), min_step
        self.threshold = float(threshold)
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
            improved = res < st["best"]
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
    """Picard iteration, damped per entry where it oscillates.

    An entry whose residual ``f(z) - z`` points against its previous one (negative cosine: the iterate overshoots and
    comes back, as with a Jacobian eigenvalue near -1) takes the damped step ``z + damping (f(z) - z)``; every other
    entry takes the plain step ``f(z)``. A contracting map with aligned steps is iterated exactly as ``picard`` does.

    Args:
        damping: step size in (0, 1) for oscillating entries.
    """

    def __init__(self, damping: float = 0.5):
        super().__init__()
        check_number(damping, "damping", low=0.0, high=1.0, low_open=True, high_open=True)
        self.damping = float(damping)

    def init(self, z):
        self.state = {"prev": torch.zeros_like(z)}

    def step(self, z, fz, gz, k):
        prev = self.state["prev"]
        flips = (gz * prev).sum(-1) < 0  # cos < 0; the zero initial state counts as aligned
        self.state["prev"] = gz
        if not bool(flips.any()):
            return fz
        return torch.where(flips[:, None], z + self.damping * gz, fz)


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
        n, d = z.shape
        solve_dtype = torch.promote_types(z.dtype, torch.float32)
        self.count = 0
        self.state = {
            "X": z.new_zeros(n, self.m, d),
            "G": z.new_zeros(n, self.m, d),
            "H": torch.zeros(n, self.m, self.m, dtype=solve_dtype, device=z.device),  # Gram matrix of residuals
        }

    def step(self, z, fz, gz, k):
        st, m = self.state, self.m
        slot = self.count % m
        self.count += 1
        st["X"][:, slot] = z
        st["G"][:, slot] = gz
        mm = min(self.count, m)
        if mm == 1:
            return z + self.beta * gz
        G = st["G"][:, :mm]
        H = st["H"]
        row = torch.linalg.vecdot(G, gz[:, None, :]).to(H.dtype)  # (n, mm): new row of the Gram matrix
        H[:, slot, :mm] = row
        H[:, :mm, slot] = row
        Hm = H[:, :mm, :mm]
        # min ||sum a_i g_i||^2 + ridge ||a||^2 s.t. sum a_i = 1  =>  a = y / sum(y) with (H + ridge I) y = 1.
        diag = torch.diagonal(Hm, dim1=1, dim2=2)
        ridge = self.lam * diag.mean(1, keepdim=True) + torch.finfo(Hm.dtype).tiny
        y, info = torch.linalg.solve_ex(Hm + torch.diag_embed(ridge.expand_as(diag)), torch.ones_like(row))
        alpha = y / y.sum(1, keepdim=True)
        ok = (info == 0) & torch.isfinite(alpha.sum(1))  # singular system: a plain step for that entry
        last = (torch.arange(mm, device=z.device) == slot).to(alpha.dtype)
        alpha = torch.where(ok[:, None], alpha, last).to(z.dtype)[:, None, :].contiguous()  # (n, 1, mm)
        # beta * sum a_i f(z_i) + (1 - beta) * sum a_i z_i, with f(z_i) = z_i + g_i
        return torch.bmm(alpha, st["X"][:, :mm] + self.beta * G)[:, 0]


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


def check_solve_args(*, solver, tol, stop_mode, norm, max_iter, min_iter, batch_dims, stop_fraction, return_mode,
                     prefix=""):
    """Validate the arguments shared by ``solve`` and the model configs; errors name ``prefix + argument``."""
    SOLVERS.check(solver, prefix + "solver")
    check_number(tol, prefix + "tol", low=0.0, low_open=True)
    check_choice(stop_mode, prefix + "stop_mode", STOP_MODES)
    check_choice(norm, prefix + "norm", NORMS)
    check_number(max_iter, prefix + "max_iter", low=1, integer=True)
    check_number(min_iter, prefix + "min_iter", low=0, integer=True)
    if min_iter > max_iter:
        raise ValueError(f"{prefix}min_iter={min_iter} must not exceed {prefix}max_iter={max_iter}.")
    check_number(batch_dims, prefix + "batch_dims", low=1, integer=True)
    check_number(stop_fraction, prefix + "stop_fraction", low=0.0, high=1.0, high_open=True)
    check_choice(return_mode, prefix + "return_mode", RETURN_MODES)


def _residual(gz, fz, stop_mode, norm, row_size=1, row_mask=None):
    """Per-entry residual of ``gz = f(z) - z`` (shape ``(entries, d)``). ``token_linf`` views each entry as rows of
    ``row_size`` (the tokens of a ``(..., T, D)`` state) and takes the largest per-row relative l-infinity residual:
    FPRM's ``max_t ||g_t||_inf / ||f_t||_inf``, where a token that changes a lot relative to its own size counts
    even if other tokens are larger (``linf`` divides by the largest entry of the whole state instead).
    ``row_mask`` (``(entries, rows)``, bool; ``token_linf`` only): the rows that count (e.g. not padding); an entry
    with no counted row has residual 0."""
    # At least float32: in float16 the squares of small entries underflow and 1e-9 rounds to 0, so a tiny row's
    # relative residual would be 0 / 0 = NaN (and be reported as a non-finite iterate).
    acc = torch.promote_types(gz.dtype, torch.float32)
    if norm == "token_linf" and stop_mode == "rel":
        rows = (gz.shape[0], -1, row_size)
        per_row = gz.reshape(rows).abs().amax(-1).to(acc) / (fz.reshape(rows).abs().amax(-1).to(acc) + 1e-9)
        if row_mask is not None:
            per_row = per_row.masked_fill(~row_mask.reshape(per_row.shape), 0.0)
        return per_row.amax(-1)
    if norm == "l2":
        r = torch.linalg.vector_norm(gz, dim=1, dtype=acc)
        return r / (torch.linalg.vector_norm(fz, dim=1, dtype=acc) + 1e-9) if stop_mode == "rel" else r
    r = gz.abs().amax(1).to(acc)
    return r / (fz.abs().amax(1).to(acc) + 1e-9) if stop_mode == "rel" else r


def solve(
    f: Callable,
    z0: torch.Tensor,
    *,
    args: Sequence = (),
    solver: str = "anderson",
    tol: float = 1e-4,
    stop_mode: str = "rel",
    norm: str = "l2",
    max_iter: int = 50,
    min_iter: int = 0,
    batch_dims: int = 1,
    stop_fraction: float = 0.0,
    return_mode: str = "best",
    compact: bool = False,
    track_trace: bool = False,
    solver_kwargs: Optional[dict] = None,
    check: bool = True,
    pass_active: bool = False,
    row_mask: Optional[torch.Tensor] = None,
    residual_fn: Optional[Callable] = None,
):
    """Solve ``z = f(z, *args)`` from ``z0`` without autograd; returns ``(z_star, FixedPointStats)``.

    Args:
        f: the map; called as ``f(z, *args)`` with ``z`` shaped like ``z0`` (fewer rows when ``compact``).
        z0: initial iterate; its first ``batch_dims`` dims index independent entries.
        args: extra inputs of ``f``; with ``compact`` their batch-sized tensors are sliced with ``z``.
        solver: a name in ``SOLVERS`` (``picard``, ``fpopt``, ``picard_adaptive``, ``anderson``, ``broyden``).
        tol: tolerance on the residual (> 0).
        stop_mode: ``rel`` (``||f(z) - z|| / ||f(z)||``) or ``abs`` (``||f(z) - z||``).
        norm: ``l2`` or ``linf``, taken over each entry, or ``token_linf``: the largest relative l-inf residual of
            the entry's rows along the last dim of ``z0`` (FPRM's per-token residual; with ``stop_mode="abs"`` it
            equals ``linf``).
        max_iter: cap on evaluations of ``f`` (>= 1).
        min_iter: no entry is declared converged before this many evaluations.
        batch_dims: number of leading dims that index entries (convergence granularity).
        stop_fraction: stop the whole solve once at most this fraction of entries is unconverged (FPRM's training
            rule; FPSA's "exit when 80% converged" is 0.2). 0 waits for every entry.
        return_mode: for entries that did not converge, return the image of the iterate with the lowest residual
            (``best``) or of the last iterate (``last``). Converged entries return ``f`` of their converged iterate.
        compact: evaluate ``f`` only on unfinished samples (``f`` must be row-separable, see module docstring).
        track_trace: keep the residual of every iteration in ``stats.trace``.
        solver_kwargs: extra arguments of the solver (e.g. ``{"m": 5}`` for Anderson).
        pass_active: call ``f(z, *args, active=mask)`` with ``mask`` the entries still iterating (a bool tensor shaped
            like the working rows' entries, ``(rows, *z0.shape[1:batch_dims])``; None while every entry is open), so
            that ``f`` can skip the work of converged entries: their values in its output are ignored.
        row_mask: with ``norm="token_linf"``, a bool tensor shaped ``z0.shape[:-1]``: the rows (tokens) whose
            residual counts; padding positions are left out this way (None: every row).
        residual_fn: a residual of the caller's own instead of ``tol``/``stop_mode``/``norm``'s:
            ``residual_fn(fz, z, *args) -> (rows, *entries)`` with ``fz = f(z)`` and ``z`` shaped like the working
            rows of ``z0`` and ``args`` sliced with them (e.g. FPSA's relative change of the state its queries and
            keys are computed from, per token); an entry converges once it is below ``tol``. With ``pass_active`` it
            also gets ``active=`` (as ``f`` does); the residuals of finished entries are ignored.

    Raises:
        NonFiniteError: an iterate contains NaN or Inf (the message names the iteration and the samples).
    """
    if check:
        check_solve_args(solver=solver, tol=tol, stop_mode=stop_mode, norm=norm, max_iter=max_iter,
                         min_iter=min_iter, batch_dims=batch_dims, stop_fraction=stop_fraction,
                         return_mode=return_mode)
        solver_kwargs = solver_kwargs_check(solver, solver_kwargs)
        if z0.dim() < batch_dims:
            raise ValueError(f"batch_dims={batch_dims} needs z0 with at least that many dims, got {tuple(z0.shape)}.")
    algo = SOLVERS.get(solver)(**(solver_kwargs or {}))
    shape = z0.shape
    B = shape[0]
    G = math.prod(shape[:batch_dims])
    entry_shape = shape[:batch_dims]
    if G == 0 or z0.numel() == 0:
        empty = torch.zeros(entry_shape, dtype=torch.long, device=z0.device)
        residual = z0.new_zeros(entry_shape, dtype=torch.promote_types(z0.dtype, torch.float32))
        return z0.detach().clone(), FixedPointStats(empty, residual, empty.bool(), 0, solver, tol,
                                                     stop_mode)
    gps = G // B  # entries per sample
    d = z0.numel() // G
    row_size = shape[-1] if len(shape) > batch_dims else 1  # token_linf: the rows of an entry
    rmask = None
    if row_mask is not None:
        if norm != "token_linf" or tuple(row_mask.shape) != tuple(shape[:-1]):
            raise ValueError(f"row_mask must be a bool tensor of shape {tuple(shape[:-1])} (z0 without its last dim) "
                             f"and needs norm='token_linf'; got shape {tuple(row_mask.shape)} with norm={norm!r}.")
        rmask = row_mask.reshape(G, -1).bool()
    track_best = return_mode == "best"
    observe = getattr(algo, "observe", None)

    with torch.no_grad():
        z = z0.detach().reshape(G, d)
        # Working rows: every entry, or fewer once `compact` drops finished samples. `done` marks rows that converged
        # or were halted; their results sit in out/out_res/nstep/conv and their state is frozen at `out`.
        done = conv = out = out_res = nstep = None
        best = best_res = None
        gidx = None  # working row -> entry; None while the working set is every entry
        results = None  # (out, res, nstep, conv) over all entries, once compaction drops rows
        wshape, wargs, Bw = shape, tuple(args), B
        trace = [] if track_trace else None
        algo.init(z)
        k = 0
        for k in range(1, max_iter + 1):
            if pass_active:
                active = None if done is None else (~done).view(wshape[:batch_dims])
                fz = f(z.view(wshape), *wargs, active=active)
            else:
                fz = f(z.view(wshape), *wargs)
            if fz.shape != wshape:
                raise ValueError(f"f returned shape {tuple(fz.shape)} for an input of shape {tuple(wshape)}; "
                                 "a fixed-point map must preserve the shape of its input.")
            fz = fz.reshape(z.shape)
            gz = fz - z
            if residual_fn is None:
                res = _residual(gz, fz, stop_mode, norm, row_size, rmask)
            else:
                extra = {"active": active} if pass_active else {}
                res = residual_fn(fz.view(wshape), z.view(wshape), *wargs, **extra).reshape(-1)
            if observe is not None:
                observe(res)
            if trace is not None:
                row = z.new_full((G,), math.nan, dtype=res.dtype)
                row[slice(None) if gidx is None else gidx] = res if done is None else res.masked_fill(done, math.nan)
                trace.append(row)
            # One host sync per iteration: the smallest residual among open rows (NaN propagates, so it is also the
            # NaN check). With best-iterate tracking a row whose residual did not improve is encoded as -1, so the
            # full best-iterate update runs only in iterations where some row got worse.
            key = res if done is None else res.masked_fill(done, math.inf)
            tracked = track_best and best is not None
            if tracked:
                key = torch.where(res < best_res, key, -1.0)
            halted = algo.halted()
            if halted is None:
                lo, halt_any = key.amin().item(), 0.0
            else:
                lo, halt_any = torch.stack([key.amin(), halted.any().to(key.dtype)]).tolist()
            if track_best:
                if tracked and lo == -1.0:
                    better = res < best_res
                    best = torch.where(better[:, None], fz, best)
                    best_res = torch.where(better, res, best_res)
                    lo = (res if done is None else res.masked_fill(done, math.inf)).amin().item()
                else:
                    best, best_res = fz, res
            if lo != lo:
                bad_rows = (~torch.isfinite(res) if done is None else ~torch.isfinite(res) & ~done).nonzero()[:, 0]
                ent = bad_rows if gidx is None else gidx[bad_rows]
                bad = sorted({int(i) for i in (ent // gps).tolist()})
                raise NonFiniteError(
                    f"fixed-point solve ({solver}) produced NaN/Inf at iteration {k} for samples {bad[:20]}"
                    f"{' ...' if len(bad) > 20 else ''} (of {B}). Lower the learning rate, add damping or a stability "
                    f"regularizer, or check the inputs."
                )
            event = (lo < tol and k >= min_iter) or halt_any > 0
            if event:
                open_rows = torch.ones_like(res, dtype=torch.bool) if done is None else ~done
                newly = open_rows & (res < tol) if k >= min_iter else torch.zeros_like(open_rows)
                if done is None:
                    done, conv, out, out_res = newly, newly, fz, res
                    nstep = torch.zeros(res.shape, dtype=torch.long, device=res.device)
                else:
                    out = torch.where(newly[:, None], fz, out)
                    out_res = torch.where(newly, res, out_res)
                    conv, done = conv | newly, done | newly
                nstep = torch.where(newly, k, nstep)
                if halt_any > 0:
                    newly_halted = halted & open_rows & ~newly
                    src, src_res = (best, best_res) if track_best else (fz, res)
                    out = torch.where(newly_halted[:, None], src, out)
                    out_res = torch.where(newly_halted, src_res, out_res)
                    nstep = torch.where(newly_halted, k, nstep)
                    done = done | newly_halted
                n_open = done.numel() - int(done.sum())
                if n_open <= stop_fraction * G:  # the fraction counts every entry, finished or not
                    break
            if k == max_iter:
                break
            z_next = algo.step(z, fz, gz, k)
            z = z_next if done is None else torch.where(done[:, None], out, z_next)
            if event and compact:
                keep_s = (~done).view(Bw, gps).any(1)
                if not bool(keep_s.all()):
                    keep_s = keep_s.nonzero()[:, 0]
                    rows = (keep_s[:, None] * gps + torch.arange(gps, device=z.device)).reshape(-1)
                    if gidx is None:
                        gidx = torch.arange(G, device=z.device)
                        results = (z.new_empty(G, d), z.new_empty(G, dtype=res.dtype),
                                   torch.zeros(G, dtype=torch.long, device=z.device),
                                   torch.zeros(G, dtype=torch.bool, device=z.device))
                    gone = torch.ones_like(done)
                    gone[rows] = False
                    gone = gone.nonzero()[:, 0]
                    for buf, val in zip(results, (out, out_res, nstep, conv)):
                        buf[gidx[gone]] = val[gone]
                    z, done, conv, out, out_res, nstep, gidx = (
                        t[rows] for t in (z, done, conv, out, out_res, nstep, gidx))
                    if best is not None:
                        best, best_res = best[rows], best_res[rows]
                    algo.select(rows)
                    rmask = None if rmask is None else rmask[rows]
                    wargs = tuple(a[keep_s] if torch.is_tensor(a) and a.dim() > 0 and a.shape[0] == Bw else a
                                  for a in wargs)
                    Bw = keep_s.numel()
                    wshape = (Bw,) + tuple(shape[1:])
        # Rows still open when the loop ended did not converge: they return the best (or last) iterate's image.
        src, src_res = (best, best_res) if track_best else (fz, res)
        if done is None:
            out, out_res = src, src_res
            nstep = torch.full(res.shape, k, dtype=torch.long, device=res.device)
            conv = torch.zeros(res.shape, dtype=torch.bool, device=res.device)
        elif not bool(done.all()):
            out = torch.where(done[:, None], out, src)
            out_res = torch.where(done, out_res, src_res)
            nstep = torch.where(done, nstep, k)
        if gidx is not None:
            for buf, val in zip(results, (out, out_res, nstep, conv)):
                buf[gidx] = val
            out, out_res, nstep, conv = results
        stats = FixedPointStats(
            nstep=nstep.view(entry_shape),
            residual=out_res.view(entry_shape),
            converged=conv.view(entry_shape),
            nfe=k,
            solver=solver,
            tol=tol,
            stop_mode=stop_mode,
            trace=torch.stack(trace).view(-1, *entry_shape) if trace else None,
        )
        return out.view(shape), stats


__all__ = ["NORMS", "RETURN_MODES", "SOLVERS", "STOP_MODES", "check_solve_args", "solve", "solver_kwargs_check"]
