"""SELF-LLaMA: the shared tests, exactness against transformers' LLaMA with one iteration, the fixed point against an
independent float64 loop, cached generation against full recomputation (left padding included), per-call knobs,
PEFT LoRA (train, merge, export), every config branch and the bad-input errors."""

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import (
    AutoModelForCausalLM,
    DynamicCache,
    LlamaConfig,
    LlamaForCausalLM,
    LlamaModel,
    MistralConfig,
    MistralForCausalLM,
    StaticCache,
)
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb, repeat_kv

from hf_fixedpoint.modeling import SelfLlamaConfig, SelfLlamaForCausalLM, SelfLlamaModel
from tests.models.fixed_point_tester import FixedPointModelTesterMixin

TINY = {"vocab_size": 99, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64, "pad_token_id": 0}


class TestSelfLlama(FixedPointModelTesterMixin):
    config_class = SelfLlamaConfig
    model_classes = ((SelfLlamaModel, "AutoModel"), (SelfLlamaForCausalLM, "AutoModelForCausalLM"))
    # At initializer_range=0.02 one (token, head) of the float64 gradient check stalls at a relative residual of
    # ~1e-10 (its attention output nearly cancels, so 1e-12 is below float64's floor there); 0.01 converges fully.
    config_kwargs = {**TINY, "initializer_range": 0.01}


def _base_and_self(impl="sdpa", dtype=torch.float64, **fp):
    torch.manual_seed(0)
    base = LlamaForCausalLM(LlamaConfig(**TINY, attn_implementation=impl)).to(dtype).eval()
    model = SelfLlamaForCausalLM(SelfLlamaConfig(**TINY, attn_implementation=impl, **fp)).to(dtype).eval()
    missing, unexpected = model.load_state_dict(base.state_dict(), strict=False)
    assert not unexpected and all("fpsa_log_tau" in k for k in missing)  # LLaMA's names, plus optional temperatures
    return base, model


def _ids(batch=2, length=9, pad=3):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 99, (batch, length), generator=g)
    mask = torch.ones_like(ids)
    mask[-1, :pad] = 0  # left padding
    return ids, mask


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_one_iteration_is_exactly_llama(impl):
    base, model = _base_and_self(impl, torch.float32, fp_max_iter=1)
    ids, mask = _ids()
    with torch.no_grad():
        out = model(ids, attention_mask=mask)
        torch.testing.assert_close(out.logits, base(ids, attention_mask=mask).logits, rtol=0, atol=0)
        body = SelfLlamaModel(model.config).eval()
        body.load_state_dict(model.model.state_dict())
        plain = LlamaModel(base.config).eval()
        plain.load_state_dict(base.model.state_dict())
        torch.testing.assert_close(body(ids, attention_mask=mask).last_hidden_state,
                                   plain(ids, attention_mask=mask).last_hidden_state, rtol=0, atol=0)
    assert out.fp_stats.nfe == 1
    generated = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    assert torch.equal(generated, base.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False))


def _reference_logits(base, ids, tol=1e-13, max_iter=500):
    """Causal FPSA written out with plain torch ops: each layer iterates Z = norm(R + W_O softmax(Q(Z) K(Z)^T) V) with
    RoPE on Q and K, GQA and the causal mask, until Z stops moving; V = W_V norm(R)."""
    m = base.model
    h = m.embed_tokens(ids)
    B, T, _ = h.shape
    cos, sin = m.rotary_emb(h, torch.arange(T)[None])
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    for layer in m.layers:
        a, norm = layer.self_attn, layer.input_layernorm

        def heads(t):
            return t.view(B, T, -1, a.head_dim).transpose(1, 2)

        def attend(z):
            q, k = apply_rotary_pos_emb(heads(a.q_proj(z)), heads(a.k_proj(z)), cos, sin)
            k = repeat_kv(k, a.num_key_value_groups)
            s = (q @ k.transpose(-1, -2) * a.scaling).masked_fill(~causal, float("-inf"))
            return a.o_proj((s.softmax(-1) @ v).transpose(1, 2).reshape(B, T, -1))

        residual = h
        x = norm(residual)
        v = repeat_kv(heads(a.v_proj(x)), a.num_key_value_groups)
        z = x
        for _ in range(max_iter):
            z_new = norm(residual + attend(z))
            done = (z_new - z).abs().max() < tol
            z = z_new
            if done:
                break
        else:
            raise AssertionError("reference loop did not converge")
        h = residual + attend(z)
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    return base.lm_head(m.norm(h))


def test_fixed_point_matches_independent_loop_float64():
    base, model = _base_and_self(fp_max_iter=400, fp_tol=1e-13)
    ids, _ = _ids()
    with torch.no_grad():
        out = model(ids)
        expected = _reference_logits(base, ids)
    assert out.fp_stats.all_converged and out.fp_stats.nfe > 3
    torch.testing.assert_close(out.logits, expected, rtol=0, atol=1e-9)
    assert (expected - base(ids).logits).abs().max() > 1e-4  # the iteration changes the (tiny, random) model


def _positions(mask):
    return (mask.cumsum(-1) - 1).clamp(min=0)


def test_left_padding_equals_the_unpadded_row():
    _, model = _base_and_self(fp_max_iter=400, fp_tol=1e-13)
    ids, mask = _ids(pad=3)
    with torch.no_grad():
        padded = model(ids, attention_mask=mask, position_ids=_positions(mask))
        alone = model(ids[-1:, 3:])
    torch.testing.assert_close(padded.logits[-1, 3:], alone.logits[0], rtol=0, atol=1e-10)
    assert padded.fp_stats.token_mask.sum() == mask.sum()


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_cached_decoding_equals_full_recomputation(impl):
    # float32 with eager: transformers' eager mask is NaN for fully padded rows in float64 (a LLaMA property).
    dtype = torch.float64 if impl == "sdpa" else torch.float32
    tol = 1e-12 if impl == "sdpa" else 1e-7
    _, model = _base_and_self(impl, dtype, fp_max_iter=300, fp_tol=tol)
    ids, mask = _ids(length=12)
    prompt, new = 7, 5
    with torch.no_grad():
        full = model(ids, attention_mask=mask, position_ids=_positions(mask)).logits
        cache = DynamicCache(config=model.config)
        steps = [model(ids[:, :prompt], attention_mask=mask[:, :prompt], position_ids=_positions(mask)[:, :prompt],
                       past_key_values=cache, use_cache=True).logits]
        for t in range(prompt, prompt + new):
            out = model(ids[:, t:t + 1], attention_mask=mask[:, :t + 1], position_ids=_positions(mask)[:, t:t + 1],
                        past_key_values=cache, use_cache=True)
            assert out.fp_stats.iterations.shape[2] == 1  # only the new token iterates
            steps.append(out.logits)
    incremental = torch.cat(steps, 1)
    real = mask.bool()
    err = (incremental - full)[real].abs().max()
    assert err < (1e-9 if dtype == torch.float64 else 1e-4), float(err)
    assert cache.get_seq_length() == prompt + new


def test_generate_cached_equals_uncached_and_logs_stats_per_token():
    _, model = _base_and_self(fp_max_iter=100, fp_tol=1e-10)
    ids, mask = _ids()
    log = []
    cached = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, fp_stats_log=log)
    uncached = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, use_cache=False)
    assert torch.equal(cached, uncached)
    assert len(log) == 6  # the prompt, then one forward per further token
    assert log[0].iterations.shape[2] == ids.shape[1] and all(s.iterations.shape[2] == 1 for s in log[1:])
    assert all(s.all_converged and 1 < s.median < 100 for s in log)


def test_per_call_knobs_reach_the_solver():
    # fp_min_iter makes every cap visible in the stats (the tiny model converges in a few steps).
    _, model = _base_and_self(fp_tol=1e-12, fp_max_iter=16, fp_eval_max_iter=12, fp_min_iter=12)
    ids, mask = _ids()
    log = []
    model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False, fp_max_iter=3,
                   fp_overrides={"fp_min_iter": 3}, fp_stats_log=log)
    assert [s.nfe for s in log] == [3, 3, 3]  # the per-call cap also replaces fp_eval_max_iter
    with torch.no_grad():
        assert model(ids, attention_mask=mask).fp_stats.nfe == 12
        lowered = {"fp_eval_max_iter": 2, "fp_min_iter": 2}
        assert model(ids, attention_mask=mask, fp_overrides=lowered).fp_stats.nfe == 2
        _, free = _base_and_self(fp_tol=1e-12, fp_max_iter=50)
        loose, tight = free(ids, attention_mask=mask, fp_tol=0.05), free(ids, attention_mask=mask)
        assert loose.fp_stats.median < tight.fp_stats.median
    assert model.config.fp_max_iter == 16 and model.config.fp_tol == 1e-12


def test_knob_typos_are_errors():
    _, model = _base_and_self()
    ids, mask = _ids()
    with pytest.raises(ValueError, match="fp_max_iters"):
        model.generate(ids, attention_mask=mask, max_new_tokens=2, fp_max_iters=3)
    with pytest.raises(ValueError, match=r"unknown fixed-point keyword\(s\) \['fp_tolerance'\].*fp_max_iter"):
        model(ids, fp_tolerance=1e-3)
    with pytest.raises(ValueError, match="Unknown fixed-point setting"):
        model(ids, fp_overrides={"fp_iters": 3})
    with pytest.raises(ValueError, match="fp_max_iter"):
        model(ids, fp_max_iter=0)


def test_bad_configs_and_checkpoints(tmp_path):
    with pytest.raises(ValueError, match="fp_max_iter"):
        SelfLlamaConfig(**TINY, fp_max_iter=0)
    with pytest.raises(ValueError, match="fpsa_halting='learned' is not supported.*allowed: 'tolerance'"):
        SelfLlamaConfig(**TINY, fpsa_halting="learned")
    with pytest.raises(ValueError, match="fpsa_spectral_norm='qk'.*allowed: 'none'"):
        SelfLlamaConfig(**TINY, fpsa_spectral_norm="qk")
    with pytest.raises(ValueError, match="Unknown FPSA setting"):
        SelfLlamaConfig(**TINY, fpsa_iters=3)
    MistralForCausalLM(MistralConfig(**TINY)).save_pretrained(tmp_path / "mistral")
    with pytest.raises(ValueError, match=r"model_type='mistral' is not one of \('llama', 'self_llama'\)"):
        SelfLlamaForCausalLM.from_pretrained(tmp_path / "mistral")
    _, model = _base_and_self()
    ids, _ = _ids()
    static = StaticCache(config=model.config, max_cache_len=16)  # preallocated converged keys: the same forward
    with torch.no_grad():
        assert torch.allclose(model(ids, past_key_values=static, use_cache=True).logits, model(ids).logits, atol=1e-6)


def test_loads_a_llama_checkpoint_with_unchanged_names(tmp_path):
    torch.manual_seed(0)
    base = LlamaForCausalLM(LlamaConfig(**TINY)).eval()
    base.save_pretrained(tmp_path / "llama")
    model = SelfLlamaForCausalLM.from_pretrained(tmp_path / "llama", fp_max_iter=1).eval()
    assert model.config.model_type == "self_llama" and model.config.fp_max_iter == 1
    assert set(model.state_dict()) == set(base.state_dict())
    ids, mask = _ids()
    with torch.no_grad():
        torch.testing.assert_close(model(ids, attention_mask=mask).logits, base(ids, attention_mask=mask).logits,
                                   rtol=0, atol=0)
    # With a learned temperature the new parameters start at tau = 1 (the base model's softmax scale).
    tau = SelfLlamaForCausalLM.from_pretrained(tmp_path / "llama", fp_max_iter=1, fpsa_learn_temperature=True)
    assert all(float(layer.self_attn.fpsa_log_tau.detach().abs().max()) == 0.0 for layer in tau.model.layers)
    with torch.no_grad():
        torch.testing.assert_close(tau(ids, attention_mask=mask).logits, base(ids, attention_mask=mask).logits)


@pytest.mark.parametrize("fp", [{"fpsa_update": "plain"}, {"fpsa_step_norm": "tanh"},
                                {"fpsa_learn_temperature": True}, {"fpsa_adjoint_mask": False},
                                {"fpsa_update_scale": 0.5}],
                         ids=["plain", "tanh", "temperature", "no_adjoint_mask", "update_scale"])
def test_config_branches_train_and_decode(fp):
    _, model = _base_and_self(dtype=torch.float32, fp_max_iter=6, fp_tol=1e-4, **fp)
    ids, mask = _ids()
    model.train()
    out = model(ids, attention_mask=mask, labels=ids, use_cache=False)
    out.loss.backward()
    assert torch.isfinite(out.loss) and out.fp_stats.nfe >= 2
    if fp.get("fpsa_learn_temperature"):
        assert model.model.layers[0].self_attn.fpsa_log_tau.grad.abs().sum() > 0
    model.eval()
    generated = model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False)
    assert generated.shape == (2, ids.shape[1] + 3)


def test_attentions_hidden_states_and_gradient_checkpointing():
    _, model = _base_and_self("eager", torch.float32, fp_max_iter=4)
    ids, mask = _ids()
    with torch.no_grad():
        out = model(ids, attention_mask=mask, output_attentions=True, output_hidden_states=True)
    assert len(out.attentions) == 2 and out.attentions[0].shape == (2, 4, 9, 9)
    assert len(out.hidden_states) == 3
    torch.testing.assert_close(out.attentions[0].sum(-1)[0], torch.ones(4, 9))
    model.train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    out = model(ids, attention_mask=mask, labels=ids, use_cache=False)
    out.loss.backward()
    assert len(out.fp_stats.iterations_per_layer) == 2  # the recomputation replaced, not added, its entries
    assert model.model.layers[0].self_attn.q_proj.weight.grad is not None


def test_lora_train_merge_and_export(tmp_path):
    _, model = _base_and_self(dtype=torch.float32, fp_max_iter=4, fp_tol=1e-4)
    model.save_pretrained(tmp_path / "base")
    ids, mask = _ids()
    with torch.no_grad():
        before = model(ids, attention_mask=mask).logits
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], lora_dropout=0.0,
                      task_type="CAUSAL_LM")
    peft_model = get_peft_model(model, lora)
    trainable = [n for n, p in peft_model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    opt = torch.optim.AdamW([p for p in peft_model.parameters() if p.requires_grad], lr=1e-2)
    peft_model.train()
    for _ in range(3):
        loss = peft_model(input_ids=ids, attention_mask=mask, labels=ids, use_cache=False).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    peft_model.eval()
    with torch.no_grad():
        expected = peft_model(input_ids=ids, attention_mask=mask).logits
    peft_model.save_pretrained(tmp_path / "adapter")
    reloaded = PeftModel.from_pretrained(SelfLlamaForCausalLM.from_pretrained(tmp_path / "base"),
                                         tmp_path / "adapter").eval()
    merged = peft_model.merge_and_unload()
    assert type(merged) is SelfLlamaForCausalLM and not any("lora_" in k for k in merged.state_dict())
    merged.save_pretrained(tmp_path / "merged")
    assert (tmp_path / "merged" / "modeling_self_llama.py").is_file()  # self-contained remote code
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", trust_remote_code=True).eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=ids, attention_mask=mask).logits, expected)
        torch.testing.assert_close(exported(input_ids=ids, attention_mask=mask).logits, expected,
                                   rtol=1e-4, atol=1e-5)
    assert (expected - before).abs().max() > 1e-3  # the adapter was trained
