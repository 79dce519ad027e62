"""SELF-Mistral: the shared tests, exactness against transformers' Mistral with one iteration (sliding window
included), cached decoding against full recomputation when the sequence is longer than the window, and bad input."""

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

from hf_fixedpoint.modeling import SelfMistralConfig, SelfMistralForCausalLM, SelfMistralModel
from tests.models.fixed_point_tester import FixedPointModelTesterMixin

TINY = {"vocab_size": 99, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64, "pad_token_id": 0,
        "sliding_window": 4}


class TestSelfMistral(FixedPointModelTesterMixin):
    config_class = SelfMistralConfig
    model_classes = ((SelfMistralModel, "AutoModel"), (SelfMistralForCausalLM, "AutoModelForCausalLM"))
    config_kwargs = {**TINY, "initializer_range": 0.01}  # see TestSelfLlama: a fully converged float64 check


def _pair(impl="sdpa", dtype=torch.float32, window=4, **fp):
    torch.manual_seed(0)
    cfg = {**TINY, "sliding_window": window}
    base = MistralForCausalLM(MistralConfig(**cfg, attn_implementation=impl)).to(dtype).eval()
    model = SelfMistralForCausalLM(SelfMistralConfig(**cfg, attn_implementation=impl, **fp)).to(dtype).eval()
    model.load_state_dict(base.state_dict())
    return base, model


def _ids(length=10):
    ids = torch.randint(1, 99, (2, length), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    return ids, mask


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_one_iteration_is_exactly_mistral_with_sliding_window(impl):
    base, model = _pair(impl, fp_max_iter=1)
    _, full_window = _pair(impl, window=None, fp_max_iter=1)
    ids, mask = _ids()
    with torch.no_grad():
        expected = base(ids, attention_mask=mask).logits
        torch.testing.assert_close(model(ids, attention_mask=mask).logits, expected, rtol=0, atol=0)
        assert (full_window(ids, attention_mask=mask).logits - expected).abs().max() > 1e-3  # the window matters
    kw = {"attention_mask": mask, "max_new_tokens": 8, "do_sample": False}
    assert torch.equal(model.generate(ids, **kw), base.generate(ids, **kw))


def test_cached_decoding_past_the_window_equals_full_recomputation():
    _, model = _pair("sdpa", torch.float64, fp_max_iter=300, fp_tol=1e-12)
    _, wide = _pair("sdpa", torch.float64, window=None, fp_max_iter=300, fp_tol=1e-12)
    ids, mask = _ids(length=12)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        full = model(ids, attention_mask=mask, position_ids=positions).logits
        cache = DynamicCache(config=model.config)
        steps = [model(ids[:, :6], attention_mask=mask[:, :6], position_ids=positions[:, :6], past_key_values=cache,
                       use_cache=True).logits]
        for t in range(6, 12):
            steps.append(model(ids[:, t:t + 1], attention_mask=mask[:, :t + 1], position_ids=positions[:, t:t + 1],
                               past_key_values=cache, use_cache=True).logits)
        err = (torch.cat(steps, 1) - full)[mask.bool()].abs().max()
        # A few (token, head) entries stall at a relative residual of ~3e-12 (float64's floor for them), so the
        # converged keys of cached tokens and the last iterate's keys of the full pass differ at that level.
        assert err < 1e-7, float(err)
        assert (wide(ids, attention_mask=mask, position_ids=positions).logits - full).abs().max() > 1e-4
    assert cache.layers[0].keys.shape[-2] == TINY["sliding_window"] - 1  # the cache keeps only the window
    kw = {"attention_mask": mask, "max_new_tokens": 8, "do_sample": False}
    assert torch.equal(model.generate(ids, **kw), model.generate(ids, use_cache=False, **kw))


def test_bad_input(tmp_path):
    LlamaForCausalLM(LlamaConfig(**{k: v for k, v in TINY.items() if k != "sliding_window"})).save_pretrained(
        tmp_path / "llama")
    with pytest.raises(ValueError, match=r"model_type='llama' is not one of \('mistral', 'self_mistral'\)"):
        SelfMistralForCausalLM.from_pretrained(tmp_path / "llama")
    with pytest.raises(ValueError, match="fp_max_iter"):
        SelfMistralConfig(**TINY, fp_max_iter=0)
    _, model = _pair()
    with pytest.raises(ValueError, match="fp_max_iters"):
        model.generate(_ids()[0], max_new_tokens=2, fp_max_iters=2)
