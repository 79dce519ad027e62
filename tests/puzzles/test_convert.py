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


def fprm_map(sd, x, pos="rope"):
    """The research code's FixedPointTransformer on the injection ``x``: the conv replaces the grid, then the scaled
    pre-norm blocks."""
    a1, a2 = torch.sigmoid(sd["L_level.alpha_1_param"]), torch.sigmoid(sd["L_level.alpha_2_param"])
    b2 = 1 - a2 * a1**4
    b1 = b2 * (1 - a1) / (1 - a1**4 + 1e-5)

    def f(y):
        B = y.shape[0]
        grid = y[:, 2:].reshape(B, 3, 3, D).permute(0, 3, 1, 2)
        grid = F.conv2d(grid, sd["L_level.conv.weight"], padding=1, groups=D).permute(0, 2, 3, 1).reshape(B, 9, D)
        h = a2 * torch.cat([y[:, :2], grid], 1) + b2 * x
        for i in range(2):
            p = f"L_level.layers.{i}."
            h = a1 * h + b1 * attention(sd, p, rms(h), rope=pos == "rope")
            h = a1 * h + b1 * swiglu(sd, p + "mlp.", rms(h))
        return h

    return f


@pytest.mark.parametrize("pos", ["rope", "learned"])
def test_fprm_checkpoint_equals_the_research_map_float64(pos, tmp_path):
    sd = fprm_state()
    if pos == "learned":
        sd["embed_pos.embedding_weight"] = rand(2 + SEQ, D)
    model = convert(compiled(sd), {"arch": {**FPRM_CFG, "pos_encodings": pos}}, META).double()
    ids, pids = batch()
    f = fprm_map(sd, embed(sd, ids, pids, 2), pos)
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
    assert c.fp_solver_kwargs == {"step_size": 1.0, "patience": 5, "decay": 0.9, "improve_margin": 0.0}
    assert c.eval_step_decay == 0.99


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


def restart_rand():
    """Restart ``rand``'s draws, so that a test gets the same tensors whichever tests ran before it."""
    rand.__kwdefaults__["seed"][0] = 0


def research_decay_and_margin(cfg, training):
    """The research optimizer's decay and improvement margin: the single-decay version (``stepsize_decay``, commit
    9e0ebf35) decays by it in training and evaluation and counts a new lowest residual only ``1e-2`` below the best;
    the train/eval-split version (``stepsize_decay_train`` / ``_eval``) picks by mode and counts any decrease."""
    if "stepsize_decay" in cfg:
        return cfg["stepsize_decay"], 1e-2
    return cfg["stepsize_decay_train" if training else "stepsize_decay_eval"], 0.0


def research_residual(y, fy):
    return ((y - fy).abs().amax(-1) / (fy.abs().amax(-1) + 1e-8)).amax(-1)


def research_eval_call(f, st, cfg, call):
    """One evaluation call of the research code: ``FixedPointOptimizer.step`` once, then the batch-wide halting of
    ``FixedPointReasoningModel_ACTV1.forward`` (every residual below ``fp_thresh``, every step size below 1e-3, or
    ``max_iter_eval`` calls)."""
    decay, margin = research_decay_and_margin(cfg, training=False)
    fy = f(st["y"])
    res = research_residual(st["y"], fy)
    st["y"] = fy * st["s"] + st["y"] * (1 - st["s"])
    improved = res < st["best"] - margin
    st["best"] = torch.where(improved, res, st["best"])
    st["pat"] = torch.where(improved, cfg["decay_patience"], st["pat"] - 1)
    adapt = (st["pat"] <= 0) & (res >= cfg["fp_thresh"])
    st["pat"] = torch.where(adapt, cfg["decay_patience"], st["pat"])
    # The research code multiplies by torch.where(adapt, decay, 1), a float32 tensor: its step sizes carry float32
    # rounding (1e-8 relative), left out here so that the float64 comparison stays tight.
    st["s"] = torch.where(adapt[:, None, None], st["s"] * decay, st["s"])
    halted = (call >= cfg["max_iter_eval"]) | (res.max() < cfg["fp_thresh"]) | (st["s"].max() < 1e-3)
    return st, res, halted.expand(res.shape[0])


def research_fresh(y, cfg):
    B = y.shape[0]
    return {"y": y, "s": torch.full((B, 1, 1), cfg["stepsize"], dtype=y.dtype),
            "best": torch.full((B,), math.inf, dtype=y.dtype), "pat": torch.full((B,), float(cfg["decay_patience"]))}


SPLIT = {"stepsize_decay_train": 0.5, "stepsize_decay_eval": 0.8}  # the train/eval-split version's fields
SINGLE = {"stepsize_decay": 0.8}  # the single-decay version's field (commit 9e0ebf35)


def research_cfg(version, **fields):
    cfg = {k: v for k, v in FPRM_CFG.items() if not k.startswith("stepsize_decay")}
    return {**cfg, **(SPLIT if version == "split" else SINGLE), **fields}


@pytest.mark.parametrize("version", ["split", "single"])
def test_fprm_evaluation_follows_the_research_run_float64(version):
    # Evaluation decays the step size by the run's evaluation decay (not the training one) and, in the single-decay
    # version, counts a new lowest residual only 0.01 below the best: step sizes, iterates and halting per call.
    restart_rand()
    sd = fprm_state()
    sd["L_level.conv.weight"] = sd["L_level.conv.weight"] * 2.0  # a map where the margin changes decisions (below)
    cfg = research_cfg(version, decay_patience=2, fp_thresh=1e-3, max_iter_eval=15)
    model = convert(compiled(sd), {"arch": cfg}, META).double().eval()
    # Normal start noise: torch 2.11 and 2.13 draw the research code's truncated normal differently from one seed, and
    # the premises below (the margin changes decisions) need the same start on every supported torch.
    model.config.init_noise = "normal"
    ids, pids = batch()
    with torch.no_grad():
        f = fprm_map(sd, embed(sd, ids, pids, 2))
        y0 = model.model.fresh_state(4, "cpu", SEQ)["y"]  # the start noise is seeded here, drawn afresh there
        st, other = research_fresh(y0, cfg), research_fresh(y0, cfg)
        # the other rule: the training decay (split version) or no margin (single version)
        other_cfg = {k: v for k, v in cfg.items() if k != "stepsize_decay"}
        other_cfg["stepsize_decay_eval"] = 0.5 if version == "split" else 0.8
        carry, differed = model.initial_carry(4), False
        for call in range(1, 16):
            out = model(ids, pids, carry=carry)
            carry = out.carry
            st, res, halted = research_eval_call(f, st, cfg, call)
            other, _, _ = research_eval_call(f, other, other_cfg, call)
            differed |= not torch.equal(st["s"], other["s"])
            torch.testing.assert_close(carry["state"]["y"], st["y"], rtol=1e-8, atol=1e-8)
            torch.testing.assert_close(carry["state"]["solver_s"].view(-1), st["s"].view(-1), rtol=1e-12, atol=0)
            torch.testing.assert_close(out.fp_stats.residual, res.float(), rtol=1e-6, atol=1e-6)
            assert carry["halted"].tolist() == halted.tolist()
            if bool(halted.all()):
                break
    assert call == 15 and (st["s"] < 1).any() and differed  # decays happened, and the other rule's differ


def test_fprm_evaluation_halts_the_batch_by_the_research_rule_float64():
    # Two puzzles below fp_thresh, two whose step size falls below 1e-3 at the first call: the research code goes
    # on (not every residual is small, not every step size vanished) until its cap of max_iter_eval calls.
    restart_rand()
    sd = fprm_state()
    ids, pids = batch()
    base = convert(compiled(sd), {"arch": FPRM_CFG}, META).double().eval()
    with torch.no_grad():
        f = fprm_map(sd, embed(sd, ids, pids, 2))
        y0 = base.model.fresh_state(4, "cpu", SEQ)["y"]
        res0 = research_residual(y0, f(y0))
    thresh = float(res0.sort().values[1:3].mean())
    cfg = {**FPRM_CFG, "fp_thresh": thresh, "stepsize_decay_eval": 0.5, "decay_patience": 1, "max_iter_eval": 6}
    model = convert(compiled(sd), {"arch": cfg}, META).double().eval()
    below = res0 < thresh
    st = {"y": y0, "s": torch.where(below, 1.0, 1.5e-3).double().view(4, 1, 1),
          "best": torch.where(below, math.inf, 0.0).double(), "pat": torch.ones(4)}  # no new lowest: decay at once
    state = {"y": y0, "iterations": torch.zeros(4, dtype=torch.long), "solver_s": st["s"].view(4, 1).clone(),
             "solver_best": st["best"].clone(), "solver_patience": torch.ones(4, dtype=torch.long)}
    zero = torch.zeros(4, dtype=torch.long)
    carry = {"state": state, "steps": zero, "iterations": zero, "halted": torch.zeros(4, dtype=torch.bool),
             "data": {"input_ids": ids, "puzzle_identifiers": pids}}
    with torch.no_grad():
        for call in range(1, 7):
            out = model(ids, pids, carry=carry)
            carry = out.carry
            st, res, halted = research_eval_call(f, st, cfg, call)
            if call == 1:  # two puzzles converged, two stalled, and the batch goes on
                assert int(below.sum()) == 2 and (res < thresh).tolist() == below.tolist()
                assert (st["s"].view(-1) < 1e-3).tolist() == (~below).tolist() and not halted.any()
            torch.testing.assert_close(carry["state"]["y"], st["y"], rtol=1e-10, atol=1e-10)
            assert carry["halted"].tolist() == halted.tolist()
            if bool(halted.all()):
                break
    assert call == 6


def test_fprm_converter_reads_both_research_config_versions():
    sd = compiled(fprm_state())
    split = convert(sd, {"arch": research_cfg("split")}, META).config
    assert split.fp_solver_kwargs == {"step_size": 1.0, "patience": 5, "decay": 0.5, "improve_margin": 0.0}
    assert split.eval_step_decay == 0.8
    single = convert(sd, {"arch": research_cfg("single", decay_patience=3, stepsize=0.5)}, META).config
    assert single.fp_solver_kwargs == {"step_size": 0.5, "patience": 3, "decay": 0.8, "improve_margin": 0.01}
    assert single.eval_step_decay == 0.8
    # max_iter_eval None: the research code evaluates for max_iter calls of one solver step each
    assert convert(sd, {"arch": {**FPRM_CFG, "max_iter_eval": None}}, META).config.fp_eval_max_iter == 12
    with pytest.raises(ValueError, match=r"stepsize_decay.*stepsize_decay_train.*no research version has both"):
        convert(sd, {"arch": {**FPRM_CFG, "stepsize_decay": 0.9}}, META)
    with pytest.raises(ValueError, match="the checkpoint's stepsize_decay_warmup=0.5 has no counterpart here"):
        convert(sd, {"arch": {**FPRM_CFG, "stepsize_decay_warmup": 0.5}}, META)
    with pytest.raises(ValueError, match="names no step-size decay"):
        convert(sd, {"arch": {k: v for k, v in FPRM_CFG.items() if not k.startswith("stepsize_decay")}}, META)
