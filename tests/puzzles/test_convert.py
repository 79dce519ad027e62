"""hf_fixedpoint.puzzles.convert: research-code checkpoints of TRM, URM and FPRM, in their key layout (written here
with random tensors), become this project's models whose outputs equal the research code's forward, written out here
from the same raw tensors in float64."""

import math

import pytest
import torch
import yaml
from torch.nn import functional as F

from hf_fixedpoint.puzzles.convert import convert, main

D, HEADS, VOCAB, SEQ, IDS = 16, 2, 11, 9, 3
INTER = 256  # round(4 * 16 * 2 / 3) = 43, rounded up to a multiple of 256 as the research code does


def rand(*shape, std=0.3, seed=[0]):
    """float64 values that float32 holds exactly (the converted weights are float32; the test runs in float64)."""
    seed[0] += 1
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed[0])) * std).double()


def rms(t):
    return t / torch.sqrt(t.pow(2).mean(-1, keepdim=True) + 1e-5)


def rotary(S):
    """The research code's RotaryEmbedding tables (computed in float32)."""
    inv = 1.0 / (10000.0 ** (torch.arange(0, D // HEADS, 2, dtype=torch.float32) / (D // HEADS)))
    emb = torch.cat([torch.outer(torch.arange(S, dtype=torch.float32), inv)] * 2, -1)
    return emb.cos().double(), emb.sin().double()


def attention(sd, p, h, rope, causal=False):
    B, S, _ = h.shape
    qkv = (h @ sd[p + "self_attn.qkv_proj.weight"].T).view(B, S, 3 * HEADS, D // HEADS)
    q, k, v = qkv[:, :, :HEADS], qkv[:, :, HEADS:2 * HEADS], qkv[:, :, 2 * HEADS:]
    if rope:
        cos, sin = rotary(S)

        def rot(t):
            a, b = t.chunk(2, -1)
            return torch.cat([-b, a], -1)

        q, k = (t * cos[:, None] + rot(t) * sin[:, None] for t in (q, k))
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal)
    return out.transpose(1, 2).reshape(B, S, D) @ sd[p + "self_attn.o_proj.weight"].T


def swiglu(sd, p, x):
    gate, up = (x @ sd[p + "gate_up_proj.weight"].T).chunk(2, -1)
    return (F.silu(gate) * up) @ sd[p + "down_proj.weight"].T


def embed(sd, ids, pids, P):
    x = sd["embed_tokens.embedding_weight"][ids]
    if P:
        pe = F.pad(sd["puzzle_emb.weights"][pids], (0, P * D - sd["puzzle_emb.weights"].shape[1]))
        x = torch.cat([pe.view(-1, P, D), x], 1)
    if "embed_pos.embedding_weight" in sd:  # pos_encodings="learned"
        x = 0.707106781 * (x + sd["embed_pos.embedding_weight"])
    return math.sqrt(D) * x


def shared(sd, layer_prefix, layers, mlp_t=False, conv=False):
    sd.update({"embed_tokens.embedding_weight": rand(VOCAB, D), "lm_head.weight": rand(VOCAB, D),
               "q_head.weight": rand(2, D), "q_head.bias": rand(2), "puzzle_emb.weights": rand(IDS, D)})
    for i in range(layers):
        p = f"{layer_prefix}{i}."
        if mlp_t:
            sd[p + "mlp_t.gate_up_proj.weight"] = rand(2 * INTER, SEQ + 2)
            sd[p + "mlp_t.down_proj.weight"] = rand(SEQ + 2, INTER)
        else:
            sd[p + "self_attn.qkv_proj.weight"] = rand(3 * D, D)
            sd[p + "self_attn.o_proj.weight"] = rand(D, D)
        sd[p + "mlp.gate_up_proj.weight"] = rand(2 * INTER, D)
        sd[p + "mlp.down_proj.weight"] = rand(D, INTER)
        if conv:
            sd[p + "mlp.dwconv.weight"] = rand(INTER, 1, 2).bfloat16()  # URM keeps its conv in bf16
            sd[p + "mlp.dwconv.bias"] = rand(INTER).bfloat16()
    return sd


def compiled(sd):
    """The research code saves the compiled loss-head wrapper's state dict."""
    return {f"_orig_mod.model.inner.{k}": v for k, v in sd.items()}


def batch():
    g = torch.Generator().manual_seed(0)
    return torch.randint(1, VOCAB, (4, SEQ), generator=g), torch.randint(0, IDS, (4,), generator=g)


META = {"vocab_size": VOCAB, "seq_len": SEQ, "num_puzzle_identifiers": IDS}


def heads(sd, y, P):
    return (y @ sd["lm_head.weight"].T)[:, P:], y[:, 0] @ sd["q_head.weight"][0] + sd["q_head.bias"][0]


@pytest.mark.parametrize("mlp_t,pos", [(False, "rope"), (True, "none"), (False, "learned")])
def test_trm_checkpoint_equals_the_research_forward_float64(mlp_t, pos, tmp_path):
    sd = shared({"H_init": rand(D, std=1.0), "L_init": rand(D, std=1.0)}, "L_level.layers.", 2, mlp_t=mlp_t)
    if pos == "learned":  # the research code's CastedEmbedding over the puzzle prefix and the grid
        sd["embed_pos.embedding_weight"] = rand(2 + SEQ, D)
    cfg = {"arch": {"name": "recursive_reasoning.trm@TinyRecursiveReasoningModel_ACTV1", "H_cycles": 2, "L_cycles": 2,
                    "H_layers": 0, "L_layers": 2, "hidden_size": D, "num_heads": HEADS, "expansion": 4,
                    "puzzle_emb_ndim": D, "puzzle_emb_len": 2, "pos_encodings": pos,
                    "halt_max_steps": 16, "halt_exploration_prob": 0.1, "forward_dtype": "float64", "mlp_t": mlp_t,
                    "no_ACT_continue": True, "loss": {"loss_type": "stablemax_cross_entropy"}}}
    model = convert(compiled(sd), cfg, META).double()
    ids, pids = batch()

    def block(h, i):
        p = f"L_level.layers.{i}."
        if mlp_t:
            t = h.transpose(1, 2)
            h = rms(t + swiglu(sd, p + "mlp_t.", t)).transpose(1, 2)
        else:
            h = rms(h + attention(sd, p, h, rope=pos == "rope"))
        return rms(h + swiglu(sd, p + "mlp.", h))

    def net(h, inj):
        h = h + inj
        for i in range(2):
            h = block(h, i)
        return h

    x = embed(sd, ids, pids, 2)
    y, z = sd["H_init"].expand(4, SEQ + 2, D), sd["L_init"].expand(4, SEQ + 2, D)
    for _ in range(2):
        for _ in range(2):
            z = net(z, y + x)
        y = net(y, z)
    logits, q = heads(sd, y, 2)
    with torch.no_grad():
        out = model(ids, pids)
    torch.testing.assert_close(out.logits, logits, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(out.q_halt_logits, q.float(), rtol=1e-6, atol=1e-6)
    assert model.config.puzzle_emb_len == 2 and model.config.halt_max_steps == 16 and model.config.mlp_t == mlp_t
    assert model.config.pos_encodings == pos
    if pos == "learned":
        torch.testing.assert_close(model.model.trunk.input.embed_pos.weight.double(),
                                   sd["embed_pos.embedding_weight"], rtol=0, atol=0)


def test_urm_checkpoint_equals_the_research_forward_float64():
    sd = shared({"init_hidden": rand(D, std=1.0)}, "layers.", 2, conv=True)
    cfg = {"arch": {"name": "urm.urm@URM", "loops": 16, "num_layers": 2, "hidden_size": D, "num_heads": HEADS,
                    "expansion": 4, "H_cycles": 2, "L_cycles": 3, "puzzle_emb_ndim": D, "pos_encodings": "rope",
                    "forward_dtype": "float64", "loss": {"loss_type": "stablemax_cross_entropy"}}}
    model = convert(compiled(sd), cfg, META).double()
    ids, pids = batch()

    def conv_swiglu(p, h):
        gate, up = (h @ sd[p + "gate_up_proj.weight"].T).chunk(2, -1)
        t = (F.silu(gate) * up).transpose(1, 2)
        c = F.conv1d(t, sd[p + "dwconv.weight"].double(), sd[p + "dwconv.bias"].double(), padding=1, groups=INTER)
        return F.silu(c[..., :t.shape[-1]]).transpose(1, 2) @ sd[p + "down_proj.weight"].T

    x = embed(sd, ids, pids, 1)
    h = sd["init_hidden"].expand(4, SEQ + 1, D)
    for _ in range(6):  # (H_cycles - 1) * L_cycles forward-only loops, then L_cycles loops
        h = h + x
        for i in range(2):
            p = f"layers.{i}."
            h = rms(h + attention(sd, p, h, rope=True))
            h = rms(h + conv_swiglu(p + "mlp.", h))
    logits, q = heads(sd, h, 1)
    with torch.no_grad():
        out = model(ids, pids)
    torch.testing.assert_close(out.logits, logits, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(out.q_halt_logits, q.float(), rtol=1e-6, atol=1e-6)
    assert model.config.fp_max_iter == 3 and model.config.halt_max_steps == 16


FPRM_CFG = {"name": "fixed_point_reasoning.fprm@FixedPointReasoningModel_ACTV1", "H_cycles": 3, "L_cycles": 6,
            "L_layers": 2, "n_backwards_L": 6, "hidden_size": D, "num_heads": HEADS, "expansion": 4,
            "puzzle_emb_len": 2, "puzzle_emb_ndim": D, "pos_encodings": "rope", "forward_dtype": "float64",
            "max_iter": 12, "max_iter_dist": "det", "max_iter_eval": 1000, "alpha_1_init": 0.75,
            "alpha_2_init": 0.25, "residual_scale": "input-independent", "outer_only": False, "norm_type": "pre-norm",
            "norm_placement": "none", "conv_type": "conv2d", "conv_kernel_size": 3, "conv_bias": False,
            "fp_thresh": 0.1, "stepsize": 1.0, "stepsize_decay_train": 0.9, "stepsize_decay_eval": 0.99,
            "decay_patience": 5, "init_std": 6.0, "softmax_temp": 1.0, "mlp_t": False, "no_ACT_continue": True,
            "normalize_input_injection": False, "variational_dropout": 0.0, "weight_dropout": 0.0,
            "loss": {"loss_type": "stablemax_cross_entropy", "q_loss_coeff": 0.5}}


def fprm_state():
    sd = shared({"L_level.conv.weight": rand(D, 1, 3, 3), "L_level.alpha_1_param": rand(D, std=1.0),
                 "L_level.alpha_2_param": rand(D, std=1.0)}, "L_level.layers.", 2)
    for i in range(2):  # FPRM's CastedLinear keeps a weight-dropout mask buffer
        sd[f"L_level.layers.{i}.self_attn.qkv_proj.mask"] = torch.ones(3 * D, D)
    return sd


@pytest.mark.parametrize("pos", ["rope", "learned"])
def test_fprm_checkpoint_equals_the_research_map_float64(pos, tmp_path):
    sd = fprm_state()
    if pos == "learned":
        sd["embed_pos.embedding_weight"] = rand(2 + SEQ, D)
    model = convert(compiled(sd), {"arch": {**FPRM_CFG, "pos_encodings": pos}}, META).double()
    ids, pids = batch()
    a1, a2 = torch.sigmoid(sd["L_level.alpha_1_param"]), torch.sigmoid(sd["L_level.alpha_2_param"])
    b2 = 1 - a2 * a1**4
    b1 = b2 * (1 - a1) / (1 - a1**4 + 1e-5)
    x = embed(sd, ids, pids, 2)

    def f(y):  # the research code's FixedPointTransformer: the conv replaces the grid, then scaled pre-norm blocks
        grid = y[:, 2:].reshape(4, 3, 3, D).permute(0, 3, 1, 2)
        grid = F.conv2d(grid, sd["L_level.conv.weight"], padding=1, groups=D).permute(0, 2, 3, 1).reshape(4, 9, D)
        h = a2 * torch.cat([y[:, :2], grid], 1) + b2 * x
        for i in range(2):
            p = f"L_level.layers.{i}."
            h = a1 * h + b1 * attention(sd, p, rms(h), rope=pos == "rope")
            h = a1 * h + b1 * swiglu(sd, p + "mlp.", rms(h))
        return h

    y = rand(4, SEQ + 2, D, std=2.0)
    with torch.no_grad():
        torch.testing.assert_close(model.model.step_map(y, model.model.trunk.embed(ids, pids)), f(y), rtol=1e-10,
                                   atol=1e-10)
        logits, q = model.heads(y)
    ref_logits, ref_q = heads(sd, y, 2)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(q, ref_q.float(), rtol=1e-6, atol=1e-6)
    c = model.config  # max_iter supervision steps of n_backwards_L solver steps; the research code's solver
    assert (c.halt_max_steps, c.fp_max_iter, c.bptt_window, c.fp_eval_max_iter, c.fp_tol) == (12, 72, 6, 1000, 0.1)
    assert (c.solve_mode, c.conv, c.grid_shape, c.init_std, c.pad_id) == ("official", "2d", [3, 3], 6.0, None)
    assert c.fp_solver_kwargs == {"step_size": 1.0, "patience": 5, "decay": 0.9} and c.eval_step_decay == 0.99


def test_command_line_and_refusals(tmp_path):
    sd = fprm_state()
    torch.save(compiled({k: v.float() for k, v in sd.items()}), tmp_path / "ckpt.pt")
    (tmp_path / "all_config.yaml").write_text(yaml.safe_dump({"arch": {**FPRM_CFG, "forward_dtype": "float32"}}))
    main(["--checkpoint", str(tmp_path / "ckpt.pt"), "--config", str(tmp_path / "all_config.yaml"), "--seq_len", "9",
          "--output_dir", str(tmp_path / "out")])
    from transformers import AutoModelForTokenClassification

    loaded = AutoModelForTokenClassification.from_pretrained(tmp_path / "out", trust_remote_code=True)
    assert loaded.config.num_puzzle_identifiers == IDS and loaded.config.vocab_size == VOCAB
    with pytest.raises(ValueError, match="the checkpoint's softmax_temp=2.0 has no counterpart"):
        convert(compiled(sd), {"arch": {**FPRM_CFG, "softmax_temp": 2.0}}, META)
    with pytest.raises(ValueError, match=r"the checkpoint's pos_encodings='alibi' has no counterpart here "
                                         r"\(supported: \('rope', 'learned', 'none'\)\)"):
        convert(compiled(sd), {"arch": {**FPRM_CFG, "pos_encodings": "alibi"}}, META)
    with pytest.raises(RuntimeError, match="embed_pos"):  # pos_encodings="learned" without its table
        convert(compiled(sd), {"arch": {**FPRM_CFG, "pos_encodings": "learned"}}, META)
    with pytest.raises(ValueError, match=r"tensors with no counterpart in FPRM here: \['L_level.extra'\]"):
        convert(compiled({**sd, "L_level.extra": torch.zeros(1)}), {"arch": FPRM_CFG}, META)
    with pytest.raises(ValueError, match="pass the data's dataset.json"):
        convert(compiled(sd), {"arch": FPRM_CFG})
    with pytest.raises(ValueError, match="cannot tell the family"):
        convert(compiled(sd), {"arch": {**FPRM_CFG, "name": "mystery@Model"}}, META)
