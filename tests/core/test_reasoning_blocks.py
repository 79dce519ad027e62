"""The shared puzzle-reasoning blocks of ``fp_reasoning``: losses, halting, carry, layers (float64 where exact)."""

import math

import pytest
import torch
from torch.nn import functional as F
from torch.profiler import profile

from hf_fixedpoint.core.fp_reasoning import (
    ShortConv,
    act_halt,
    new_carry,
    puzzle_loss,
    reset_carry,
    softmax_cross_entropy,
    stablemax_cross_entropy,
    swiglu_width,
    trunc_normal_,
    truncated_normal,
)


def test_stablemax_cross_entropy_float64():
    logits = torch.tensor([[[2.0, -1.0, 0.0]]], dtype=torch.float64)
    s = torch.tensor([3.0, 0.5, 1.0], dtype=torch.float64)  # x + 1 for x >= 0, 1 / (1 - x) below
    labels = torch.tensor([[0]])
    torch.testing.assert_close(stablemax_cross_entropy(logits, labels)[0, 0], -torch.log(s[0] / s.sum()))
    assert stablemax_cross_entropy(logits, torch.tensor([[-100]]))[0, 0] == 0
    # A logit of exactly 1 once made the unused 1 / (1 - x) branch send NaN into the gradient.
    x = torch.tensor([[[1.0, 0.5, -2.0]]], requires_grad=True)
    stablemax_cross_entropy(x, torch.tensor([[1]])).sum().backward()
    assert torch.isfinite(x.grad).all()


def test_softmax_cross_entropy_and_ignore():
    logits = torch.randn(2, 3, 5)
    labels = torch.tensor([[1, -100, 4], [0, 2, -100]])
    got = softmax_cross_entropy(logits, labels)
    ref = F.cross_entropy(logits.transpose(1, 2), labels, reduction="none", ignore_index=-100)
    torch.testing.assert_close(got, ref)


def test_puzzle_loss_values():
    logits = torch.tensor([[[5.0, 0.0], [0.0, 5.0]], [[5.0, 0.0], [5.0, 0.0]]], dtype=torch.float64)
    labels = torch.tensor([[0, 1], [0, -100]])
    q = torch.tensor([0.3, -0.2])
    loss, m = puzzle_loss(logits, labels, q, "softmax", q_loss_weight=0.5)
    ce = -F.log_softmax(torch.tensor([5.0, 0.0], dtype=torch.float64), 0)[0]
    lm = torch.stack([ce, ce])  # per-sample mean over supervised tokens
    qloss = F.binary_cross_entropy_with_logits(q, torch.ones(2), reduction="none")
    torch.testing.assert_close(loss, (lm + 0.5 * qloss).mean().float())
    assert m["exact"].tolist() == [True, True] and m["cell_accuracy"].tolist() == [1.0, 1.0]
    with pytest.raises(ValueError, match="loss_type='hinge' is not allowed"):
        puzzle_loss(logits, labels, q, "hinge")


def test_act_halt_rules():
    steps = torch.tensor([1, 2, 4])
    q = torch.tensor([1.0, -1.0, -1.0])
    assert act_halt(steps, q, 4, training=False).tolist() == [False, False, True]  # eval: lockstep to the cap
    assert act_halt(steps, q, 4, training=True).tolist() == [True, False, True]
    done = torch.tensor([False, True, False])
    assert act_halt(steps, q, 4, training=True, done=done).tolist() == [False, True, True]
    g = torch.Generator().manual_seed(0)
    # Exploration with probability 1: no slot halts before its random minimum in {2..4}; at 1 step none can.
    assert not act_halt(torch.ones(50, dtype=torch.long), torch.ones(50), 4, True, 1.0, generator=g).any()


def test_carry_reset_keeps_running_slots():
    carry = new_carry(None, 3, "cpu")
    fresh = {"h": torch.zeros(3, 2)}
    batch = {"input_ids": torch.tensor([[1], [2], [3]]), "labels": None, "puzzle_identifiers": torch.zeros(3)}
    carry = reset_carry(carry, batch, fresh)
    assert set(carry["data"]) == {"input_ids", "puzzle_identifiers"}
    carry["state"] = {"h": torch.ones(3, 2)}
    carry["steps"] = torch.tensor([2, 5, 1])
    carry["halted"] = torch.tensor([False, True, False])
    new = {"input_ids": torch.tensor([[7], [8], [9]]), "labels": None, "puzzle_identifiers": torch.zeros(3)}
    carry = reset_carry(carry, new, fresh)
    assert carry["data"]["input_ids"][:, 0].tolist() == [1, 8, 3]
    assert carry["steps"].tolist() == [2, 0, 1]
    assert carry["state"]["h"][:, 0].tolist() == [1.0, 0.0, 1.0]


def test_layer_helpers():
    assert swiglu_width(512, 4, 256) == 1536  # TRM's 512-wide blocks
    t = trunc_normal_(torch.empty(200_000), std=0.5)
    assert abs(t.std().item() - 0.5) < 5e-3 and t.abs().max() <= 2 * 0.5 / math.sqrt(0.7737) + 1e-4  # 2 sigmas
    conv = ShortConv(2, "2d", 3, prefix_len=1, grid_shape=(2, 3)).double()
    h = torch.randn(1, 7, 2, dtype=torch.float64)
    out = conv(h)
    torch.testing.assert_close(out[:, 0], h[:, 0], rtol=0, atol=0)  # the prefix bypasses the convolution
    img = h[:, 1:].transpose(1, 2).reshape(1, 2, 2, 3)
    ref = F.conv2d(img, conv.conv.weight, padding=1, groups=2).reshape(1, 2, 6).transpose(1, 2)
    torch.testing.assert_close(out[:, 1:], ref)
    with pytest.raises(ValueError, match="does not cover"):
        conv(torch.randn(1, 5, 2, dtype=torch.float64))
    assert math.isclose(float(ShortConv(2, "1d", 4, 0)(torch.ones(1, 6, 2)).shape[1]), 6)


def test_truncated_normal_draws_trunc_normals_distribution_without_a_host_read():
    """The training start noise: ``trunc_normal_``'s distribution (std 0.5, two sigmas of the underlying normal), its
    CDF within sampling noise of the truncated normal's, and no ``aten::_local_scalar_dense`` (``trunc_normal_``
    itself reads the host in torch 2.13)."""
    with profile() as prof:
        t = truncated_normal((200_000,), std=0.5, generator=torch.Generator().manual_seed(0))
    assert all(e.key != "aten::_local_scalar_dense" for e in prof.key_averages())
    scale = 0.5 / math.sqrt(0.7737413)  # the underlying normal's std: 0.5 / sqrt(variance of N(0,1) on [-2, 2])
    assert abs(t.std().item() - 0.5) < 5e-3 and t.abs().max() <= 2 * scale + 1e-4

    def phi(x):
        return (1 + math.erf(x / math.sqrt(2))) / 2

    for x in (-1.5, -0.5, 0.0, 0.7, 1.9):  # the truncated normal's CDF on the standardized scale
        want = (phi(x) - phi(-2)) / (phi(2) - phi(-2))
        assert abs((t / scale < x).double().mean().item() - want) < 5e-3, x


def test_one_d_conv_is_causal_float64():
    # The research code's Conv1d(padding=k-1) truncated to the first T outputs: position t reads t-k+1 .. t.
    torch.manual_seed(0)
    conv = ShortConv(3, "1d", 4, prefix_len=2).double()
    h = torch.randn(2, 9, 3, dtype=torch.float64)
    out = conv(h)
    grid = h[:, 2:].transpose(1, 2)
    ref = F.conv1d(grid, conv.conv.weight, padding=3, groups=3)[..., :7].transpose(1, 2)
    torch.testing.assert_close(out[:, 2:], ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out[:, :2], h[:, :2], rtol=0, atol=0)
    late = h.clone()
    late[:, -1] += 1.0  # changing the last position leaves every earlier output as it was
    torch.testing.assert_close(conv(late)[:, :-1], out[:, :-1], rtol=0, atol=0)
    skip = ShortConv(3, "1d", 4, prefix_len=2, skip=True).double()
    skip.load_state_dict(conv.state_dict())
    torch.testing.assert_close(skip(h)[:, 2:], h[:, 2:] + ref, rtol=1e-12, atol=1e-12)


def test_sequence_mlp_block_normalizes_over_the_sequence_float64():
    # TRM's mlp_t block on h (B, T, D): u = h^T (B, D, T); u = rms_norm_T(u + swiglu_T(u)); back to (B, T, D); then
    # the hidden-axis MLP with its post-norm. The RMS of each (sample, channel) over the T positions is 1 after the
    # token-mixing half.
    from hf_fixedpoint.core.fp_reasoning import ReasoningBlock, SequenceMLP, SwiGLU

    torch.manual_seed(0)
    mixer, mlp = SequenceMLP(5, 4.0, 8), SwiGLU(6, 16)
    block = ReasoningBlock(mixer, mlp, "post").double()
    h = torch.randn(2, 5, 6, dtype=torch.float64)

    def rms(t):
        return t / torch.sqrt(t.pow(2).mean(-1, keepdim=True) + 1e-5)

    u = h.transpose(1, 2)
    u = rms(u + mixer.mlp(u)).transpose(1, 2)
    ref = rms(u + mlp(u))
    torch.testing.assert_close(block(h), ref, rtol=1e-12, atol=1e-12)


def test_rotary_in_float32_for_bfloat16_activations():
    # The research code runs bf16 activations but rotates q and k in float32 (its cos/sin tables) and casts back.
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    from hf_fixedpoint.core.fp_reasoning import Attention, rotary_tables

    torch.manual_seed(0)
    att = Attention(32, 2)
    x = torch.randn(2, 50, 32).bfloat16()
    cos, sin = rotary_tables(16, 50)
    got = att(x, (cos, sin, apply_rotary_pos_emb))
    q, k, v = att.qkv_proj(x).view(2, 50, 3, 2, 16).permute(2, 0, 3, 1, 4)
    qr, kr = apply_rotary_pos_emb(q.float(), k.float(), cos, sin, unsqueeze_dim=0)
    out = F.scaled_dot_product_attention(qr.bfloat16(), kr.bfloat16(), v)
    ref = att.o_proj(out.transpose(1, 2).reshape(2, 50, 32))
    torch.testing.assert_close(got, ref, rtol=0, atol=0)
