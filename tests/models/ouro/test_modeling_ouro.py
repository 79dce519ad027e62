"""Ouro: the shared tests (with the loop count in place of the solver knobs), loading a checkpoint laid out like the
released ones, the forward against an independent float64 implementation of the formulas, the per-(loop, layer)
cache, the exit rules and the losses, and bad input."""

import json
import math
import pickle

import pytest
import torch
from safetensors.torch import save_file
from torch.nn import functional as F
from transformers import DynamicCache, StaticCache
from transformers.cache_utils import StaticLayer

from hf_fixedpoint.modeling import OuroConfig, OuroForCausalLM, OuroModel
from tests.models.causal_lm_checks import CausalLMChecksMixin
from tests.models.fixed_point_tester import FixedPointModelTesterMixin

TINY = {"vocab_size": 99, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "max_position_embeddings": 64, "total_ut_steps": 3, "pad_token_id": 0}


class TestOuro(CausalLMChecksMixin, FixedPointModelTesterMixin):
    config_class = OuroConfig
    model_classes = ((OuroModel, "AutoModel"), (OuroForCausalLM, "AutoModelForCausalLM"))
    config_kwargs = TINY
    lm_class = OuroForCausalLM
    num_layers_reported = 6  # every (loop, layer) application: 3 loops of 2 layers

    # ---- shared tests whose fixed-point knobs become the loop count ----------------------------------------------
    def test_forward_shapes_and_stats(self):
        for model_class, _ in self.model_classes:
            model = self.build(model_class).eval()
            inputs = self.prepare_inputs(model.config)
            out = model(**inputs)
            assert self.main_output(out).shape[:2] == inputs["input_ids"].shape
            assert len(out.loop_hidden_states) == 3 and out.gate_logits.shape == (3, 7, 3)
            assert torch.isfinite(self.main_output(out)).all()

    def test_config_rejects_bad_fixed_point_settings(self):
        with pytest.raises(ValueError, match=r"total_ut_steps=0 is out of range"):
            self.get_config(total_ut_steps=0)
        with pytest.raises(ValueError, match="early_exit_threshold"):
            self.get_config(early_exit_threshold=1.5)
        with pytest.raises(ValueError, match="exit_loss='mean'.*Allowed values"):
            self.get_config(exit_loss="mean")
        with pytest.raises(ValueError, match="num_attention_heads=4 must be divisible by num_key_value_heads=3"):
            self.get_config(num_key_value_heads=3)
        with pytest.raises(ValueError, match="use_sliding_window"):
            self.get_config(use_sliding_window=True)

    def test_save_and_load(self, tmp_path):
        for model_class, _ in self.model_classes:
            model = self.build(model_class).eval()
            inputs = self.prepare_inputs(model.config)
            model.save_pretrained(tmp_path / model_class.__name__)
            loaded = model_class.from_pretrained(tmp_path / model_class.__name__).eval()
            with torch.no_grad():
                torch.testing.assert_close(self.main_output(loaded(**inputs)), self.main_output(model(**inputs)))
            assert loaded.config.total_ut_steps == 3

    def test_from_pretrained_overrides_fixed_point_settings(self, tmp_path):
        self.build(OuroForCausalLM).save_pretrained(tmp_path)
        loaded = OuroForCausalLM.from_pretrained(tmp_path, total_ut_steps=5)
        assert loaded.config.total_ut_steps == 5
        assert len(loaded(**self.prepare_inputs(loaded.config)).loop_hidden_states) == 5

    def test_training_step_every_backward_mode(self):
        # Ouro backpropagates through the unrolled loops; check it with and without gradient checkpointing.
        for checkpointing in (False, True):
            model = self.build(OuroForCausalLM).train()
            if checkpointing:
                model.gradient_checkpointing_enable({"use_reentrant": False})
            inputs = self.prepare_inputs(model.config)
            model(**inputs, labels=inputs["input_ids"]).loss.backward()
            assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())

    def test_every_solver_through_the_config(self):
        model = self.build(OuroForCausalLM, total_ut_steps=1).eval()
        with torch.no_grad():
            out = model(**self.prepare_inputs(model.config), total_ut_steps=4)
        assert len(out.loop_hidden_states) == 4 and out.exit_pdf.shape[-1] == 4

    def test_train_and_eval_iteration_budgets(self):
        model = self.build(OuroForCausalLM)
        inputs = self.prepare_inputs(model.config)
        assert len(model.train()(**inputs).loop_hidden_states) == 3
        with torch.no_grad():
            assert len(model.eval()(**inputs).loop_hidden_states) == 3

    def test_per_call_overrides(self):
        model = self.build(OuroForCausalLM).eval()
        inputs = self.prepare_inputs(model.config)
        with torch.no_grad():
            one = model(**inputs, total_ut_steps=1)
            assert len(one.loop_hidden_states) == 1
            # the first loop does not depend on how many follow
            torch.testing.assert_close(one.loop_hidden_states[0], model(**inputs).loop_hidden_states[0])
            with pytest.raises(ValueError, match="total_ut_steps=0 is out of range"):
                model(**inputs, total_ut_steps=0)
            with pytest.raises(ValueError, match="total_ut_steps must be an integer"):
                model(**inputs, total_ut_steps=2.0)
        assert model.config.total_ut_steps == 3

    def test_remote_code_round_trip(self, tmp_path):
        # The base model's last_hidden_state does not use the exit gate, so the shared check that every parameter
        # gets a gradient holds for the causal LM only (whose training logits mix the loops by the gate).
        self.model_classes = ((OuroForCausalLM, "AutoModelForCausalLM"),)
        super().test_remote_code_round_trip(tmp_path)

    def test_implicit_gradient_matches_unrolled_float64(self):
        # No implicit gradient here: check autograd through the loops against central finite differences.
        model = self.build(OuroForCausalLM).double().train()
        inputs = self.prepare_inputs(model.config)
        w = model.model.layers[1].mlp.down_proj.weight

        def loss():  # in float64 (transformers' loss function computes in float32)
            logits = model(**inputs).logits  # training mode: the exit-weighted mixture of the loop logits
            return F.cross_entropy(logits[:, :-1].reshape(-1, 99), inputs["input_ids"][:, 1:].reshape(-1))

        loss().backward()
        direction = torch.randn_like(w)
        with torch.no_grad():
            w += 1e-6 * direction
            up = loss()
            w -= 2e-6 * direction
            down = loss()
            w += 1e-6 * direction
        fd = (up - down) / 2e-6
        torch.testing.assert_close(fd, (w.grad * direction).sum(), rtol=1e-6, atol=1e-9)


# ---- an independent float64 implementation of the notes' formulas -------------------------------------------------
def _rms(x, w, eps):
    return w * (x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps))


def _rope(x, pos, theta):
    d = x.shape[-1]
    # angles in float32, as transformers' rotary embedding computes them for every dtype
    inv = (1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d)).float()
    ang = torch.cat([pos[..., None].float() * inv] * 2, -1)  # (B, S, d)
    cos, sin = ang.cos().double()[:, None], ang.sin().double()[:, None]
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def reference_forward(sd, cfg, ids, mask, loops):
    """Straightforward Ouro: per-loop states, gate logits, exit pdf (no library code)."""
    p = {k: v.double() for k, v in sd.items()}
    B, S = ids.shape
    H, KV, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads
    pos = (mask.cumsum(-1) - 1).clamp_min(0)
    allowed = torch.tril(torch.ones(S, S, dtype=torch.bool))[None] & mask.bool()[:, None, :]  # (B, Sq, Sk)
    allowed = allowed | torch.eye(S, dtype=torch.bool)  # padded queries see themselves (never read by real tokens)
    h = p["model.embed_tokens.weight"][ids]
    states, gates = [], []
    for _ in range(loops):
        for i in range(cfg.num_hidden_layers):
            pre = f"model.layers.{i}."
            x = _rms(h, p[pre + "input_layernorm.weight"], cfg.rms_norm_eps)
            q = (x @ p[pre + "self_attn.q_proj.weight"].T).view(B, S, H, D).transpose(1, 2)
            k = (x @ p[pre + "self_attn.k_proj.weight"].T).view(B, S, KV, D).transpose(1, 2)
            v = (x @ p[pre + "self_attn.v_proj.weight"].T).view(B, S, KV, D).transpose(1, 2)
            theta = cfg.rope_parameters["rope_theta"]
            q, k = _rope(q, pos, theta), _rope(k, pos, theta)
            k, v = k.repeat_interleave(H // KV, 1), v.repeat_interleave(H // KV, 1)
            scores = (q @ k.transpose(-1, -2)) / math.sqrt(D)
            scores = scores.masked_fill(~allowed[:, None], float("-inf"))
            a = (scores.softmax(-1) @ v).transpose(1, 2).reshape(B, S, H * D) @ p[pre + "self_attn.o_proj.weight"].T
            h = h + _rms(a, p[pre + "input_layernorm_2.weight"], cfg.rms_norm_eps)
            x = _rms(h, p[pre + "post_attention_layernorm.weight"], cfg.rms_norm_eps)
            m = (F.silu(x @ p[pre + "mlp.gate_proj.weight"].T) * (x @ p[pre + "mlp.up_proj.weight"].T))
            h = h + _rms(m @ p[pre + "mlp.down_proj.weight"].T, p[pre + "post_attention_layernorm_2.weight"],
                         cfg.rms_norm_eps)
        h = _rms(h, p["model.norm.weight"], cfg.rms_norm_eps)
        states.append(h)
        gates.append((h @ p["model.early_exit_gate.weight"].T + p["model.early_exit_gate.bias"])[..., 0])
    pdf, survive = [], torch.ones(B, S, dtype=torch.float64)
    for t, g in enumerate(gates):
        lam = torch.sigmoid(g)
        pdf.append(survive.clone() if t == loops - 1 else lam * survive)
        survive = survive * (1 - lam)
    logits = [s @ p["lm_head.weight"].T for s in states]
    return states, logits, torch.stack(pdf, -1)


def _model_and_inputs(**overrides):
    torch.manual_seed(0)
    model = OuroForCausalLM(OuroConfig(**{**TINY, **overrides})).double().eval()
    with torch.no_grad():  # non-trivial norms and gate so that they are tested
        for name, prm in model.named_parameters():
            if "norm" in name or "gate.bias" in name:
                prm.add_(0.3 * torch.randn_like(prm))
        model.model.early_exit_gate.weight.mul_(8.0)  # exit probabilities that differ from token to token
    ids = torch.randint(1, 99, (3, 7), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    mask[1, :1] = 0
    return model, ids, mask


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_forward_matches_reference_float64(attn):
    model, ids, mask = _model_and_inputs()
    model.set_attn_implementation(attn)
    if attn == "eager":
        # transformers' eager attention gives NaN rows for left padding in float64 (Llama too): no padding here
        mask = torch.ones_like(mask)
    tol = 1e-10 if attn == "sdpa" else 2e-6  # eager attention takes its softmax in float32
    pos = (mask.cumsum(-1) - 1).clamp_min(0)
    states, logits, pdf = reference_forward(model.state_dict(), model.config, ids, mask, loops=3)
    with torch.no_grad():
        out = model(ids, attention_mask=mask, position_ids=pos, output_loop_logits=True, exit_threshold=0.6)
    valid = mask.bool()
    for t in range(3):
        torch.testing.assert_close(out.loop_hidden_states[t][valid], states[t][valid], rtol=tol, atol=tol)
        torch.testing.assert_close(out.loop_logits[t][valid], logits[t][valid], rtol=tol, atol=tol)
    torch.testing.assert_close(out.exit_pdf[valid], pdf[valid], rtol=tol, atol=tol)
    # Q-exit at 0.6: the first loop whose cumulative probability reaches 0.6
    first = (pdf.cumsum(-1) >= 0.6).double().argmax(-1)
    expected = torch.stack(logits, -2).gather(-2, first[..., None, None].expand(3, 7, 1, 99)).squeeze(-2)
    torch.testing.assert_close(out.logits[valid], expected[valid], rtol=tol, atol=tol)
    assert len(first[valid].unique()) > 1  # the rule picks different loops for different tokens


def test_losses_match_reference_float64():
    model, ids, mask = _model_and_inputs(entropy_weight=0.05)
    labels = ids.masked_fill(mask == 0, -100)
    _, logits, pdf = reference_forward(model.state_dict(), model.config, ids, torch.ones_like(ids), loops=3)
    tgt = labels[:, 1:]

    def ce(lg):
        return F.cross_entropy(lg[:, :-1].reshape(-1, 99), tgt.reshape(-1), ignore_index=-100, reduction="none")

    mixture = sum(pdf[..., t, None] * logits[t] for t in range(3))
    expected = {"expected_logits": ce(mixture)[tgt.reshape(-1) != -100].mean(),
                "last": ce(logits[-1])[tgt.reshape(-1) != -100].mean()}
    per_tok = sum(pdf[:, :-1, t].reshape(-1) * ce(logits[t]) for t in range(3))
    entropy = -(pdf * pdf.log()).sum(-1)[:, :-1].reshape(-1)
    valid = tgt.reshape(-1) != -100
    expected["expected_loss"] = (per_tok - 0.05 * entropy)[valid].mean()
    for mode, value in expected.items():
        model.config.exit_loss = mode
        with torch.no_grad():
            loss = model(ids, labels=labels).loss
        torch.testing.assert_close(loss.double(), value, rtol=1e-6, atol=1e-7)  # CE in float32


def test_exit_rules():
    model, ids, mask = _model_and_inputs()
    with torch.no_grad():
        out = model(ids, output_loop_logits=True)
        torch.testing.assert_close(out.logits, out.loop_logits[-1])  # threshold 1.0: the last loop
        torch.testing.assert_close(model(ids, exit_at_step=0).logits, out.loop_logits[0])
        torch.testing.assert_close(model(ids, exit_threshold=0.0).logits, out.loop_logits[0])
        weighted = sum(out.exit_pdf[..., t, None].double() * out.loop_logits[t] for t in range(3))
        torch.testing.assert_close(model(ids, use_weighted_exit=True).logits, weighted)
        with pytest.raises(ValueError, match="exit_at_step=3 is out of range"):
            model(ids, exit_at_step=3)
        with pytest.raises(ValueError, match="exit_threshold=2 is out of range"):
            model(ids, exit_threshold=2)


def test_checkpoint_with_ouro_key_names_loads(tmp_path):
    """A checkpoint written by hand with the released key names and config.json layout loads exactly."""
    cfg = {"architectures": ["OuroForCausalLM"], "model_type": "ouro", "auto_map": {
        "AutoConfig": "configuration_ouro.OuroConfig", "AutoModelForCausalLM": "modeling_ouro.OuroForCausalLM"},
        "attention_dropout": 0.0, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "hidden_act": "silu",
        "hidden_size": 32, "initializer_range": 0.02, "intermediate_size": 48, "max_position_embeddings": 64,
        "max_window_layers": 28, "num_attention_heads": 4, "num_hidden_layers": 2, "num_key_value_heads": 4,
        "rms_norm_eps": 1e-6, "rope_scaling": None, "rope_theta": 1000000.0, "sliding_window": None,
        "tie_word_embeddings": False, "torch_dtype": "float32", "total_ut_steps": 4, "early_exit_threshold": 1.0,
        "use_cache": True, "use_sliding_window": False, "vocab_size": 99, "layer_types": ["full_attention"] * 2}
    g = torch.Generator().manual_seed(0)
    shapes = {"model.embed_tokens.weight": (99, 32), "model.norm.weight": (32,),
              "model.early_exit_gate.weight": (1, 32), "model.early_exit_gate.bias": (1,), "lm_head.weight": (99, 32)}
    for i in range(2):
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            shapes[f"model.layers.{i}.self_attn.{name}.weight"] = (32, 32)
        shapes[f"model.layers.{i}.mlp.gate_proj.weight"] = (48, 32)
        shapes[f"model.layers.{i}.mlp.up_proj.weight"] = (48, 32)
        shapes[f"model.layers.{i}.mlp.down_proj.weight"] = (32, 48)
        for norm in ("input_layernorm", "input_layernorm_2", "post_attention_layernorm",
                     "post_attention_layernorm_2"):
            shapes[f"model.layers.{i}.{norm}.weight"] = (32,)
    weights = {k: torch.randn(s, generator=g) * 0.1 for k, s in shapes.items()}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    model, info = OuroForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert model.config.total_ut_steps == 4 and model.config.rope_parameters["rope_theta"] == 1e6
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, weights[k])
    # The same files without one weight: a clear error instead of a silent random initialization.
    del weights["model.layers.1.input_layernorm_2.weight"]
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"lacks 1 Ouro weight.*model.layers.1.input_layernorm_2.weight"):
        OuroForCausalLM.from_pretrained(tmp_path)


@pytest.mark.parametrize("loops", [1, 3])
def test_cached_generate_equals_uncached_left_padded(loops):
    torch.manual_seed(0)
    model = OuroForCausalLM(OuroConfig(**TINY)).eval()
    ids = torch.randint(1, 99, (3, 6), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    mask[2, :1] = 0
    ids = ids.masked_fill(mask == 0, 0)
    kw = {"attention_mask": mask, "max_new_tokens": 10, "do_sample": False, "pad_token_id": 0, "total_ut_steps": loops}
    cached = model.generate(ids, use_cache=True, **kw)
    uncached = model.generate(ids, use_cache=False, **kw)
    assert torch.equal(cached, uncached)
    # each row equals its own unpadded generation
    for row in range(3):
        alone = model.generate(ids[row : row + 1, mask[row].bool()], max_new_tokens=10, do_sample=False,
                               total_ut_steps=loops)
        assert torch.equal(alone[0, -10:], cached[row, -10:])


@pytest.mark.parametrize("beams", [1, 3])
def test_static_cache_generates_the_dynamic_cache_tokens(beams):
    """``cache_implementation="static"`` (compiled generation's cache) once failed in masking_utils (generate passes
    its prepared masks as a dict) and had one slot per layer; now it gets the L * T slots and the same tokens, for
    greedy and beam search on a left-padded batch."""
    torch.manual_seed(0)
    model = OuroForCausalLM(OuroConfig(**TINY)).eval()
    ids = torch.randint(1, 99, (3, 6), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    ids = ids.masked_fill(mask == 0, 0)
    kw = {"attention_mask": mask, "max_new_tokens": 8, "do_sample": False, "pad_token_id": 0, "num_beams": beams}
    dynamic = model.generate(ids, **kw)
    cache = StaticCache(config=model.config, max_cache_len=14)
    static = model.generate(ids, past_key_values=cache, **kw) if beams == 1 else \
        model.generate(ids, cache_implementation="static", **kw)
    assert torch.equal(static, dynamic)
    if beams == 1:
        assert len(cache.layers) == 2 * 3 and all(isinstance(layer, StaticLayer) for layer in cache.layers)


def test_static_decode_step_traces_as_one_graph():
    """What compiled generation compiles: a decoding step with a filled static cache, one graph for all loops (the
    cache check once branched on the static cache's tensor length: three graph breaks)."""
    torch.manual_seed(0)
    model = OuroForCausalLM(OuroConfig(**TINY)).eval()
    ids = torch.randint(1, 99, (2, 6))
    cache = StaticCache(config=model.config, max_cache_len=16)
    with torch.no_grad():
        model(ids, past_key_values=cache, use_cache=True)
        explained = torch._dynamo.explain(model)(ids[:, -1:], past_key_values=cache, use_cache=True,
                                                 position_ids=torch.full((2, 1), 6))
    torch._dynamo.reset()
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons


def test_cache_has_one_slot_per_loop_and_layer():
    torch.manual_seed(0)
    model = OuroForCausalLM(OuroConfig(**TINY)).eval()
    ids = torch.randint(1, 99, (1, 5))
    with torch.no_grad():
        out = model(ids, use_cache=True)
        assert len(out.past_key_values.layers) == 2 * 3
        with pytest.raises(ValueError, match="holds 6 .* total_ut_steps=2 needs 4"):
            model(ids[:, :1], past_key_values=out.past_key_values, total_ut_steps=2)
        cache = DynamicCache(config=model.config)  # built from the config: one slot per layer, grown on first use
        full = model(ids, use_cache=False).logits[:, -1]
        model(ids[:, :-1], past_key_values=cache, use_cache=True)
        step = model(ids[:, -1:], past_key_values=cache, use_cache=True).logits[:, -1]
    assert len(cache.layers) == 6
    torch.testing.assert_close(step, full, rtol=1e-5, atol=1e-5)


def test_loop_step_is_one_loop():
    model, ids, mask = _model_and_inputs()
    with torch.no_grad():
        out = model(ids, attention_mask=mask)
        nxt = model.loop_function(out)(out.loop_hidden_states[0])
    torch.testing.assert_close(nxt[mask.bool()], out.loop_hidden_states[1][mask.bool()])


def test_outputs_hold_tensors_only_so_they_pickle_and_convert_to_tuples():
    model, ids, mask = _model_and_inputs()
    with torch.no_grad():
        outs = [model(ids, attention_mask=mask, labels=ids, use_cache=False),
                model.model(ids, attention_mask=mask, use_cache=False)]
    for out in outs:
        for value in out.to_tuple():
            items = value if isinstance(value, tuple) else (value,)
            assert all(torch.is_tensor(v) for v in items), (type(out).__name__, type(value).__name__)
        back = pickle.loads(pickle.dumps(out))
        assert back.keys() == out.keys()
        assert all(torch.equal(torch.as_tensor(a), torch.as_tensor(b)) for a, b in zip(
            (v for t in back.to_tuple() for v in (t if isinstance(t, tuple) else (t,))),
            (v for t in out.to_tuple() for v in (t if isinstance(t, tuple) else (t,)))))
        with torch.no_grad():  # the unpickled output still gives the call's loop
            nxt = model.loop_function(back)(back.loop_hidden_states[0])
        torch.testing.assert_close(nxt[mask.bool()], out.loop_hidden_states[1][mask.bool()])


# ---- depth guard (issue 16, section 2) --------------------------------------------------------------------------
def test_loop_change_is_the_relative_change_of_each_sequence_between_loops_float64():
    torch.manual_seed(0)
    model = OuroForCausalLM(OuroConfig(**TINY)).double().eval()
    ids = torch.randint(1, 99, (2, 5), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0  # left padding: excluded from the change
    with torch.no_grad():
        out = model(ids, attention_mask=mask, total_ut_steps=4)
    assert out.loop_change.shape == (2, 3) and out.loop_change.dtype == torch.float64
    hs = out.loop_hidden_states
    for b in range(2):
        valid = mask[b].bool()
        for t in range(1, 4):
            expected = (hs[t][b, valid] - hs[t - 1][b, valid]).norm() / hs[t - 1][b, valid].norm()
            torch.testing.assert_close(out.loop_change[b, t - 1], expected, rtol=1e-12, atol=1e-15)
    with torch.no_grad():
        assert model(ids, total_ut_steps=1).loop_change is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_loop_change_stacked_equals_pair_by_pair(monkeypatch, dtype):
    """Small states go through one stacked copy, large ones pair by pair: the same numbers, bit for bit."""
    from hf_fixedpoint.modeling.ouro import modeling_ouro

    generator = torch.Generator().manual_seed(0)
    states = [torch.randn(3, 7, 32, generator=generator).to(dtype) for _ in range(5)]
    mask = torch.ones(3, 9, dtype=torch.long)
    mask[0, :4] = 0  # left padding, excluded
    stacked = modeling_ouro.loop_change(states, mask)
    monkeypatch.setattr(modeling_ouro, "LOOP_CHANGE_STACK_LIMIT", 0)
    pairwise = modeling_ouro.loop_change(states, mask)
    assert stacked.shape == (3, 4) and stacked.dtype == torch.promote_types(dtype, torch.float32)
    assert torch.equal(stacked, pairwise)


def _settling_model(**config):
    """A model whose loop is idempotent (the layers add nothing, the final RMS norm is a projection): it settles."""
    torch.manual_seed(0)
    model = OuroForCausalLM(OuroConfig(**{**TINY, **config})).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    return model


def _depth_warnings(model, ids, **kw):
    import warnings

    from hf_fixedpoint.modeling.ouro.modeling_ouro import LoopDepthWarning

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.no_grad():
            model(ids, **kw)
    return [w for w in caught if issubclass(w.category, LoopDepthWarning)]


def test_running_past_the_trained_depth_warns_once_when_the_state_does_not_settle():
    ids = torch.randint(1, 99, (2, 6), generator=torch.Generator().manual_seed(4))
    torch.manual_seed(0)
    model = OuroForCausalLM(OuroConfig(**TINY, trained_loops=[2, 3], loop_guard_tol=1e-3)).eval()
    assert not _depth_warnings(model, ids, total_ut_steps=3)  # inside the trained range
    torch.manual_seed(0)
    quiet = OuroForCausalLM(OuroConfig(**TINY, trained_loops=[2, 3], loop_guard_tol=None)).eval()
    with torch.no_grad():
        change = quiet(ids, total_ut_steps=6).loop_change.mean(0)
    assert (change[2:] > 1e-3).any()  # a random model keeps moving
    caught = _depth_warnings(model, ids, total_ut_steps=6)
    assert len(caught) == 1 and "total_ut_steps=6" in str(caught[0].message) and "trained_loops=[2, 3]" in str(
        caught[0].message)
    assert not _depth_warnings(model, ids, total_ut_steps=6)  # once per model
    assert not _depth_warnings(quiet, ids, total_ut_steps=6)
    # generate warns as well (its forward calls)
    fresh = OuroForCausalLM(OuroConfig(**TINY, trained_loops=3, loop_guard_tol=1e-3)).eval()
    import warnings

    from hf_fixedpoint.modeling.ouro.modeling_ouro import LoopDepthWarning

    with pytest.warns(LoopDepthWarning, match="past the 3 it was trained with"):
        fresh.generate(ids, max_new_tokens=2, do_sample=False, total_ut_steps=5)
    with warnings.catch_warnings():
        warnings.simplefilter("error", LoopDepthWarning)
        fresh.generate(ids, max_new_tokens=2, do_sample=False, total_ut_steps=5)  # already warned


def test_a_settling_model_runs_deeper_than_trained_without_a_warning():
    ids = torch.randint(1, 99, (2, 6), generator=torch.Generator().manual_seed(4))
    model = _settling_model(trained_loops=[2, 3])
    with torch.no_grad():
        change = model(ids, total_ut_steps=8).loop_change
    assert change[:, 1:].max() < 1e-5  # after the first loop the state no longer moves
    assert not _depth_warnings(model, ids, total_ut_steps=8)
    # without a record, total_ut_steps (3) is the trained depth
    assert model.config.total_ut_steps == 3 and not _depth_warnings(_settling_model(), ids, total_ut_steps=8)


@pytest.mark.parametrize("bad", [0, [0, 3], [4, 2], [1.5, 3], "4", [1, 2, 3], True])
def test_config_rejects_bad_trained_loops(bad):
    with pytest.raises(ValueError, match="trained_loops"):
        OuroConfig(**TINY, trained_loops=bad)


def test_config_rejects_bad_loop_guard_tol(tmp_path):
    with pytest.raises(ValueError, match=r"loop_guard_tol=-0.1 is out of range"):
        OuroConfig(**TINY, loop_guard_tol=-0.1)
    OuroConfig(**TINY, trained_loops=4).save_pretrained(tmp_path)
    assert OuroConfig.from_pretrained(tmp_path).trained_loops == [4, 4]
