"""Loop-count samplers: registry, range, determinism in (seed, step), and distributions against exact values."""

import math
import statistics

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_fixedpoint.core.fp_samplers import SAMPLERS, LoopSampler, get_sampler

NAMES = ["exponential", "fixed", "lognormal", "poisson", "uniform"]
N_STEPS = 5000


def draws(sampler, n=N_STEPS, start=0):
    return [sampler(step) for step in range(start, start + n)]


def _phi(x):
    return 0.5 * (1.0 + math.erf(x / math.sqrt(2.0)))


def clipped_pmf(cdf_below, lo, hi, k_max=10_000):
    """pmf of clip(round(X), lo, hi) from ``cdf_below(k) = P(round(X) < k)`` (round half-way cases have measure 0)."""
    pmf = {k: cdf_below(k + 1) - cdf_below(k) for k in range(lo + 1, hi)}
    pmf[lo] = cdf_below(lo + 1)
    pmf[hi] = 1.0 - cdf_below(hi)
    assert sum(pmf.values()) == pytest.approx(1.0, abs=1e-12)
    return pmf


def lognormal_pmf(mu, sigma, lo, hi):
    # round(X) < k  <=>  X < k - 1/2
    return clipped_pmf(lambda k: _phi((math.log(k - 0.5) - mu) / sigma) if k > 0 else 0.0, lo, hi)


def poisson_pmf(rate, lo, hi):
    def cdf_below(k):
        return sum(math.exp(-rate + j * math.log(rate) - math.lgamma(j + 1)) for j in range(k))

    return clipped_pmf(cdf_below, lo, hi)


def exponential_pmf(mean, lo, hi):
    return clipped_pmf(lambda k: 1.0 - math.exp(-(k - 0.5) / mean) if k > 0 else 0.0, lo, hi)


def moments(pmf):
    mean = sum(k * p for k, p in pmf.items())
    var = sum((k - mean) ** 2 * p for k, p in pmf.items())
    return mean, var


def median(pmf):
    acc = 0.0
    for k in sorted(pmf):
        acc += pmf[k]
        if acc >= 0.5:
            return k
    raise AssertionError("pmf does not sum to 1")


def assert_mean_close(xs, pmf, n_se=4.5):
    mean, var = moments(pmf)
    se = math.sqrt(var / len(xs))
    assert abs(statistics.fmean(xs) - mean) < n_se * se, (statistics.fmean(xs), mean, se)


# ------------------------------------------------------------------------------------------------------ registry


def test_registered_names():
    assert SAMPLERS.names() == NAMES


@pytest.mark.parametrize("name", NAMES)
def test_every_name_builds_and_draws_in_range(name):
    s = get_sampler(name, min_loops=2, max_loops=9, seed=3)
    assert isinstance(s, LoopSampler)
    assert (s.min_loops, s.max_loops, s.seed) == (2, 9, 3)
    xs = draws(s, 500)
    assert all(isinstance(x, int) and 2 <= x <= 9 for x in xs)
    assert name in repr(s).lower() or type(s).__name__ in repr(s)


@pytest.mark.parametrize("name", NAMES)
def test_defaults_build(name):
    s = get_sampler(name)
    assert (s.min_loops, s.max_loops, s.seed) == (1, 16, 0)
    assert 1 <= s(0) <= 16


def test_unknown_name_lists_valid_names():
    with pytest.raises(ValueError) as info:
        get_sampler("log-normal")
    msg = str(info.value)
    assert "log-normal" in msg
    for name in NAMES:
        assert repr(name) in msg


@pytest.mark.parametrize("bad", [None, 3, "", "Uniform"])
def test_bad_name_types_raise_value_error(bad):
    with pytest.raises(ValueError, match="loop sampler"):
        get_sampler(bad)


@pytest.mark.parametrize(
    "name, kwargs, bad",
    [
        ("lognormal", {"rate": 3.0}, "rate"),
        ("poisson", {"mu": 1.0}, "mu"),
        ("uniform", {"loops": 4}, "loops"),
        ("fixed", {"sigma": 0.1}, "sigma"),
        ("exponential", {"max_loop": 8}, "max_loop"),
    ],
)
def test_unknown_kwarg_raises(name, kwargs, bad):
    with pytest.raises(ValueError, match=bad) as info:
        get_sampler(name, **kwargs)
    assert "min_loops" in str(info.value)  # lists the allowed arguments


@pytest.mark.parametrize("name", NAMES)
def test_min_above_max_raises(name):
    with pytest.raises(ValueError, match="min_loops"):
        get_sampler(name, min_loops=5, max_loops=4)


@pytest.mark.parametrize(
    "name, kwargs, arg",
    [
        ("uniform", {"min_loops": 0}, "min_loops"),
        ("uniform", {"max_loops": 0}, "max_loops"),
        ("uniform", {"min_loops": 1.0}, "min_loops"),
        ("uniform", {"seed": -1}, "seed"),
        ("fixed", {"loops": 0}, "loops"),
        ("lognormal", {"sigma": -0.1}, "sigma"),
        ("lognormal", {"mu": float("nan")}, "mu"),
        ("poisson", {"rate": 0.0}, "rate"),
        ("poisson", {"offset": -1}, "offset"),
        ("exponential", {"mean": 0}, "mean"),
    ],
)
def test_bad_values_raise(name, kwargs, arg):
    with pytest.raises(ValueError, match=arg):
        get_sampler(name, **kwargs)


@pytest.mark.parametrize("step", [-1, 1.5, None, True])
def test_bad_step_raises(step):
    with pytest.raises(ValueError, match="step"):
        get_sampler("lognormal")(step)


# --------------------------------------------------------------------------------------------------- determinism


@pytest.mark.parametrize("name", NAMES)
def test_same_seed_and_step_same_count_across_ranks(name):
    """Two sampler objects (two DDP ranks) with the same seed draw the same count at every step, in any order."""
    rank0 = get_sampler(name, seed=74)
    rank1 = get_sampler(name, seed=74)
    steps = list(range(300))
    a = [rank0(s) for s in steps]
    b = [rank1(s) for s in reversed(steps)][::-1]
    assert a == b
    assert [rank0(s) for s in steps] == a  # a resumed run redraws the same counts


@pytest.mark.parametrize("name", ["exponential", "lognormal", "poisson", "uniform"])
def test_counts_vary_across_steps_and_seeds(name):
    a = draws(get_sampler(name, seed=0), 200)
    b = draws(get_sampler(name, seed=1), 200)
    assert len(set(a)) >= 4
    assert a != b


def test_fixed_is_constant_and_clipped():
    assert set(draws(get_sampler("fixed", loops=6), 50)) == {6}
    assert set(draws(get_sampler("fixed", loops=20, max_loops=16), 10)) == {16}
    assert set(draws(get_sampler("fixed", loops=1, min_loops=3, max_loops=5), 10)) == {3}


@settings(max_examples=40, deadline=None)
@given(
    name=st.sampled_from(NAMES),
    lo=st.integers(1, 20),
    width=st.integers(0, 20),
    seed=st.integers(0, 2**40),
    step=st.integers(0, 2**40),
)
def test_in_range_and_deterministic_for_random_seeds_and_steps(name, lo, width, seed, step):
    hi = lo + width
    s1 = get_sampler(name, min_loops=lo, max_loops=hi, seed=seed)
    s2 = get_sampler(name, min_loops=lo, max_loops=hi, seed=seed)
    for k in range(3):
        n = s1(step + k)
        assert isinstance(n, int) and lo <= n <= hi
        assert s2(step + k) == n


# ------------------------------------------------------------------------------------------------ distributions


def test_lognormal_stars_exact_values():
    """STARS' Ouro fine-tune setting (mu 1.7, sigma 0.4, clip [1, 16]): mean 5.92, median 5 (notes, 2M samples)."""
    pmf = lognormal_pmf(1.7, 0.4, 1, 16)
    mean, _ = moments(pmf)
    assert mean == pytest.approx(5.92, abs=0.01)
    assert median(pmf) == 5
    assert sum(p for k, p in pmf.items() if k <= 4) == pytest.approx(0.31, abs=0.01)
    assert sum(p for k, p in pmf.items() if k >= 9) == pytest.approx(0.14, abs=0.01)
    # the addition setting: mu 2.0, sigma 0.7, clip [1, 100] -> mean 9.43, median 7
    pmf2 = lognormal_pmf(2.0, 0.7, 1, 100)
    assert moments(pmf2)[0] == pytest.approx(9.43, abs=0.01)
    assert median(pmf2) == 7


def test_lognormal_stars_empirical():
    s = get_sampler("lognormal", mu=1.7, sigma=0.4, min_loops=1, max_loops=16, seed=0)
    xs = draws(s)
    assert statistics.fmean(xs) == pytest.approx(5.92, abs=0.15)
    assert statistics.median(xs) == 5
    pmf = lognormal_pmf(1.7, 0.4, 1, 16)
    assert_mean_close(xs, pmf)
    assert sum(x <= 4 for x in xs) / len(xs) == pytest.approx(0.31, abs=0.03)
    assert sum(x >= 9 for x in xs) / len(xs) == pytest.approx(0.14, abs=0.03)
    # the distribution as a whole: every frequency within 4.5 binomial standard errors
    for k, p in pmf.items():
        freq = sum(x == k for x in xs) / len(xs)
        assert abs(freq - p) < 4.5 * math.sqrt(p * (1 - p) / len(xs)) + 1e-3, (k, freq, p)


def test_lognormal_sigma_zero_is_rounded_exp_mu():
    assert set(draws(get_sampler("lognormal", mu=math.log(7.2), sigma=0.0), 20)) == {7}


@pytest.mark.parametrize("rate", [2.0, 5.0, 9.5])
def test_poisson_mean(rate):
    """Mean of the clipped count against the exact clipped pmf (a draw of 0 is clipped up to min_loops=1)."""
    xs = draws(get_sampler("poisson", rate=rate, min_loops=1, max_loops=40, seed=5))
    pmf = poisson_pmf(rate, 1, 40)
    assert moments(pmf)[0] == pytest.approx(rate + math.exp(-rate), rel=1e-9)  # only 0 -> 1 clips
    assert_mean_close(xs, pmf)
    if rate >= 5:
        assert statistics.fmean(xs) == pytest.approx(rate, rel=0.03)


@pytest.mark.parametrize("rate", [2.0, 5.0])
def test_poisson_offset_mean_is_rate_plus_offset(rate):
    """With offset=1 nothing is clipped at the bottom, so the mean is exactly rate + 1 (variance rate)."""
    xs = draws(get_sampler("poisson", rate=rate, offset=1, min_loops=1, max_loops=60, seed=6))
    assert min(xs) >= 1
    se = math.sqrt(rate / len(xs))
    assert abs(statistics.fmean(xs) - (rate + 1)) < 4.5 * se
    assert statistics.variance(xs) == pytest.approx(rate, rel=0.1)


def test_exponential_mean():
    xs = draws(get_sampler("exponential", mean=4.0, min_loops=1, max_loops=16, seed=7))
    assert_mean_close(xs, exponential_pmf(4.0, 1, 16))


def test_uniform_covers_the_range_evenly():
    lo, hi = 3, 12
    xs = draws(get_sampler("uniform", min_loops=lo, max_loops=hi, seed=8))
    assert set(xs) == set(range(lo, hi + 1))
    expected = len(xs) / (hi - lo + 1)
    chi2 = sum((xs.count(k) - expected) ** 2 / expected for k in range(lo, hi + 1))
    assert chi2 < 30  # 9 degrees of freedom; P(chi2 > 30) ~ 4e-4
    assert statistics.fmean(xs) == pytest.approx((lo + hi) / 2, abs=0.15)


def test_uniform_single_value():
    assert set(draws(get_sampler("uniform", min_loops=4, max_loops=4), 20)) == {4}
