"""The Attractor LM's self-speculative decoding (``generate(..., draft_depth=d)``: drafts from a solve capped at ``d``
iterations, ``readout_iters=d``): the tokens of full-depth greedy search at batch 1 and in left-padded batches, drafts
mostly rejected (one iteration) or mostly accepted (three); the cache then holds the verification's entries (dynamic
and static cache); the full depth is the call's; bad input refused; the saved export does it with torch +
transformers only. Shared checks: ``tests/models/speculative_checks.py``."""

import pytest
import torch
from transformers import DynamicCache, StaticCache

from hf_fixedpoint.modeling import AttractorConfig, AttractorForCausalLM
from tests.models import speculative_checks as checks

TINY = {"vocab_size": 99, "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4,
        "num_key_value_heads": 2, "num_backbone_layers": 1, "num_attractor_layers": 2,
        "max_position_embeddings": 64, "pad_token_id": 0}
# float64 Picard to a tight tolerance (every solve converges); initializer_range 0.2: the attractor moves the
# proposal far enough that one iteration's tokens are mostly not the fixed point's
CONVERGED = {"fp_solver": "picard", "fp_tol": 1e-8, "fp_max_iter": 200, "initializer_range": 0.2}


def _model(**overrides):
    torch.manual_seed(0)
    return AttractorForCausalLM(AttractorConfig(**{**TINY, **CONVERGED, **overrides})).double().eval()


@pytest.mark.parametrize("depth", [1, 3])
def test_greedy_gives_the_full_depth_tokens_batched_and_alone(depth):
    spec = checks.check_full_depth_tokens(_model(), depth)
    if depth == 1:
        assert checks.acceptance(spec) < 0.5
        assert len(set(spec.accepted_draft_tokens.tolist())) > 1, spec.accepted_draft_tokens
    else:
        assert checks.acceptance(spec) > 0.8


@pytest.mark.parametrize("static", [False, True])
def test_the_cache_holds_the_verification_s_entries(static):
    model = _model()

    def cache():
        return StaticCache(config=model.config, max_cache_len=6 + checks.NEW) if static else DynamicCache()

    checks.check_cache_is_full_depth_greedy_s(model, cache, 1, {"readout_iters": 1}, tol=1e-5)


def test_the_full_depth_is_the_call_s():
    """A per-call ``readout_iters`` is the full depth (the config's solve is longer): the tokens are that cap's."""
    model = _model()
    ids, mask = checks.padded_batch()
    full = checks.greedy(model, ids, mask, readout_iters=4).sequences
    spec = checks.greedy(model, ids, mask, readout_iters=4, draft_depth=1, num_assistant_tokens=3,
                         **checks.EVERY_DRAFT)
    assert torch.equal(spec.sequences, full)
    checks.check_draft_depth_is_validated(model, 4, readout_iters=4)
    checks.check_draft_depth_is_validated(model, 200)


@pytest.mark.parametrize("kw,match", [({"readout_iters": 1}, "at least 2 iterations"),
                                      ({"unrolled_iters": 3}, "unrolled_iters"), checks.REFUSALS[1]])
def test_what_the_draft_cannot_serve_is_refused(kw, match):
    checks.check_refused(_model(), match, draft_depth=1, **kw)


def test_the_export_decodes_speculatively_without_the_package(tmp_path):
    checks.check_the_export_decodes_speculatively(_model(), tmp_path, 1, 200)
