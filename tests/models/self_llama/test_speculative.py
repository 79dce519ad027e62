"""SELF-LLaMA's self-speculative decoding (``generate(..., draft_depth=d)``: drafts at ``fp_max_iter=d``, ``d = 1``
being the base LLaMA's attention): the tokens of full-depth greedy search at batch 1 and in left-padded batches whose
rows accept different numbers of drafts, on a model whose drafts are mostly rejected and on one whose drafts are
mostly accepted; the cache after decoding holds the verification's converged keys (dynamic and static cache); the
draft runs at its depth; sampling keeps the output distribution; bad input is refused; the saved export does it with
torch + transformers only. The models are float64 with solves that converge (``checks.self_model``)."""

import pytest
import torch
from transformers import DynamicCache, StaticCache

from hf_fixedpoint.modeling import SelfLlamaConfig, SelfLlamaForCausalLM
from tests.models import speculative_checks as checks

TINY = {"vocab_size": 99, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64, "pad_token_id": 0}


def _model(sharp: bool = True, dtype=torch.float64, **overrides):
    return checks.self_model(SelfLlamaForCausalLM, SelfLlamaConfig, TINY, sharp, dtype, **overrides)


@pytest.mark.parametrize("sharp,depth", [(True, 1), (True, 2), (False, 1)])
def test_greedy_gives_the_full_depth_tokens_batched_and_alone(sharp, depth):
    model = _model(sharp)
    spec = checks.check_full_depth_tokens(model, depth)
    if sharp and depth == 1:  # the base model as the draft: mostly rejected, by different counts per row
        assert checks.acceptance(spec) < 0.5
        assert len(set(spec.accepted_draft_tokens.tolist())) > 1, spec.accepted_draft_tokens
    else:  # two iterations already give the full depth's tokens, or the iteration barely matters
        assert checks.acceptance(spec) > 0.8
        assert spec.verify_rounds < checks.NEW - 1  # more tokens than verifications


@pytest.mark.parametrize("call", [{"fp_max_iter": 300}, {"fp_overrides": {"fp_max_iter": 300}}])
def test_the_full_depth_is_the_call_s(call):
    """A per-call cap (keyword or ``fp_overrides``) is the full depth, not the config's (2 here)."""
    model = _model(fp_max_iter=2)
    ids, mask = checks.padded_batch()
    full = checks.greedy(model, ids, mask, **call).sequences
    assert not torch.equal(full, checks.greedy(model, ids, mask).sequences)
    spec = checks.greedy(model, ids, mask, draft_depth=1, num_assistant_tokens=3, **checks.EVERY_DRAFT, **call)
    assert torch.equal(spec.sequences, full)


@pytest.mark.parametrize("static", [False, True])
def test_the_cache_holds_the_verification_s_converged_keys(static):
    model = _model()

    def cache():
        return StaticCache(config=model.config, max_cache_len=6 + checks.NEW) if static else DynamicCache()

    checks.check_cache_is_full_depth_greedy_s(model, cache, 1, {"fp_max_iter": 1}, tol=1e-4)


def test_static_cache_implementation():
    model = _model()
    ids, mask = checks.padded_batch()
    full = checks.greedy(model, ids, mask).sequences
    spec = checks.greedy(model, ids, mask, draft_depth=1, num_assistant_tokens=3, cache_implementation="static")
    assert torch.equal(spec.sequences, full)


def test_drafts_run_at_the_draft_depth_and_verify_every_position_at_once():
    """``fp_stats_log`` sees each forward: the prompt, then per round the drafts (one token each, at most ``d``
    iterations) and one verification (the last kept token and the drafts together, at the full cap)."""
    model = _model()
    ids, mask = checks.padded_batch()
    log = []
    out = checks.greedy(model, ids, mask, draft_depth=2, num_assistant_tokens=3, fp_stats_log=log,
                        **checks.EVERY_DRAFT)
    assert log[0].iterations.shape[2] == ids.shape[1]
    drafted = int(out.draft_tokens.max())  # the rows drafted together; one of them never finished
    assert len(log) == 1 + drafted + out.verify_rounds
    shallow = [s for s in log[1:] if int(s.iterations.max()) <= 2]
    assert len(shallow) == drafted and all(s.iterations.shape[2] == 1 for s in shallow)
    assert max(s.iterations.shape[2] for s in log[1:]) == 4  # three drafts and the last kept token


def test_sampling_keeps_the_full_depth_distribution():
    model = _model(dtype=torch.float32, vocab_size=3, fp_tol=1e-5, fp_max_iter=100)
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)  # sharper distributions: the draft's differs from the full depth's
    checks.check_sampling_keeps_the_full_depth_distribution(model, 1, {"fp_max_iter": 1})


def test_draft_depth_is_validated():
    checks.check_draft_depth_is_validated(_model(sharp=False), 300)
    checks.check_draft_depth_is_validated(_model(sharp=False), 4, fp_max_iter=4)


@pytest.mark.parametrize("kw,match", checks.REFUSALS + [({"fp_max_iter": 1}, "at least 2 iterations"),
                                                         ({"draft_max_depth": 2}, "built for Ouro only")])
def test_what_the_draft_cannot_serve_is_refused(kw, match):
    checks.check_refused(_model(sharp=False), match, draft_depth=1, **kw)


def test_refused_with_another_assistant_or_in_training_mode():
    model = _model(sharp=False)
    checks.check_refused(model, "assistant_model", draft_depth=1, assistant_model=_model(sharp=False))
    checks.check_refused(model.train(), "model.eval", draft_depth=1)


def test_the_export_decodes_speculatively_without_the_package(tmp_path):
    checks.check_the_export_decodes_speculatively(_model(), tmp_path, 1, 300)
