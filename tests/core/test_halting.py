"""Halting: ACTAccumulator against hand-computed and reference (pure Python) ACT, and tolerance_mask."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_fixedpoint.core.fp_halting import ACTAccumulator, tolerance_mask

DT = torch.float64


def reference_act(ps, max_steps, threshold):
    """Graves' ACT for one entry: (weights per step, n_updates, remainder), with a forced halt at max_steps."""
    cumulative, weights = 0.0, []
    for t in range(max_steps):
        p = ps[t]
        if cumulative + p > threshold or t == max_steps - 1:
            remainder = 1.0 - cumulative
            weights.append(remainder)
            return weights + [0.0] * (max_steps - t - 1), t + 1, remainder
        weights.append(p)
        cumulative += p
    raise AssertionError("unreachable")


def run_act(p_steps, states, max_steps, threshold=0.99):
    """Feed ``p_steps[t]`` (entry shape) and ``states[t]`` until all halted; return the accumulator and weights."""
    act = ACTAccumulator(p_steps[0].shape, max_steps=max_steps, threshold=threshold, dtype=DT)
    weights = []
    for p, s in zip(p_steps, states):
        weights.append(act.update(p, s))
        if act.all_halted:
            break
    return act, weights


# --------------------------------------------------------------------------------------------------------- ACT


def test_hand_computed_example():
    """p = 0.3 each step, threshold 0.99: 0.3, 0.6, 0.9 run on; at step 4 0.9 + 0.3 > 0.99 -> halt, R = 0.1."""
    act = ACTAccumulator((1,), max_steps=10, threshold=0.99, dtype=DT)
    states = [torch.full((1, 2), float(t + 1), dtype=DT) for t in range(10)]
    weights = []
    for t in range(10):
        assert not act.all_halted
        weights.append(act.update(torch.tensor([0.3], dtype=DT), states[t]).item())
        if act.all_halted:
            break
    assert act.steps == 4
    assert weights == pytest.approx([0.3, 0.3, 0.3, 0.1], abs=1e-12)
    assert act.halted.tolist() == [True]
    assert act.remainders.item() == pytest.approx(0.1, abs=1e-12)
    assert act.n_updates.item() == 4
    assert act.ponder_cost.item() == pytest.approx(4.1, abs=1e-12)
    assert act.cumulative.item() == pytest.approx(1.0, abs=1e-12)
    # output = 0.3*1 + 0.3*2 + 0.3*3 + 0.1*4 = 2.2 in both features
    torch.testing.assert_close(act.output, torch.full((1, 2), 2.2, dtype=DT), rtol=0, atol=1e-12)


def test_threshold_is_strict():
    """An entry halts when the cumulative probability would *exceed* the threshold, not when it reaches it."""
    act = ACTAccumulator((1,), max_steps=5, threshold=0.5, dtype=DT)
    state = torch.zeros(1, 1, dtype=DT)
    assert act.update(torch.tensor([0.5], dtype=DT), state).item() == 0.5
    assert not act.all_halted
    assert act.update(torch.tensor([0.25], dtype=DT), state).item() == 0.5
    assert act.all_halted
    assert act.ponder_cost.item() == pytest.approx(2.5)


def test_halts_at_first_step_with_large_p():
    act = ACTAccumulator((2,), max_steps=3, dtype=DT)
    w = act.update(torch.tensor([1.0, 0.995], dtype=DT), torch.ones(2, 3, dtype=DT))
    assert w.tolist() == [1.0, 1.0]
    assert act.all_halted
    assert act.ponder_cost.tolist() == [2.0, 2.0]  # N = 1, R = 1


def test_forced_halt_at_max_steps():
    act = ACTAccumulator((3,), max_steps=3, threshold=0.99, dtype=DT)
    p = torch.tensor([0.1, 0.2, 0.0], dtype=DT)
    ws = [act.update(p, torch.zeros(3, 1, dtype=DT)) for _ in range(3)]
    assert act.all_halted
    torch.testing.assert_close(
        torch.stack(ws), torch.tensor([[0.1, 0.2, 0.0], [0.1, 0.2, 0.0], [0.8, 0.6, 1.0]], dtype=DT)
    )
    torch.testing.assert_close(act.remainders, torch.tensor([0.8, 0.6, 1.0], dtype=DT))
    torch.testing.assert_close(act.ponder_cost, torch.tensor([3.8, 3.6, 4.0], dtype=DT))
    with pytest.raises(RuntimeError, match="max_steps"):
        act.update(p, torch.zeros(3, 1, dtype=DT))


def test_max_steps_one_gives_the_first_state():
    act = ACTAccumulator((2, 3), max_steps=1, dtype=DT)
    state = torch.randn(2, 3, 4, dtype=DT)
    w = act.update(torch.rand(2, 3, dtype=DT), state)
    torch.testing.assert_close(w, torch.ones(2, 3, dtype=DT))
    torch.testing.assert_close(act.output, state)
    torch.testing.assert_close(act.ponder_cost, torch.full((2, 3), 2.0, dtype=DT))


def test_per_token_shapes_and_reference():
    """Per-token halting (B, T) with states (B, T, D): every quantity matches the per-entry reference."""
    B, T, D, max_steps = 2, 5, 3, 6
    g = torch.Generator().manual_seed(0)
    p_steps = [torch.rand(B, T, generator=g, dtype=DT) * 0.6 for _ in range(max_steps)]
    states = [torch.randn(B, T, D, generator=g, dtype=DT) for _ in range(max_steps)]
    act, weights = run_act(p_steps, states, max_steps)
    assert act.output.shape == (B, T, D)
    for w in weights:
        assert w.shape == (B, T)
    for shape_attr in ("cumulative", "remainders", "n_updates", "halted", "ponder_cost"):
        assert getattr(act, shape_attr).shape == (B, T)
    assert act.halted.dtype == torch.bool
    assert act.all_halted
    expected_out = torch.zeros(B, T, D, dtype=DT)
    for b in range(B):
        for t in range(T):
            ref_w, n, r = reference_act([float(p[b, t]) for p in p_steps], max_steps, 0.99)
            got_w = [float(w[b, t]) for w in weights] + [0.0] * (max_steps - len(weights))
            assert got_w == pytest.approx(ref_w, abs=1e-12)
            assert act.n_updates[b, t].item() == n
            assert act.remainders[b, t].item() == pytest.approx(r, abs=1e-12)
            assert act.ponder_cost[b, t].item() == pytest.approx(n + r, abs=1e-12)
            for k, w in enumerate(ref_w[: len(states)]):
                expected_out[b, t] += w * states[k][b, t]
    torch.testing.assert_close(act.output, expected_out, rtol=0, atol=1e-12)


def test_halted_entries_stop_accumulating():
    act = ACTAccumulator((2,), max_steps=5, threshold=0.9, dtype=DT)
    act.update(torch.tensor([0.95, 0.1], dtype=DT), torch.ones(2, 1, dtype=DT))
    assert act.halted.tolist() == [True, False]
    out0 = act.output[0].clone()
    w = act.update(torch.tensor([0.7, 0.1], dtype=DT), 100 * torch.ones(2, 1, dtype=DT))
    assert w[0].item() == 0.0
    torch.testing.assert_close(act.output[0], out0)
    assert act.n_updates.tolist() == [1.0, 2.0]


def test_float32_default_and_state_dtype():
    act = ACTAccumulator((2,), max_steps=2)
    assert act.cumulative.dtype == torch.float32
    w = act.update(torch.tensor([0.3, 0.5], dtype=DT), torch.ones(2, 4))
    assert w.dtype == torch.float32
    assert act.output.dtype == torch.float32


def test_ponder_cost_is_differentiable_wrt_p():
    """ponder = N + R with R = 1 - sum of the p's before the halting step: d ponder / d p_t = -1 for those steps."""
    logits = torch.tensor([[-1.0, 0.5, 2.0], [0.0, 0.0, 0.0], [-3.0, -2.0, -2.5]], dtype=DT, requires_grad=True)
    ps = torch.sigmoid(logits)  # (steps=3, entries=3)
    act = ACTAccumulator((3,), max_steps=3, threshold=0.99, dtype=DT)
    for t in range(3):
        act.update(ps[:, t], torch.zeros(3, 1, dtype=DT))
    (grad_p,) = torch.autograd.grad(act.ponder_cost.sum(), ps, retain_graph=True)
    # entry-wise halting steps: entry 0: 0.269 + 0.622 = 0.891, + 0.881 > 0.99 -> halts at step 3 (p_1, p_2 count);
    # entry 1: 0.5 + 0.5 = 1.0 > 0.99 -> halts at step 2 (p_1 counts); entry 2: never, forced at step 3.
    expected = torch.tensor([[-1.0, -1.0, 0.0], [-1.0, 0.0, 0.0], [-1.0, -1.0, 0.0]], dtype=DT)
    torch.testing.assert_close(grad_p, expected)
    assert torch.autograd.gradcheck(
        lambda lg: _ponder_from_logits(lg), (logits.detach().clone().requires_grad_(),), eps=1e-6, atol=1e-6
    )


def _ponder_from_logits(logits):
    ps = torch.sigmoid(logits)
    act = ACTAccumulator((ps.shape[0],), max_steps=ps.shape[1], threshold=0.99, dtype=DT)
    for t in range(ps.shape[1]):
        act.update(ps[:, t], torch.zeros(ps.shape[0], 1, dtype=DT))
    return act.ponder_cost


def test_output_is_differentiable_wrt_p_and_states():
    ps = torch.tensor([0.4, 0.4, 0.4], dtype=DT, requires_grad=True)
    states = torch.randn(3, 2, dtype=DT, requires_grad=True)
    act = ACTAccumulator((1,), max_steps=3, dtype=DT)
    for t in range(3):
        act.update(ps[t : t + 1], states[t : t + 1])
    # weights 0.4, 0.4, 1 - 0.8 = 0.2 -> out = 0.4 s0 + 0.4 s1 + (1 - p0 - p1) s2
    gp, gs = torch.autograd.grad(act.output.sum(), (ps, states))
    s = states.detach().sum(1)
    torch.testing.assert_close(gp, torch.stack([s[0] - s[2], s[1] - s[2], torch.zeros((), dtype=DT)]))
    torch.testing.assert_close(gs, torch.tensor([[0.4, 0.4], [0.4, 0.4], [0.2, 0.2]], dtype=DT))


@settings(max_examples=30, deadline=None)
@given(
    data=st.data(),
    n_entries=st.integers(1, 4),
    max_steps=st.integers(1, 8),
    threshold=st.floats(0.05, 1.0),
)
def test_weights_sum_to_one_random_sequences(data, n_entries, max_steps, threshold):
    p_seq = data.draw(
        st.lists(
            st.lists(st.floats(0.0, 1.0), min_size=n_entries, max_size=n_entries),
            min_size=max_steps,
            max_size=max_steps,
        )
    )
    act = ACTAccumulator((n_entries,), max_steps=max_steps, threshold=threshold, dtype=DT)
    states = torch.arange(max_steps, dtype=DT)[:, None, None].expand(max_steps, n_entries, 1) + 1
    total = torch.zeros(n_entries, dtype=DT)
    expected_out = torch.zeros(n_entries, 1, dtype=DT)
    for t in range(max_steps):
        w = act.update(torch.tensor(p_seq[t], dtype=DT), states[t])
        assert (w >= -1e-12).all()
        total = total + w
        expected_out = expected_out + w[:, None] * states[t]
        # halted entries have weights summing to exactly (within rounding) one; running ones to at most threshold
        torch.testing.assert_close(total[act.halted], torch.ones_like(total[act.halted]), rtol=0, atol=1e-12)
        assert (total[~act.halted] <= threshold + 1e-12).all()
    assert act.all_halted
    torch.testing.assert_close(act.output, expected_out, rtol=0, atol=1e-12)
    for e in range(n_entries):
        ref_w, n, r = reference_act([row[e] for row in p_seq], max_steps, threshold)
        assert act.n_updates[e].item() == n
        assert act.remainders[e].item() == pytest.approx(r, abs=1e-12)
        assert 1 <= act.ponder_cost[e].item() <= max_steps + 1
        assert math.fsum(ref_w) == pytest.approx(1.0, abs=1e-12)


def test_wrong_p_shape_raises():
    act = ACTAccumulator((2, 3), max_steps=4)
    with pytest.raises(ValueError, match="shape"):
        act.update(torch.rand(2), torch.zeros(2, 3, 5))
    with pytest.raises(ValueError, match="shape"):
        act.update(torch.rand(2, 3, 1), torch.zeros(2, 3, 5))
    assert act.steps == 0  # a rejected update leaves the accumulator untouched


@pytest.mark.parametrize("threshold", [0.0, -0.5, 1.5, float("nan"), "0.9", None])
def test_bad_threshold_raises(threshold):
    with pytest.raises(ValueError, match="threshold"):
        ACTAccumulator((2,), max_steps=3, threshold=threshold)


@pytest.mark.parametrize("max_steps", [0, -1, 2.0, None, True])
def test_bad_max_steps_raises(max_steps):
    with pytest.raises(ValueError, match="max_steps"):
        ACTAccumulator((2,), max_steps=max_steps)


# ---------------------------------------------------------------------------------------------- tolerance mask


def test_tolerance_mask():
    r = torch.tensor([0.1, float("nan"), 1e-9, float("inf"), 1e-6, 0.0, -float("nan")], dtype=DT)
    assert tolerance_mask(r, 1e-6).tolist() == [False, False, True, False, False, True, False]


def test_tolerance_mask_shape_and_dtype():
    r = torch.rand(3, 4) * 2e-3
    m = tolerance_mask(r, 1e-3)
    assert m.shape == (3, 4) and m.dtype == torch.bool
    assert torch.equal(m, r < 1e-3)


@pytest.mark.parametrize("tol", [0.0, -1e-3, float("nan"), None, "1e-3"])
def test_tolerance_mask_bad_tol(tol):
    with pytest.raises(ValueError, match="tol"):
        tolerance_mask(torch.zeros(2), tol)
