"""STARS: the JSRR estimator against explicit Jacobians, its gradient path through a looped model (eager-attention
switch for the double backward), the convex combination and warm-up, presets and bad input."""

import math

import pytest
import torch

from hf_fixedpoint.modeling import OuroConfig, OuroForCausalLM
from hf_fixedpoint.stars import LOOP_SAMPLER_PRESETS, STARSRegularizer, attention_implementation, jsrr, loop_sampler


def _map(n=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(n, n, generator=g, dtype=torch.float64) / math.sqrt(n)
    b = torch.randn(n, generator=g, dtype=torch.float64)
    z = torch.randn(2, n // 2, generator=g, dtype=torch.float64)  # a (2, 3) state: one global Jacobian

    def f(x):
        return torch.tanh(x.reshape(-1) @ W.T + b).reshape(x.shape)

    J = torch.autograd.functional.jacobian(lambda x: f(x).reshape(-1), z).reshape(n, n)
    return f, z, J


@pytest.mark.parametrize("product", ["vjp", "jvp", "double_backward"])
@pytest.mark.parametrize("n_iter", [1, 3])
def test_jsrr_is_the_power_iteration_of_the_explicit_jacobian(product, n_iter):
    f, z, J = _map()
    M = J.T if product == "vjp" else J  # vjp iterates v <- J^T v
    v = torch.randn(z.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64).reshape(-1)
    v = v / v.norm()
    for _ in range(n_iter):
        w = M @ v
        v = w / w.norm()
    got = jsrr(f, z, n_iter=n_iter, product=product, generator=torch.Generator().manual_seed(5))
    torch.testing.assert_close(got, w.norm() ** 2, rtol=1e-10, atol=1e-12)


def test_jsrr_converges_to_the_spectral_radius_and_one_iteration_is_frobenius():
    n = 6
    g = torch.Generator().manual_seed(0)
    Q = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=torch.float64))[0]
    A = Q @ torch.diag(torch.tensor([1.5, 0.9, -0.6, 0.5, 0.3, 0.1], dtype=torch.float64)) @ Q.T
    A = A + 0.05 * torch.randn(n, n, generator=g, dtype=torch.float64)  # not symmetric; dominant eigenvalue real

    def f(x):
        return (x.reshape(-1) @ A.T).reshape(x.shape)

    z = torch.zeros(2, 3, dtype=torch.float64)
    rho = torch.linalg.eigvals(A).abs().max()
    for product in ("vjp", "jvp"):
        est = jsrr(f, z, n_iter=60, product=product, generator=torch.Generator().manual_seed(1))
        torch.testing.assert_close(est.sqrt(), rho, rtol=1e-6, atol=0)
    # one iteration: E||J^T v||^2 over random unit v is ||J||_F^2 / n (Hutchinson), well below rho^2 here
    gen = torch.Generator().manual_seed(2)
    mean = torch.stack([jsrr(f, z, n_iter=1, generator=gen) for _ in range(4000)]).mean()
    fro = (A**2).sum() / n
    assert abs(mean - fro) < 0.05 * fro and mean < 0.5 * rho**2


def _tiny_ouro(**kw):
    torch.manual_seed(0)
    cfg = OuroConfig(vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                     num_key_value_heads=2, total_ut_steps=2, **kw)
    return OuroForCausalLM(cfg).train()


def test_stars_loss_on_ouro_switches_to_eager_attention():
    model = _tiny_ouro()
    assert model.config._attn_implementation == "sdpa"
    ids = torch.randint(0, 50, (2, 5), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    out = model(ids, attention_mask=mask, labels=ids)
    stars = STARSRegularizer(reg_weight=0.25, n_iter=2)
    total, reg = stars(model, out, step=0)
    assert model.config._attn_implementation == "sdpa"  # restored
    # the same estimate by hand: one loop of the model at the detached last state
    with attention_implementation(model, "eager"):
        gen = torch.Generator().manual_seed(0)
        by_hand = jsrr(model.loop_function(out), out.loop_hidden_states[-1], n_iter=2, generator=gen)
    torch.testing.assert_close(reg, by_hand)
    torch.testing.assert_close(total, 0.75 * out.loss + 0.25 * reg)
    total.backward()  # double backward through attention
    grads = {n: p.grad for n, p in model.named_parameters()}
    assert all(g is not None and torch.isfinite(g).all() for g in grads.values())
    # the regularizer's gradient reaches the loop weights but not the embeddings (the state is detached)
    model.zero_grad()
    stars.regularizer(model, model(ids, attention_mask=mask, labels=ids), 0).backward()
    assert model.model.embed_tokens.weight.grad is None
    assert model.model.layers[0].self_attn.q_proj.weight.grad.abs().sum() > 0
    # without the switch, CPU SDPA has no double backward
    with pytest.raises(RuntimeError, match="not implemented"):
        STARSRegularizer(attn_implementation=None)(model, model(ids, labels=ids), 0)[0].backward()


def test_warmup_random_state_and_jvp():
    model = _tiny_ouro()
    ids = torch.randint(0, 50, (2, 5), generator=torch.Generator().manual_seed(0))
    out = model(ids, labels=ids, total_ut_steps=4)
    stars = STARSRegularizer(reg_weight=0.1, warmup_steps=3, state="random", product="jvp")
    total, reg = stars(model, out, step=2)
    assert reg is None and total is out.loss
    total, reg = stars(model, out, step=3)
    assert reg is not None and torch.isfinite(reg)
    total.backward()
    # "random" linearizes at a loop drawn from (seed, step): deterministic, and not always the same loop
    chosen = set()
    for step in range(3, 11):
        reg = stars.regularizer(model, out, step)
        torch.testing.assert_close(reg, stars.regularizer(model, out, step))
        with attention_implementation(model, "eager"):
            candidates = [jsrr(model.loop_function(out), h, product="jvp",
                               generator=torch.Generator().manual_seed(step)) for h in out.loop_hidden_states]
        matches = [i for i, c in enumerate(candidates) if torch.allclose(c, reg)]
        assert len(matches) == 1
        chosen.add(matches[0])
    assert len(chosen) > 1


def test_max_batch_linearizes_at_a_batch_prefix():
    model = _tiny_ouro()
    ids = torch.randint(0, 50, (4, 5), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    out = model(ids, attention_mask=mask, labels=ids)
    reg = STARSRegularizer(max_batch=2, n_iter=2).regularizer(model, out, step=7)
    sub = model(ids[:2], attention_mask=mask[:2])  # the same two sequences alone
    with attention_implementation(model, "eager"):
        gen = torch.Generator().manual_seed(7)
        expected = jsrr(model.loop_function(sub), sub.loop_hidden_states[-1], n_iter=2, generator=gen)
    torch.testing.assert_close(reg, expected)
    full = STARSRegularizer(n_iter=2).regularizer(model, out, step=7)
    assert not torch.allclose(reg, full)
    with pytest.raises(ValueError, match="max_batch=0 is out of range"):
        STARSRegularizer(max_batch=0)


def test_bad_input():
    for bad in (1.0, -0.1, 1.5):
        with pytest.raises(ValueError, match=r"reg_weight=.* is out of range; allowed values lie in \[0.0, 1.0\)"):
            STARSRegularizer(reg_weight=bad)
    with pytest.raises(ValueError, match="product='jacobian' is not allowed"):
        STARSRegularizer(product="jacobian")
    with pytest.raises(ValueError, match="state='first' is not allowed"):
        STARSRegularizer(state="first")
    with pytest.raises(ValueError, match="n_iter=0 is out of range"):
        STARSRegularizer(n_iter=0)
    with pytest.raises(ValueError, match="Unknown loop sampler 'gaussian'|gaussian"):
        loop_sampler("gaussian")
    with pytest.raises(ValueError, match="has no loop_hidden_states"):
        STARSRegularizer().regularizer(None, type("Out", (), {"loss": torch.tensor(1.0)})(), 0)


def test_sampler_presets():
    s = loop_sampler("ouro_finetune", seed=74)
    draws = [s(step) for step in range(4000)]
    assert min(draws) >= 1 and max(draws) <= 16
    assert abs(sum(draws) / len(draws) - 5.92) < 0.25  # notes: mean 5.92 for lognormal(1.7, 0.4) clipped [1, 16]
    assert draws == [loop_sampler("ouro_finetune", seed=74)(step) for step in range(4000)]  # same on every rank
    assert LOOP_SAMPLER_PRESETS["addition"]["mu"] == 2.0
    assert loop_sampler("addition", max_loops=8)(0) <= 8
