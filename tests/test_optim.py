"""AdamATan2 against its update rule, and the EMA helper."""

import math

import pytest
import torch

from hf_fixedpoint.optim import AdamATan2, ema_model


def test_adam_atan2_matches_the_update_rule_float64():
    torch.manual_seed(0)
    p = torch.randn(5, dtype=torch.float64, requires_grad=True)
    opt = AdamATan2([p], lr=0.1, betas=(0.8, 0.9), weight_decay=0.5)
    ref, m, v = p.detach().clone(), torch.zeros(5, dtype=torch.float64), torch.zeros(5, dtype=torch.float64)
    for t in range(1, 4):
        g = torch.randn(5, dtype=torch.float64)
        p.grad = g.clone()
        opt.step()
        ref = ref * (1 - 0.1 * 0.5)
        m = 0.8 * m + 0.2 * g
        v = 0.9 * v + 0.1 * g * g
        ref = ref - 0.1 / (1 - 0.8**t) * torch.atan2(m, v.sqrt() / math.sqrt(1 - 0.9**t))
        torch.testing.assert_close(p.detach(), ref, rtol=1e-14, atol=1e-15)


def test_adam_atan2_step_is_bounded_and_lr_zero_is_allowed():
    p = torch.zeros(3, requires_grad=True)
    p.grad = torch.tensor([1e6, -1e-9, 0.0])
    AdamATan2([p], lr=0.01, weight_decay=0.0).step()
    assert p.detach().abs().max() <= 0.01 * math.pi / 2 / (1 - 0.9) + 1e-6  # bias-corrected first step
    q = torch.ones(3, requires_grad=True)
    q.grad = torch.ones(3)
    AdamATan2([q], lr=0.0).step()  # the research code builds its optimizers with lr=0 and sets lr every step
    torch.testing.assert_close(q.detach(), torch.ones(3))


def test_adam_atan2_bad_arguments():
    p = [torch.zeros(1, requires_grad=True)]
    with pytest.raises(ValueError, match="lr must be a number >= 0"):
        AdamATan2(p, lr=-1.0)
    with pytest.raises(ValueError, match="betas"):
        AdamATan2(p, betas=(0.9, 1.0))
    with pytest.raises(ValueError, match="weight_decay"):
        AdamATan2(p, weight_decay=-0.1)


def test_ema_averages_parameters_and_copies_buffers():
    model = torch.nn.Linear(2, 1)
    model.register_buffer("table", torch.zeros(3))
    ema = ema_model(model, decay=0.9, warmup=0)
    w0 = model.weight.detach().clone()
    ema.update_parameters(model)  # the first update copies the parameters
    with torch.no_grad():
        model.weight.add_(1.0)
        model.table.fill_(7.0)
    ema.update_parameters(model)
    torch.testing.assert_close(ema.module.weight, 0.9 * w0 + 0.1 * (w0 + 1.0))
    torch.testing.assert_close(ema.module.table, torch.full((3,), 7.0))  # buffers follow the model, not averaged
    with pytest.raises(ValueError, match="decay"):
        ema_model(model, decay=1.0)
    with pytest.raises(ValueError, match="warmup"):
        ema_model(model, warmup=-1)


def test_ema_warmup_follows_a_short_run():
    # A weight moving from 0 to 1 over 300 steps: the plain 0.999 EMA still sits near the initialization (the bug that
    # made every short recipe run evaluate a near-random model); the warmed-up decay tracks the recent weights.
    steps = 300
    plain, warm = torch.nn.Linear(1, 1, bias=False), torch.nn.Linear(1, 1, bias=False)
    ema_plain, ema_warm = ema_model(plain, 0.999, warmup=0), ema_model(warm, 0.999)
    for t in range(steps + 1):
        for model, ema in ((plain, ema_plain), (warm, ema_warm)):
            with torch.no_grad():
                model.weight.fill_(t / steps)
            ema.update_parameters(model)
    assert ema_plain.module.weight.item() < 0.2
    assert ema_warm.module.weight.item() > 0.85
    # decay after n updates is min(0.999, (1 + n) / (10 + n)): the n = 1 update (weight 1/300) keeps 2/11 of the copy
    m = torch.nn.Linear(1, 1, bias=False)
    ema = ema_model(m, 0.999)
    with torch.no_grad():
        m.weight.fill_(0.0)
        ema.update_parameters(m)
        m.weight.fill_(1.0)
        ema.update_parameters(m)
    torch.testing.assert_close(ema.module.weight, torch.full((1, 1), 1 - 2 / 11))
