"""The FPSA operator on its own (float64): exactness of one step, the fixed point, implicit gradients against finite
differences and a full unroll, the masked adjoint, a causal / RoPE / GQA decoder setup built from transformers' Llama
pieces, the statistics helpers, learned halting and the bad-input errors."""

import math

import pytest
import torch
from torch import nn
from transformers import LlamaConfig
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.models.bert.modeling_bert import eager_attention_forward
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaRotaryEmbedding, apply_rotary_pos_emb

from hf_fixedpoint.core import fp_fpsa
from hf_fixedpoint.core.fp_fpsa import FPSAHaltingGate, fpsa_attention
from hf_fixedpoint.core.fp_fpsa_settings import FPSA_DEFAULTS, pop_fpsa_kwargs
from hf_fixedpoint.core.fp_fpsa_stats import FPSAStats

B, T, H, DH = 2, 5, 2, 4
D = H * DH


class Block(nn.Module):
    """A tiny post-norm attention block: q, k, v, o projections and the norm of the residual_norm form."""

    def __init__(self, scale=0.3):
        super().__init__()
        torch.manual_seed(0)
        self.q, self.k, self.v, self.o = (nn.Linear(D, D) for _ in range(4))
        for lin in (self.q, self.k, self.v, self.o):
            nn.init.normal_(lin.weight, std=scale)
        self.norm = nn.LayerNorm(D)
        self.training = False
        self.is_causal = False  # an encoder block (transformers' attention functions default to causal)
        self.double()

    def heads(self, t):
        return t.view(*t.shape[:-1], H, DH).transpose(1, 2)

    def run(self, x, fp, mask=None, **kw):
        return fpsa_attention(self, x, query=lambda z: self.heads(self.q(z)), key=lambda z: self.heads(self.k(z)),
                              value=self.heads(self.v(x)), out_proj=self.o, norm=self.norm,
                              attention_fn=eager_attention_forward, scaling=DH ** -0.5, fp_kwargs=fp,
                              attention_mask=mask, **kw)

    def attention(self, z, x):
        """Reference: the per-head outputs (B, T, H, d) of softmax(Q(z) K(z)^T / sqrt(d)) V(x)."""
        a = torch.softmax(self.heads(self.q(z)) @ self.heads(self.k(z)).transpose(-1, -2) * DH ** -0.5, -1)
        return (a @ self.heads(self.v(x))).transpose(1, 2)


def fp(**kw):
    base = {"solver": "picard", "tol": 1e-12, "max_iter": 200, "backward": "ift",
            "backward_kwargs": {"solver": "anderson", "tol": 1e-12, "max_iter": 200}}
    return {**base, **kw}


def x_input():
    return torch.randn(B, T, D, dtype=torch.float64, generator=torch.Generator().manual_seed(1))


def test_one_step_is_the_plain_attention():
    blk, x = Block(), x_input()
    res = blk.run(x, fp(max_iter=1))
    torch.testing.assert_close(res.output, blk.attention(x, x).flatten(2), rtol=0, atol=0)
    assert res.iterations.shape == (B, T, H) and bool((res.iterations == 1).all()) and not res.converged.any()


@pytest.mark.parametrize("update", ["residual_norm", "plain"])
def test_converged_iterate_is_a_fixed_point(update):
    blk, x = Block(), x_input()
    with torch.no_grad():
        res = blk.run(x, fp(), update=update)
    o = res.output.view(B, T, H, DH)
    z = blk.o(o.flatten(2))
    z = blk.norm(x + z) if update == "residual_norm" else z
    assert res.converged.all() and res.iterations.min() >= 3
    torch.testing.assert_close(blk.attention(z, x), o, rtol=0, atol=1e-10)


@pytest.mark.parametrize("update", ["residual_norm", "plain"])
def test_update_scale_reinjects_a_share_of_the_heads_output(update):
    """``update_scale=beta`` is the map with ``W_O`` scaled by ``beta`` in the iterate: the same fixed point and
    counts, exactly; the first step stays the base model's. Pre-norm (``x = norm(R)``, as in ViT and LLaMA): as
    ``beta -> 0`` the iterate goes to ``x`` and the fixed point to the first step, the base model's attention."""
    blk, x = Block(), x_input()
    with torch.no_grad():
        scaled = blk.run(x, fp(), update=update, update_scale=0.3)
        first = blk.run(x, fp(max_iter=1), update_scale=0.3).output
        pre_norm = {"residual": x, "update": update}
        pre_first = blk.run(blk.norm(x), fp(max_iter=1), **pre_norm).output
        tiny = blk.run(blk.norm(x), fp(), update_scale=1e-6, **pre_norm).output
        full = blk.run(blk.norm(x), fp(), **pre_norm).output
        blk.o.weight.mul_(0.3)
        blk.o.bias.mul_(0.3)
        reference = blk.run(x, fp(), update=update)
    assert scaled.converged.all()
    torch.testing.assert_close(scaled.output, reference.output, rtol=0, atol=1e-10)
    assert bool((scaled.iterations == reference.iterations).all())
    torch.testing.assert_close(first, blk.attention(x, x).flatten(2), rtol=0, atol=0)
    if update == "residual_norm":
        assert (tiny - pre_first).abs().max() < 1e-5 < (full - pre_first).abs().max()


def test_tanh_step_norm_and_temperature():
    blk, x = Block(), x_input()
    with torch.no_grad():
        plain = blk.run(x, fp()).output
        tanh = blk.run(x, fp(), step_norm="tanh").output
        hot = blk.run(x, fp(max_iter=1), log_temperature=torch.full((H,), 0.5, dtype=torch.float64)).output
    torch.testing.assert_close(tanh, plain, rtol=0, atol=1e-10)  # same fixed point
    blk.q.weight.data *= torch.exp(torch.tensor(-0.5, dtype=torch.float64))  # tau = e^0.5 divides the logits
    blk.q.bias.data *= torch.exp(torch.tensor(-0.5, dtype=torch.float64))
    torch.testing.assert_close(hot, blk.attention(x, x).flatten(2))


def test_ift_gradient_matches_finite_differences_and_unroll():
    blk, x = Block(), x_input().requires_grad_()
    w = torch.randn(B, T, D, dtype=torch.float64, generator=torch.Generator().manual_seed(2))

    def loss(backward="ift", **kw):
        return (blk.run(x, fp(backward=backward, **kw)).output * w).sum()

    gx_ift, gq_ift = torch.autograd.grad(loss(), (x, blk.q.weight))
    gx_bptt, gq_bptt = torch.autograd.grad(loss("bptt", backward_kwargs={}), (x, blk.q.weight))
    torch.testing.assert_close(gx_ift, gx_bptt, rtol=1e-8, atol=1e-10)
    torch.testing.assert_close(gq_ift, gq_bptt, rtol=1e-8, atol=1e-10)
    # central finite differences on a few input entries
    for idx in [(0, 0, 0), (1, 3, 5), (0, 4, 7)]:
        e = torch.zeros_like(x)
        e[idx] = 1e-6
        with torch.no_grad():
            fd = (loss_at(blk, x + e, w) - loss_at(blk, x - e, w)) / 2e-6
        assert float(fd) == pytest.approx(float(gx_ift[idx]), rel=1e-5, abs=1e-8)


def loss_at(blk, x, w):
    return (blk.run(x, fp()).output * w).sum()


def test_adjoint_mask_drops_the_implicit_term_of_unconverged_entries():
    # Nothing converges in 3 steps at tol 1e-12: with the mask the adjoint is u = dL/dz*, i.e. the one-step gradient.
    blk, x = Block(), x_input()
    w = torch.randn(B, T, D, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    grads = {}
    for name, kw in {"masked": {}, "one_step": {"backward": "one_step", "backward_kwargs": {}},
                     "unmasked": {"adjoint_mask": False}}.items():
        extra = {k: v for k, v in kw.items() if k == "adjoint_mask"}
        res = blk.run(x, fp(max_iter=3, **{k: v for k, v in kw.items() if k != "adjoint_mask"}), **extra)
        assert not res.converged.any()
        (grads[name],) = torch.autograd.grad((res.output * w).sum(), blk.k.weight)
    torch.testing.assert_close(grads["masked"], grads["one_step"], rtol=1e-10, atol=1e-12)
    assert (grads["unmasked"] - grads["masked"]).abs().max() > 1e-6


def test_per_entry_freezing_matches_separate_runs():
    # An entry's result does not depend on its batch-mates: sample 0 alone gives the same output and counts.
    blk, x = Block(), x_input()
    with torch.no_grad():
        both = blk.run(x, fp(tol=1e-6))
        alone = blk.run(x[:1], fp(tol=1e-6))
    torch.testing.assert_close(both.output[:1], alone.output, rtol=0, atol=1e-12)
    assert torch.equal(both.iterations[:1], alone.iterations)
    assert both.iterations.unique().numel() > 1  # tokens/heads stop at different iterations


@pytest.mark.parametrize("halt_unit", ["head", "token", "state"])
@pytest.mark.parametrize("attention_fn", [eager_attention_forward, sdpa_attention_forward])
def test_converged_tokens_drop_out_of_the_work(halt_unit, attention_fn, monkeypatch):
    """The forward solve recomputes iterates, queries, keys and score rows for tokens with an open entry only (cached
    keys for the others): the same outputs and per-entry counts as recomputing every token, with a padding mask,
    samples that finish early (compaction) and a learned temperature; and it does less work."""
    monkeypatch.setattr(fp_fpsa, "DENSE_OPEN_FRACTION", math.inf)  # the open-token path whenever a token is frozen
    blk = Block()
    x = torch.randn(3, 7, D, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    x[0] *= 0.1  # an easy sample that finishes first
    pad = torch.ones(3, 7, dtype=torch.bool)
    pad[1, 5:] = False
    masks = {"none": None, "keys": torch.where(pad, 0.0, -1e9)[:, None, None, :].double(),
             "rows": (pad[:, None, :, None] & pad[:, None, None, :]).expand(3, 1, 7, 7)}
    tau = torch.tensor([0.2, -0.3], dtype=torch.float64)
    evaluated = []

    def counting(module, q, k, v, mask, **kw):
        evaluated.append(q.shape[0] * q.shape[2])
        return attention_fn(module, q, k, v, mask, **kw)

    for name, mask in masks.items():
        runs = {}
        for mode in ("sparse", "dense"):
            evaluated.clear()
            with torch.no_grad():
                res = fpsa_attention(
                    blk, x, query=lambda z, *e: blk.heads(blk.q(z)), key=lambda z, *e: blk.heads(blk.k(z)),
                    value=blk.heads(blk.v(x)), out_proj=blk.o, norm=blk.norm, attention_fn=counting,
                    scaling=DH ** -0.5, fp_kwargs=fp(tol=1e-8), attention_mask=mask,
                    log_temperature=tau, halt_unit=halt_unit,
                    # a batch-first extra input that the callables ignore keeps the dense path (recompute every token)
                    extra=() if mode == "sparse" else (torch.zeros(3, dtype=torch.float64),))
            runs[mode] = (res, sum(evaluated))
        (sparse, work), (dense, dense_work) = runs["sparse"], runs["dense"]
        torch.testing.assert_close(sparse.output, dense.output, rtol=0, atol=1e-12, msg=lambda m: f"{name}: {m}")
        assert torch.equal(sparse.iterations, dense.iterations) and torch.equal(sparse.converged, dense.converged)
        assert sparse.converged.all() and sparse.iterations.unique().numel() > 1
        assert work < dense_work, (name, work, dense_work)  # fewer query rows attended


@pytest.mark.parametrize("halt_unit", ["head", "token", "state"])
@pytest.mark.parametrize("mask_kind", ["none", "rows"])
def test_dense_dispatch_matches_the_open_token_path(halt_unit, mask_kind, monkeypatch):
    """``DENSE_OPEN_FRACTION``: an evaluation with at least that share of the working tokens open recomputes every
    token. The frozen tokens keep their values and the key cache stays current across dense -> open-token switches:
    forced dense, forced open-token and mixed dispatches give the same outputs and per-entry counts."""
    blk = Block()
    x = torch.randn(3, 7, D, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    x[0] *= 0.1  # an easy sample that finishes first (compaction)
    pad = torch.ones(3, 7, dtype=torch.bool)
    pad[1, 5:] = False
    rows = (pad[:, None, :, None] & pad[:, None, None, :]).expand(3, 1, 7, 7)  # per-query rows: the gather path
    mask = None if mask_kind == "none" else torch.where(rows, 0.0, -1e9).double()
    tau = torch.tensor([0.2, -0.3], dtype=torch.float64)
    real_map, open_fractions = fp_fpsa._open_tokens_map, []

    def recording_map(*a):  # the share of the working tokens open in each evaluation (1.0: active=None)
        f = real_map(*a)

        def g(o, *args, active=None):
            tokens = None if active is None else (active if active.dim() == 2 else active.any(-1))
            open_fractions.append(1.0 if tokens is None else tokens.double().mean().item())
            return f(o, *args, active=active)

        return g

    monkeypatch.setattr(fp_fpsa, "_open_tokens_map", recording_map)
    runs = {}
    for value in (math.inf, 0.0, 0.3, 0.6):
        monkeypatch.setattr(fp_fpsa, "DENSE_OPEN_FRACTION", value)
        open_fractions.clear()
        with torch.no_grad():
            runs[value] = blk.run(x, fp(tol=1e-8), mask, log_temperature=tau, halt_unit=halt_unit)
        if 0 < value < 1:  # some evaluations took each branch with frozen tokens present
            assert any(value <= f < 1 for f in open_fractions) and any(f < value for f in open_fractions), value
    ref = runs[math.inf]
    assert ref.converged.all() and ref.iterations.unique().numel() > 1
    for value, res in runs.items():
        torch.testing.assert_close(res.output, ref.output, rtol=0, atol=1e-12, msg=lambda m: f"{value}: {m}")
        assert torch.equal(res.iterations, ref.iterations) and torch.equal(res.converged, ref.converged), value


def test_causal_rope_gqa_decoder_reuse():
    """The operator inside a Llama attention: RoPE on Q, K from the iterate, GQA (4 query heads, 2 KV heads) and a
    causal mask handled by transformers' sdpa function; one step is exactly LlamaAttention, and at convergence earlier
    tokens ignore later ones."""
    cfg = LlamaConfig(hidden_size=16, num_attention_heads=4, num_key_value_heads=2, intermediate_size=32,
                      num_hidden_layers=1, vocab_size=10)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    attn = LlamaAttention(cfg, layer_idx=0).double().eval()
    rope = LlamaRotaryEmbedding(cfg)
    x = torch.randn(1, 6, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    cos, sin = (t.double() for t in rope(x, torch.arange(6)[None]))
    mask = torch.ones(6, 6, dtype=torch.bool).tril()[None, None]

    def heads(t):
        return t.view(*t.shape[:-1], -1, attn.head_dim).transpose(1, 2)

    def run(xx, max_iter):
        n = xx.shape[1]

        def q(z, c, s):
            return apply_rotary_pos_emb(heads(attn.q_proj(z)), heads(attn.q_proj(z)), c, s)[0]

        def k(z, c, s):
            return apply_rotary_pos_emb(heads(attn.k_proj(z)), heads(attn.k_proj(z)), c, s)[1]

        res = fpsa_attention(attn, xx, query=q, key=k, value=heads(attn.v_proj(xx)), out_proj=attn.o_proj,
                             norm=None, attention_fn=sdpa_attention_forward, scaling=attn.scaling,
                             fp_kwargs=fp(max_iter=max_iter), attention_mask=mask[..., :n, :n],
                             extra=(cos[:, :n], sin[:, :n]))
        return attn.o_proj(res.output)

    with torch.no_grad():
        torch.testing.assert_close(run(x, 1), attn(x, (cos, sin), mask)[0], rtol=0, atol=0)
        full, prefix = run(x, 200), run(x[:, :4], 200)
    torch.testing.assert_close(full[:, :4], prefix, rtol=0, atol=1e-10)


def test_stats_helpers_by_hand():
    its = torch.tensor([[[1, 2], [3, 16]], [[4, 4], [16, 2]]])  # (B=2, T=2, H=2), one layer
    conv = its < 16
    stats = FPSAStats(iterations_per_layer=[its], converged_per_layer=[conv], max_iter=16)
    assert stats.median == 3.5 and stats.nfe == 16 and stats.cap_hit_rate == 0.25
    assert stats.quantile(0.0) == 1.0 and stats.quantile(1.0) == 16.0
    stats.token_mask = torch.tensor([[True, False], [True, False]])  # drop the padded tokens
    assert stats.cap_hit_rate == 0.0 and stats.median == 3.0 and stats.all_converged
    s = stats.summary()
    assert s["fpsa_iter_mean"] == 2.75 and s["fpsa_iter_max"] == 4.0 and s["fpsa_converged_fraction"] == 1.0
    other = FPSAStats(iterations_per_layer=[torch.tensor([[[7, 16]]])], converged_per_layer=[torch.tensor([[[1, 0]]])
                      .bool()], max_iter=16)  # a second batch of another length
    merged = FPSAStats.merge([stats, other])
    assert merged.summary()["fpsa_iter_mean"] == (1 + 2 + 4 + 4 + 7 + 16) / 6 and merged.cap_hit_rate == 1 / 6


def test_learned_halting_gate_and_act():
    blk, x = Block(), x_input()
    gate = FPSAHaltingGate(H).double()
    gate.reset_parameters(4.0)
    feats = torch.randn(B, T, H, 3, dtype=torch.float64)
    torch.testing.assert_close(gate(feats), torch.full((B, T, H), 0.25, dtype=torch.float64))
    res = blk.run(x, fp(max_iter=8), halting="learned", halting_gate=gate,
                  margin_fn=lambda z: z[..., :3])
    assert bool((res.iterations == 4).all()) and res.ponder_cost.shape == (B, T, H)
    with torch.no_grad():
        gate.bias.fill_(20.0)  # p ~ 1: every entry halts after the exact first step
    torch.testing.assert_close(blk.run(x, fp(max_iter=8), halting="learned", halting_gate=gate).output,
                               blk.attention(x, x).flatten(2))


def test_jac_penalty_is_the_hutchinson_estimate_of_the_exact_jacobian():
    """``jac_penalty``: ``||e^T J||^2 / n`` for the Gaussian probe ``e`` drawn after the solve, with ``J`` the exact
    Jacobian of the FPSA map at the fixed point; differentiable into W_Q; absent without gradients or iterations."""
    blk, x = Block(), x_input()
    torch.manual_seed(123)  # Picard draws no random numbers: the probe is the first draw after this seed
    res = blk.run(x, fp(), jac_penalty=True)
    torch.manual_seed(123)
    probe = torch.randn(B, T, H, DH, dtype=torch.float64)
    o = res.output.detach().view(B, T, H, DH)

    def f(o):
        return blk.attention(blk.norm(x + blk.o(o.flatten(2))), x)

    jac = torch.autograd.functional.jacobian(f, o).reshape(o.numel(), o.numel())
    expected = (probe.flatten() @ jac).pow(2).sum() / o.numel()
    assert res.converged.all() and expected > 1e-4, expected
    torch.testing.assert_close(res.jac_penalty, expected, rtol=1e-9, atol=0)
    res.jac_penalty.backward()
    assert blk.q.weight.grad.abs().sum() > 0 and blk.k.weight.grad.abs().sum() > 0
    with torch.no_grad():
        assert blk.run(x, fp(), jac_penalty=True).jac_penalty is None
    assert blk.run(x, fp(max_iter=1), jac_penalty=True).jac_penalty is None
    assert blk.run(x, fp()).jac_penalty is None


def test_spectral_jac_penalty_is_the_power_iteration_hinge_of_the_exact_jacobian():
    """``jac_norm="spectral"``: per sample, ``JAC_POWER_ITERS`` normalised products ``v <- J_b^T v`` from the first
    Gaussian draw after the solve give ``rho_b``; the penalty is ``mean_b relu(rho_b - target)^2``, differentiable
    into W_Q, and zero (no gradient) once every ``rho_b`` is below the target."""
    from hf_fixedpoint.core.fp_fpsa import JAC_POWER_ITERS

    blk, x = Block(), x_input()
    torch.manual_seed(123)
    res = blk.run(x, fp(), jac_penalty=True, jac_norm="spectral", jac_target=0.0)
    torch.manual_seed(123)
    v = torch.randn(B, T, H, DH, dtype=torch.float64).reshape(B, -1)
    o = res.output.detach().view(B, T, H, DH)

    def f(o):
        return blk.attention(blk.norm(x + blk.o(o.flatten(2))), x)

    n = o[0].numel()
    jac = torch.autograd.functional.jacobian(f, o).reshape(B, n, B, n)
    rho = torch.stack([_power_rho(jac[b, :, b].T, v[b], JAC_POWER_ITERS) for b in range(B)])
    assert res.converged.all() and bool((rho > 0.05).all() and (rho < 0.99).all()), rho
    torch.testing.assert_close(res.jac_penalty, rho.square().mean(), rtol=1e-9, atol=0)
    torch.testing.assert_close(res.jac_rho, rho.mean(), rtol=1e-9, atol=0)
    res.jac_penalty.backward()
    assert blk.q.weight.grad.abs().sum() > 0
    blk.q.weight.grad = None
    high = blk.run(x, fp(), jac_penalty=True, jac_norm="spectral", jac_target=0.99)
    assert float(high.jac_penalty) == 0.0 and high.jac_rho < 0.99
    with pytest.raises(ValueError, match="fpsa_jac_norm"):
        blk.run(x, fp(), jac_penalty=True, jac_norm="nuclear")


def _power_rho(m, v, n_iter):
    """``||m v||`` after ``n_iter`` normalised products (the estimate ``spectral_radius`` returns)."""
    v = v / v.norm()
    for _ in range(n_iter):
        w = m @ v
        v = w / w.norm()
    return w.norm()


def test_token_halt_unit_one_count_per_token_same_fixed_point():
    """``halt_unit="token"``: a token's heads halt together on the relative Frobenius change of all its head outputs
    (the paper's rule); the fixed point is the one the per-head rule finds."""
    blk, x = Block(), x_input()
    with torch.no_grad():
        head = blk.run(x, fp(tol=1e-11))
        token = blk.run(x, fp(tol=1e-11), halt_unit="token")
        loose_head, loose_token = blk.run(x, fp(tol=1e-3)), blk.run(x, fp(tol=1e-3), halt_unit="token")
    assert token.converged.all() and token.iterations.shape == (B, T, H)
    assert bool((token.iterations == token.iterations[..., :1]).all())
    torch.testing.assert_close(token.output, head.output, rtol=0, atol=1e-9)
    assert not torch.equal(loose_token.iterations, loose_head.iterations)  # the knob changes the halting
    o = loose_token.output.view(B, T, H, DH)  # a halted token's last step changed it by less than tol (relative)
    step = blk.attention(blk.norm(x + blk.o(o.flatten(2))), x)
    change = (step - o).flatten(2).norm(dim=-1) / step.flatten(2).norm(dim=-1)
    assert float(change.max()) < 1e-3
    with pytest.raises(ValueError, match="fpsa_halt_unit='layer' is not allowed"):
        blk.run(x, fp(), halt_unit="layer")


def test_state_halt_unit_stops_each_token_on_the_change_of_its_iterate():
    """``halt_unit="state"``: a token halts once its iterate ``Z = norm(R + W_O O)`` (what the next queries and keys
    are computed from) changed by less than ``tol`` relative to its size, checked against the plain iteration written
    out here; the fixed point is the per-head rule's, and the looser criterion takes fewer iterations."""
    blk, x = Block(), x_input()
    tol = 1e-4

    def state(o):
        return blk.norm(x + blk.o(o.flatten(2)))

    with torch.no_grad():
        res = blk.run(x, fp(tol=tol), halt_unit="state")
        head = blk.run(x, fp(tol=tol))
        exact, head_exact = blk.run(x, fp(tol=1e-11), halt_unit="state"), blk.run(x, fp(tol=1e-11))
        # Reference: iterate every token without freezing; a token stops at the first step whose change of Z is
        # below tol, and is frozen there (an entry's later iterates do not feed back here: check the first token
        # to stop, whose batch-mates are all still open until then).
        o = blk.attention(x, x)
        first = torch.full((B, T), 0, dtype=torch.long)
        for k in range(2, 200):
            new = blk.attention(state(o), x)
            change = (state(new) - state(o)).norm(dim=-1) / state(new).norm(dim=-1)
            first = torch.where((first == 0) & (change < tol), k, first)
            o = new
            if bool((first > 0).all()):
                break
    assert bool((res.iterations == res.iterations[..., :1]).all()) and res.converged.all()
    counts = res.iterations[..., 0]
    earliest = counts.min()
    assert torch.equal(counts == earliest, first == earliest)  # the first tokens to stop, stop where the rule says
    torch.testing.assert_close(exact.output, head_exact.output, rtol=0, atol=1e-9)
    assert res.iterations.float().mean() < head.iterations.float().mean()
    o = res.output.view(B, T, H, DH)  # every halted token: its last step moved Z by less than tol (relative)
    new = blk.attention(state(o), x)
    assert float(((state(new) - state(o)).norm(dim=-1) / state(new).norm(dim=-1)).max()) < tol


def test_bad_input():
    blk, x = Block(), x_input()
    with pytest.raises(ValueError, match="fpsa_update='tied' is not allowed"):
        blk.run(x, fp(), update="tied")
    with pytest.raises(ValueError, match="fpsa_halting='learned' needs a halting_gate"):
        blk.run(x, fp(), halting="learned")
    with pytest.raises(ValueError, match=r"Unknown FPSA option\(s\) \['halt_units'\]; allowed: \[.*'halt_unit'"):
        blk.run(x, fp(), halt_units="state")
    with pytest.raises(ValueError, match="Unknown FPSA setting"):
        pop_fpsa_kwargs({"fpsa_tol": 1e-3})
    with pytest.raises(ValueError, match="fpsa_ponder_budget"):
        pop_fpsa_kwargs({"fpsa_ponder_budget": 0.5})
    with pytest.raises(ValueError, match="fpsa_learn_temperature"):
        pop_fpsa_kwargs({"fpsa_learn_temperature": "yes"})
    with pytest.raises(ValueError, match=r"fpsa_jac_weight=-1.0 is out of range"):
        pop_fpsa_kwargs({"fpsa_jac_weight": -1.0})
    with pytest.raises(ValueError, match=r"fpsa_jac_norm='l1'.*'frobenius', 'spectral'"):
        pop_fpsa_kwargs({"fpsa_jac_norm": "l1"})
    with pytest.raises(ValueError, match=r"fpsa_jac_target=1.0 is out of range"):
        pop_fpsa_kwargs({"fpsa_jac_target": 1.0})
    for bad in (0.0, 1.5):
        with pytest.raises(ValueError, match=rf"fpsa_update_scale={bad} is out of range"):
            pop_fpsa_kwargs({"fpsa_update_scale": bad})
        with pytest.raises(ValueError, match=rf"fpsa_update_scale={bad} is out of range"):
            blk.run(x, fp(), update_scale=bad)
    assert pop_fpsa_kwargs({}) == FPSA_DEFAULTS
