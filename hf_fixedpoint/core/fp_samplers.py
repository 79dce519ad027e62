# Source of truth: hf_fixedpoint/core/fp_samplers.py. Verbatim copies live in modeling/*/ so that checkpoints
# saved with save_pretrained() load with torch + transformers only. Edit here, then run
# `python -m hf_fixedpoint.vendor`. Allowed imports: stdlib, torch, and `from .fp_<x> import ...`.
"""Loop-count samplers for random-depth training (STARS, Huginn): ``fixed``, ``lognormal``, ``poisson``,
``exponential`` and ``uniform``, each clipped to ``[min_loops, max_loops]``.

``sampler(step)`` is a pure function of ``(seed, step)``: every DDP rank draws the same count for the same step without
communicating, and a resumed run draws the same counts again.
"""

import math

import torch

from .fp_registry import Registry, check_keywords, check_number, keyword_options

SAMPLERS = Registry("loop sampler")


class LoopSampler:
    """Base class: subclasses implement ``_draw(generator) -> float``."""

    def __init__(self, min_loops: int = 1, max_loops: int = 16, seed: int = 0):
        check_number(min_loops, "min_loops", low=1, integer=True)
        check_number(max_loops, "max_loops", low=1, integer=True)
        if min_loops > max_loops:
            raise ValueError(f"min_loops={min_loops} must not exceed max_loops={max_loops}.")
        check_number(seed, "seed", low=0, integer=True)
        self.min_loops, self.max_loops, self.seed = min_loops, max_loops, seed

    def __call__(self, step: int) -> int:
        check_number(step, "step", low=0, integer=True)
        g = torch.Generator().manual_seed((self.seed * 1_000_003 + step) % (2**63 - 1))
        n = int(round(self._draw(g)))
        return max(self.min_loops, min(self.max_loops, n))

    def _draw(self, g: torch.Generator) -> float:  # pragma: no cover - interface
        raise NotImplementedError

    def __repr__(self):
        fields = ", ".join(f"{k}={v!r}" for k, v in vars(self).items())
        return f"{type(self).__name__}({fields})"


@SAMPLERS.register("fixed")
class FixedLoops(LoopSampler):
    """Always ``loops`` (clipped)."""

    def __init__(self, loops: int = 4, min_loops: int = 1, max_loops: int = 16, seed: int = 0):
        super().__init__(min_loops, max_loops, seed)
        check_number(loops, "loops", low=1, integer=True)
        self.loops = loops

    def _draw(self, g):
        return self.loops


@SAMPLERS.register("lognormal")
class LogNormalLoops(LoopSampler):
    """``round(exp(mu + sigma * N(0, 1)))`` (STARS' Ouro fine-tune: mu 1.7, sigma 0.4, clip [1, 16])."""

    def __init__(self, mu: float = 1.7, sigma: float = 0.4, min_loops: int = 1, max_loops: int = 16, seed: int = 0):
        super().__init__(min_loops, max_loops, seed)
        check_number(mu, "mu")
        check_number(sigma, "sigma", low=0.0)
        self.mu, self.sigma = float(mu), float(sigma)

    def _draw(self, g):
        return math.exp(self.mu + self.sigma * float(torch.randn((), generator=g, dtype=torch.float64)))


@SAMPLERS.register("poisson")
class PoissonLoops(LoopSampler):
    """``Poisson(rate) + offset``."""

    def __init__(self, rate: float = 5.0, offset: int = 0, min_loops: int = 1, max_loops: int = 16, seed: int = 0):
        super().__init__(min_loops, max_loops, seed)
        check_number(rate, "rate", low=0.0, low_open=True)
        check_number(offset, "offset", low=0, integer=True)
        self.rate, self.offset = float(rate), offset

    def _draw(self, g):
        return float(torch.poisson(torch.tensor(self.rate, dtype=torch.float64), generator=g)) + self.offset


@SAMPLERS.register("exponential")
class ExponentialLoops(LoopSampler):
    """``Exponential(mean)`` (FPRM's ``max_iter_dist: expon``)."""

    def __init__(self, mean: float = 4.0, min_loops: int = 1, max_loops: int = 16, seed: int = 0):
        super().__init__(min_loops, max_loops, seed)
        check_number(mean, "mean", low=0.0, low_open=True)
        self.mean = float(mean)

    def _draw(self, g):
        u = float(torch.rand((), generator=g, dtype=torch.float64))
        return -self.mean * math.log1p(-u)


@SAMPLERS.register("uniform")
class UniformLoops(LoopSampler):
    """Uniform integer in ``[min_loops, max_loops]``."""

    def _draw(self, g):
        return float(torch.randint(self.min_loops, self.max_loops + 1, (), generator=g))


def get_sampler(name: str, **kwargs) -> LoopSampler:
    """Build a sampler by name; unknown names or keyword arguments raise a ValueError listing the valid ones."""
    cls = SAMPLERS.get(name)
    check_keywords(kwargs, keyword_options(cls), "get_sampler", f"loop sampler {name!r}")
    return cls(**kwargs)


__all__ = ["SAMPLERS", "LoopSampler", "get_sampler"]
