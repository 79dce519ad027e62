"""Generation checks for the causal LMs (DEQ-LM, Attractor LM, Ouro, SELF-LLaMA, SELF-Mistral), which transformers'
sdist ships no tester for: cached vs uncached greedy search, beam search (the cache reordered between steps) against
uncached beam search, a left-padded batch against each prompt alone, generation continued from ``past_key_values``
against one call, and assisted decoding with a tiny assistant (greedy assisted decoding must give the main model's
greedy tokens). Tiny configs whose solves converge tightly, so the cached and uncached paths agree to solver
precision."""

import pytest
import torch
from transformers import DynamicCache

from hf_fixedpoint.modeling import (
    AttractorConfig,
    AttractorForCausalLM,
    DEQLMConfig,
    DEQLMForCausalLM,
    OuroConfig,
    OuroForCausalLM,
    SelfLlamaConfig,
    SelfLlamaForCausalLM,
    SelfMistralConfig,
    SelfMistralForCausalLM,
)

_SOLVE = {"fp_tol": 1e-7, "fp_max_iter": 100}
_SELF = {"vocab_size": 99, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "intermediate_size": 37, "pad_token_id": 0, **_SOLVE}
FAMILIES = {
    "deq_lm": (DEQLMConfig, DEQLMForCausalLM, {"vocab_size": 99, "hidden_size": 32, "intermediate_size": 37,
                                               "num_attention_heads": 4, "max_position_embeddings": 64,
                                               "pad_token_id": 0, **_SOLVE}),
    "attractor_lm": (AttractorConfig, AttractorForCausalLM, {
        "vocab_size": 99, "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4,
        "num_key_value_heads": 2, "num_backbone_layers": 1, "num_attractor_layers": 1, "max_position_embeddings": 64,
        "pad_token_id": 0, **_SOLVE}),
    "ouro": (OuroConfig, OuroForCausalLM, {"vocab_size": 99, "hidden_size": 32, "intermediate_size": 48,
                                           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                                           "max_position_embeddings": 64, "total_ut_steps": 2, "pad_token_id": 0}),
    "self_llama": (SelfLlamaConfig, SelfLlamaForCausalLM, _SELF),
    "self_mistral": (SelfMistralConfig, SelfMistralForCausalLM, {**_SELF, "sliding_window": 4}),
    # tokens halting on the change of their iterate (each token's heads stop together, a residual of its own)
    "self_llama_state_halting": (SelfLlamaConfig, SelfLlamaForCausalLM, {**_SELF, "fpsa_halt_unit": "state"}),
}
GREEDY = {"do_sample": False, "pad_token_id": 0, "output_scores": True, "return_dict_in_generate": True}


def _model(family, seed=0):
    config_class, model_class, kwargs = FAMILIES[family]
    torch.manual_seed(seed)
    return model_class(config_class(**kwargs)).eval()


def _prompt(batch_size=1, length=5, seed=0):
    return torch.randint(1, 99, (batch_size, length), generator=torch.Generator().manual_seed(seed))


def _same(a, b, prompt_len=0):
    """Same tokens after the prompt, and scores within solver precision."""
    torch.testing.assert_close(a.sequences[:, prompt_len:], b.sequences[:, prompt_len:], rtol=0, atol=0)
    for step_a, step_b in zip(a.scores, b.scores):
        torch.testing.assert_close(step_a, step_b, rtol=1e-4, atol=1e-4)


families = pytest.mark.parametrize("family", FAMILIES)


@families
def test_cached_greedy_equals_uncached(family):
    model, ids = _model(family), _prompt(2)
    with torch.no_grad():
        _same(model.generate(ids, max_new_tokens=6, use_cache=True, **GREEDY),
              model.generate(ids, max_new_tokens=6, use_cache=False, **GREEDY))


@families
def test_beam_search_reorders_the_cache(family):
    model, ids = _model(family), _prompt(2)
    kw = {"max_new_tokens": 5, "num_beams": 3, "num_return_sequences": 3, "do_sample": False, "pad_token_id": 0,
          "early_stopping": True}
    with torch.no_grad():
        cached = model.generate(ids, use_cache=True, **kw)
        uncached = model.generate(ids, use_cache=False, **kw)
    torch.testing.assert_close(cached, uncached, rtol=0, atol=0)


@families
def test_left_padded_batch_equals_each_prompt_alone(family):
    model = _model(family)
    prompts = [_prompt(1, n, seed=n)[0] for n in (2, 5, 4)]
    T = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), T, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, T - len(p):], mask[i, T - len(p):] = p, 1
    with torch.no_grad():
        batched = model.generate(ids, attention_mask=mask, max_new_tokens=4, **GREEDY)
        for i, p in enumerate(prompts):
            alone = model.generate(p[None], max_new_tokens=4, **GREEDY)
            torch.testing.assert_close(batched.sequences[i, T:], alone.sequences[0, len(p):], rtol=0, atol=0)
            for step_b, step_a in zip(batched.scores, alone.scores):
                torch.testing.assert_close(step_b[i], step_a[0], rtol=1e-4, atol=1e-4)


NO_CACHE = "DEQ-LM keeps no KV cache: every step solves the fixed point over the whole prefix"
cached = pytest.mark.parametrize("family", [f if f != "deq_lm" else pytest.param(
    f, marks=pytest.mark.skip(reason=NO_CACHE + " (its refusal is tested below)")) for f in FAMILIES])


@cached
def test_continuing_from_past_key_values_equals_one_call(family):
    model, ids = _model(family), _prompt(2)
    with torch.no_grad():
        whole = model.generate(ids, max_new_tokens=6, **GREEDY)
        first = model.generate(ids, max_new_tokens=3, **GREEDY)
        rest = model.generate(first.sequences, past_key_values=first.past_key_values, max_new_tokens=3, **GREEDY)
    torch.testing.assert_close(rest.sequences, whole.sequences, rtol=0, atol=0)
    for step_a, step_b in zip(rest.scores, whole.scores[3:]):
        torch.testing.assert_close(step_a, step_b, rtol=1e-4, atol=1e-4)


@cached
def test_assisted_decoding_equals_greedy(family):
    model, assistant, ids = _model(family), _model(family, seed=1), _prompt(1)
    with torch.no_grad():
        greedy = model.generate(ids, max_new_tokens=8, **GREEDY)
        assisted = model.generate(ids, max_new_tokens=8, assistant_model=assistant, **GREEDY)
    _same(assisted, greedy)


def test_deq_lm_refuses_a_cache_and_assisted_decoding():
    model, assistant, ids = _model("deq_lm"), _model("deq_lm", seed=1), _prompt(1)
    with torch.no_grad():
        first = model.generate(ids, max_new_tokens=3, **GREEDY)
        assert first.past_key_values is None or first.past_key_values.get_seq_length() == 0  # nothing cached
        with pytest.raises(ValueError, match=r"\['(past_key_values|cache)'\]"):  # the name from transformers 5.24
            model.generate(first.sequences, past_key_values=DynamicCache(), max_new_tokens=3, **GREEDY)
        with pytest.raises(ValueError, match="DEQ-LM cannot do assisted decoding: it keeps no KV cache"):
            model.generate(ids, max_new_tokens=3, assistant_model=assistant, **GREEDY)
        # What works instead: continuing from the tokens alone.
        whole = model.generate(ids, max_new_tokens=6, **GREEDY)
        rest = model.generate(first.sequences, max_new_tokens=3, **GREEDY)
    torch.testing.assert_close(rest.sequences, whole.sequences, rtol=0, atol=0)
