"""SELF-Mistral's self-speculative decoding (``generate(..., draft_depth=d)``: drafts at ``fp_max_iter=d``, ``d = 1``
being the base Mistral's attention), past the sliding window: the tokens of full-depth greedy search at batch 1 and in
left-padded batches, drafts mostly rejected or mostly accepted; rejected drafts rolled back from the sliding-window
cache, which then holds the verification's converged keys; the static sliding-window cache refused; the range of
``draft_depth`` validated; the saved export does it with torch + transformers only. The shared checks are
``tests/models/speculative_checks.py``; SELF-LLaMA's tests cover the rest of the same code."""

import pytest
from transformers import DynamicCache

from hf_fixedpoint.modeling import SelfMistralConfig, SelfMistralForCausalLM
from hf_fixedpoint.modeling.self_mistral.fp_compat import sliding_window_rollback
from tests.models import speculative_checks as checks

# transformers 5.16's sliding-window layers record their past but hand all of it to attention: no roll-back there
ROLLBACK = pytest.mark.skipif(not sliding_window_rollback(), reason="this transformers cannot roll back a window")

TINY = {"vocab_size": 99, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64, "pad_token_id": 0,
        "sliding_window": 4}  # prompts of 6 tokens and 8 new ones: most of the decoding is past the window


def _model(sharp: bool = True, **overrides):
    return checks.self_model(SelfMistralForCausalLM, SelfMistralConfig, TINY, sharp, **overrides)


@ROLLBACK
@pytest.mark.parametrize("sharp", [True, False])
def test_greedy_gives_the_full_depth_tokens_past_the_window(sharp):
    spec = checks.check_full_depth_tokens(_model(sharp), 1)
    if sharp:
        assert checks.acceptance(spec) < 0.5
    else:
        assert checks.acceptance(spec) > 0.8


@ROLLBACK
def test_the_sliding_window_cache_holds_the_verification_s_converged_keys():
    model = _model()
    checks.check_cache_is_full_depth_greedy_s(model, lambda: DynamicCache(config=model.config), 1,
                                              {"fp_max_iter": 1}, tol=1e-4)


@pytest.mark.skipif(sliding_window_rollback(), reason="this transformers rolls a window back")
def test_a_window_that_cannot_roll_back_is_refused():
    checks.check_refused(_model(sharp=False), "roll back rejected drafts", draft_depth=1)


def test_static_sliding_window_cache_is_refused():
    checks.check_refused(_model(sharp=False), "cannot be rolled back", draft_depth=1, cache_implementation="static")


@ROLLBACK  # (where a window cannot roll back, that refusal comes first)
def test_draft_depth_is_validated():
    checks.check_draft_depth_is_validated(_model(sharp=False), 5, fp_max_iter=5)


@ROLLBACK
def test_the_export_decodes_speculatively_without_the_package(tmp_path):
    checks.check_the_export_decodes_speculatively(_model(), tmp_path, 1, 300)
