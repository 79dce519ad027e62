"""Ouro's self-speculative decoding (``generate(..., draft_depth=d)``): the tokens of full-depth greedy search at
batch 1 and in left-padded batches whose rows accept different numbers of drafts, on a random model (drafts mostly
rejected) and on one whose drafts are mostly accepted; the first token is drafted from the prompt's loop-d state and
verified with the prompt's deeper loops (rejected or accepted); the cache after decoding equals full-depth greedy's in
every (loop, layer) slot (dynamic and static); the exit rules and the depth guard compose; sampling keeps the output
distribution; bad input is refused; the saved export does it with torch + transformers only."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from transformers import DynamicCache, LogitsProcessor, LogitsProcessorList, StaticCache

from hf_fixedpoint.modeling import OuroConfig, OuroForCausalLM
from tests.models.fixed_point_tester import _CHILD as _REMOTE_CHILD
from tests.models.speculative_checks import REFUSALS

TINY = {"vocab_size": 99, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "max_position_embeddings": 64, "total_ut_steps": 4, "pad_token_id": 0,
        "loop_guard_tol": None}
NEW = 10
EVERY_DRAFT = {"assistant_confidence_threshold": 0.0}  # drafts of the full length (no early stop on confidence)


def _model(branch_scale=None, **overrides):
    """A random model; ``branch_scale`` shrinks the layers' branches (their output norms), so that each loop moves
    the state a little and a few loops already give the full depth's tokens (drafts mostly accepted)."""
    torch.manual_seed(0)
    model = OuroForCausalLM(OuroConfig(**{**TINY, **overrides})).eval()
    if branch_scale is not None:
        with torch.no_grad():
            for layer in model.model.layers:
                layer.input_layernorm_2.weight.mul_(branch_scale)
                layer.post_attention_layernorm_2.weight.mul_(branch_scale)
    return model


def _batch():
    ids = torch.randint(1, 99, (3, 6), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    mask[2, :1] = 0
    return ids.masked_fill(mask == 0, 0), mask


def _greedy(model, ids, mask, **kw):
    return model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, pad_token_id=0,
                          return_dict_in_generate=True, **kw)


@pytest.mark.parametrize("branch_scale", [None, 0.05])
@pytest.mark.parametrize("loops,depth", [(2, 1), (4, 1), (4, 3), (5, 2)])
def test_greedy_gives_the_full_depth_tokens_batched_and_alone(branch_scale, loops, depth):
    model = _model(branch_scale)
    ids, mask = _batch()
    full = _greedy(model, ids, mask, total_ut_steps=loops).sequences
    for kw in ({"num_assistant_tokens": 3, **EVERY_DRAFT}, {"num_assistant_tokens": 1},
               {"num_assistant_tokens": 2, "num_assistant_tokens_schedule": "heuristic", **EVERY_DRAFT}):
        spec = _greedy(model, ids, mask, total_ut_steps=loops, draft_depth=depth, **kw)
        assert torch.equal(spec.sequences, full), kw
    for row in range(3):  # each row alone (batch 1, no padding)
        alone = model.generate(ids[row : row + 1, mask[row].bool()], max_new_tokens=NEW, do_sample=False,
                               total_ut_steps=loops, draft_depth=depth, num_assistant_tokens=3, **EVERY_DRAFT)
        assert torch.equal(alone[0, -NEW:], full[row, -NEW:]), row
    spec = _greedy(model, ids, mask, total_ut_steps=loops, draft_depth=depth, num_assistant_tokens=3, **EVERY_DRAFT)
    rate = spec.accepted_draft_tokens.sum() / spec.draft_tokens.sum()
    if branch_scale is None and depth < loops - 1:  # random weights: the drafts are mostly rejected
        assert rate < 0.5
    if branch_scale is not None:  # nearly settled loops: more tokens than verifications (NEW - 1 after the prompt's)
        assert spec.verify_rounds < NEW - 1


def test_rows_accept_different_numbers_of_drafts():
    """The batch case the speculative loop must get right: rows whose drafts are accepted and rows whose are not."""
    model = _model(0.05)
    ids, mask = _batch()
    full = _greedy(model, ids, mask).sequences
    spec = _greedy(model, ids, mask, draft_depth=1, num_assistant_tokens=3, **EVERY_DRAFT)
    assert torch.equal(spec.sequences, full)
    assert len(set(spec.accepted_draft_tokens.tolist())) > 1, spec.accepted_draft_tokens


def _slots(cache):
    return [(layer.keys[..., : int(layer.get_seq_length()), :], layer.values[..., : int(layer.get_seq_length()), :])
            for layer in cache.layers]


@pytest.mark.parametrize("static", [False, True])
def test_the_cache_after_decoding_is_full_depth_greedy_s(static):
    """Rejected drafts are rolled back from every (loop, layer) slot; the kept entries are the full model's."""
    model = _model(0.05)
    ids, mask = _batch()

    def cache():
        return StaticCache(config=model.config, max_cache_len=ids.shape[1] + NEW) if static else DynamicCache()

    full = _greedy(model, ids, mask, past_key_values=cache())
    spec = _greedy(model, ids, mask, draft_depth=1, num_assistant_tokens=3, past_key_values=cache(), **EVERY_DRAFT)
    assert torch.equal(spec.sequences, full.sequences)
    # drafts were kept and drafts were rolled back
    assert 0 < spec.accepted_draft_tokens.sum() < spec.draft_tokens.sum()
    got, want = _slots(spec.past_key_values), _slots(full.past_key_values)
    assert len(got) == len(want) == 4 * 2
    for (k, v), (k_ref, v_ref) in zip(got, want):
        assert k.shape == k_ref.shape == (3, 2, ids.shape[1] + NEW - 1, 8)
        torch.testing.assert_close(k, k_ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(v, v_ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("branch_scale", [None, 0.05])
@pytest.mark.parametrize("new", [1, 2])
def test_the_first_token_is_drafted_from_the_prompt_and_verified(branch_scale, new):
    """The prefill runs the draft's loops only: the first token is a draft, from the prompt's loop-d state, verified
    with the prompt's deeper loops (rejected by the random model, accepted by the nearly settled one); with one new
    token nothing is drafted (one verification). The tokens and every cache slot are full-depth greedy's."""
    model = _model(branch_scale)
    ids, mask = _batch()
    kw = {"attention_mask": mask, "max_new_tokens": new, "do_sample": False, "pad_token_id": 0,
          "return_dict_in_generate": True}
    full = model.generate(ids, past_key_values=DynamicCache(), **kw)
    spec = model.generate(ids, past_key_values=DynamicCache(), draft_depth=1, num_assistant_tokens=1, **kw)
    assert torch.equal(spec.sequences, full.sequences)
    assert spec.draft_tokens.tolist() == [new - 1] * 3
    assert spec.accepted_draft_tokens.tolist() == [0 if branch_scale is None else new - 1] * 3
    assert spec.verify_rounds == (1 if new == 1 or branch_scale is not None else 2)
    for (k, v), (k_ref, v_ref) in zip(_slots(spec.past_key_values), _slots(full.past_key_values), strict=True):
        assert k.shape == k_ref.shape == (3, 2, ids.shape[1] + new - 1, 8)
        torch.testing.assert_close(k, k_ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(v, v_ref, rtol=1e-5, atol=1e-5)


def test_a_cache_that_holds_tokens_is_refused():
    model = _model()
    ids, mask = _batch()
    cache = DynamicCache()
    with torch.no_grad():
        model(ids[:, :4], attention_mask=mask[:, :4], past_key_values=cache, use_cache=True)
    with pytest.raises(ValueError, match="empty cache; this one already holds 4 positions"):
        _greedy(model, ids, mask, draft_depth=1, past_key_values=cache)


def test_a_prompt_given_as_embeddings_only_is_refused():
    model = _model()
    ids, _ = _batch()
    with pytest.raises(ValueError, match="input_ids"):
        model.generate(inputs_embeds=model.model.embed_tokens(ids), max_new_tokens=2, draft_depth=1)


def test_the_depth_guard_warns_from_the_first_verification():
    """The prompt's deeper loops run in the first verification, which warns as ``forward`` would when the call runs
    past the trained depth and the state does not settle."""
    from hf_fixedpoint.modeling.ouro.modeling_ouro import LoopDepthWarning

    model = _model(trained_loops=3, loop_guard_tol=1e-3)
    ids, mask = _batch()
    with pytest.warns(LoopDepthWarning, match="total_ut_steps=5 loops, past the 3"):
        _greedy(model, ids, mask, total_ut_steps=5, draft_depth=2)


def test_static_cache_implementation():
    model = _model(0.6)
    ids, mask = _batch()
    full = _greedy(model, ids, mask).sequences
    spec = _greedy(model, ids, mask, draft_depth=2, cache_implementation="static", num_assistant_tokens=3)
    assert torch.equal(spec.sequences, full)


@pytest.mark.parametrize("exit_kw", [{"exit_threshold": 0.6}, {"exit_tol": 0.5}, {"exit_at_step": 1},
                                     {"use_weighted_exit": True}, {"exit_tol": 0.5, "no_threshold": True}])
def test_exit_rules_compose_with_the_draft(exit_kw):
    """``exit_mode="select"`` rules decode every verified position as ``forward`` does, from the draft's loops and
    the verification's together; also the state-change rule alone (no threshold: the exit gate is not computed)."""
    exit_kw = dict(exit_kw)
    overrides = {"early_exit_threshold": None} if exit_kw.pop("no_threshold", False) else {}
    model = _model(0.6, **overrides).double()
    with torch.no_grad():
        model.model.early_exit_gate.weight.mul_(6.0)  # exits at different loops at threshold 0.6
    ids, mask = _batch()
    full = _greedy(model, ids, mask, **exit_kw).sequences
    plain = _greedy(model, ids, mask).sequences
    spec = _greedy(model, ids, mask, draft_depth=2, num_assistant_tokens=3, **EVERY_DRAFT, **exit_kw)
    assert torch.equal(spec.sequences, full)
    if "exit_at_step" in exit_kw or "exit_threshold" in exit_kw:
        assert not torch.equal(full, plain)  # the rule changes the tokens, so the comparison means something


def _distribution(tokens, vocab):
    codes = tokens[:, 0] * vocab + tokens[:, 1]
    return torch.bincount(codes, minlength=vocab * vocab).double() / len(tokens)


@pytest.mark.parametrize("deeper", [{}, {"draft_max_depth": 2, "assistant_confidence_threshold": 0.99}])
def test_sampling_keeps_the_full_depth_distribution(deeper):
    """The speculative acceptance rule: the first two sampled tokens (the first one drafted from the prompt's loop-d
    state, or one loop deeper where it is unsure, and accepted or not, then the verification's next token) are
    distributed as full-depth sampling's, not as the draft's (total variation distance on 6000 samples of 9
    outcomes; sampling noise about 0.02)."""
    model = _model(branch_scale=4.0, vocab_size=3, total_ut_steps=3)  # loops that move the state a lot
    with torch.no_grad():
        model.lm_head.weight.mul_(4.0)  # and sharper distributions: the draft's differs from the full depth's
    ids = torch.tensor([[1, 2, 1]]).repeat(6000, 1)
    kw = {"max_new_tokens": 2, "min_new_tokens": 2, "do_sample": True, "top_k": 0, "pad_token_id": 0}
    torch.manual_seed(1)
    full = _distribution(model.generate(ids, **kw)[:, 3:], 3)
    torch.manual_seed(2)
    out = model.generate(ids, draft_depth=1, num_assistant_tokens=1, return_dict_in_generate=True,
                         **{**EVERY_DRAFT, **deeper}, **kw)
    spec = _distribution(out.sequences[:, 3:], 3)
    assert bool((out.draft_tokens == 1).all())  # one draft per row (the first token), accepted or not by the rule
    accepted = out.accepted_draft_tokens.double().mean()
    assert 0.3 < accepted < 0.95, accepted
    torch.manual_seed(3)
    draft = _distribution(model.generate(ids, total_ut_steps=1, **kw)[:, 3:], 3)
    tv = 0.5 * (spec - full).abs().sum()
    assert tv < 0.05, tv
    assert 0.5 * (draft - full).abs().sum() > 0.15  # the draft's own distribution is far off


class _Recorder(LogitsProcessor):
    """Records every ``(ids, scores)`` the decoding hands its logits processors (unchanged)."""

    def __init__(self):
        self.calls = []

    def __call__(self, input_ids, scores):
        self.calls.append((input_ids.clone(), scores.clone()))
        return scores


@pytest.mark.parametrize("branch_scale,sharpen,threshold", [(None, 1.0, 0.9), (0.05, 40.0, 0.5)])
def test_unsure_drafts_run_deeper(branch_scale, sharpen, threshold):
    """``draft_max_depth``: every draft distribution is the model's at some depth on its prefix (the deeper loops of
    an unsure token run on every position not yet at full depth, so they are exact), deeper ones are drafted from
    (also past a round's first position, where ``sharpen`` makes some drafts sure), and the tokens and every cache
    slot are full-depth greedy's."""
    model = _model(branch_scale).double()
    with torch.no_grad():
        model.lm_head.weight.mul_(sharpen)  # largest probabilities about 0.25 to 0.98 (x 40)
    ids, mask = _batch()
    ids = ids[1:2]  # a row without padding: its prefixes' logits are plain forwards
    recorder = _Recorder()
    kw = {"max_new_tokens": NEW, "do_sample": False, "pad_token_id": 0, "return_dict_in_generate": True}
    full = model.generate(ids, past_key_values=DynamicCache(), **kw)
    spec = model.generate(ids, past_key_values=DynamicCache(), draft_depth=1, draft_max_depth=3,
                          num_assistant_tokens=3, assistant_confidence_threshold=threshold,
                          logits_processor=LogitsProcessorList([recorder]), **kw)
    assert torch.equal(spec.sequences, full.sequences)
    for (k, v), (k_ref, v_ref) in zip(_slots(spec.past_key_values), _slots(full.past_key_values), strict=True):
        torch.testing.assert_close(k, k_ref)
        torch.testing.assert_close(v, v_ref)
    depths = []
    with torch.no_grad():
        for prefix, scores in recorder.calls:
            found = [t for t in range(1, 5)
                     if torch.allclose(model(prefix, total_ut_steps=t).logits[:, -1].float(), scores, atol=1e-6)]
            assert found, prefix.shape
            depths.append((found[0], prefix.shape[1]))
    assert {2, 3} <= {t for t, _ in depths if t < 4}
    first, later = None, False  # a round's first draft position; a deeper draft past it
    for t, n in depths:
        if t == 4:  # the verification, after the round's drafts
            first = None
        elif first is None:
            first = n
        later = later or (t not in (1, 4) and n > first)
    assert later or branch_scale is None  # (a random model is unsure of every draft: each round stops after one)


def test_draft_max_depth_equals_drafting_at_that_depth_when_every_token_is_unsure():
    """With every draft unsure (threshold 1), each draft runs ``draft_max_depth`` loops: the rounds of
    ``draft_depth=1, draft_max_depth=3`` are those of ``draft_depth=3``, the tokens full depth's (static cache)."""
    model = _model()
    ids, mask = _batch()
    kw = {"num_assistant_tokens": 3, "assistant_confidence_threshold": 1.0, "cache_implementation": "static"}
    deep = _greedy(model, ids, mask, draft_depth=1, draft_max_depth=3, **kw)
    three = _greedy(model, ids, mask, draft_depth=3, **kw)
    assert torch.equal(deep.sequences, _greedy(model, ids, mask).sequences)
    assert torch.equal(deep.sequences, three.sequences)
    assert deep.accepted_draft_tokens.tolist() == three.accepted_draft_tokens.tolist()
    assert deep.verify_rounds == three.verify_rounds


@pytest.mark.parametrize("kw,match", [
    ({"draft_max_depth": 0}, r"draft_max_depth.*\[2, 3\]"),
    ({"draft_max_depth": 4}, r"draft_max_depth.*\[2, 3\]"),
    ({"draft_max_depth": 2.5}, "draft_max_depth.*integer"),
    ({"draft_max_depth": 3, "assistant_confidence_threshold": 0.0}, "assistant_confidence_threshold"),
])
def test_draft_max_depth_is_validated(kw, match):
    model = _model()
    ids, mask = _batch()
    with pytest.raises(ValueError, match=match):
        _greedy(model, ids, mask, draft_depth=2, **kw)
    with pytest.raises(ValueError, match="pass draft_depth too"):
        _greedy(model, ids, mask, draft_max_depth=3)


@pytest.mark.parametrize("depth", [0, 4, 5, 1.5, -1])
def test_draft_depth_is_validated(depth):
    model = _model()
    ids, mask = _batch()
    with pytest.raises(ValueError, match=r"draft_depth.*(\[1, 3\]|integer)"):
        _greedy(model, ids, mask, draft_depth=depth)


@pytest.mark.parametrize("kw,match", [
    ({"total_ut_steps": 1}, "at least 2 loops"),
    ({"exit_mode": "skip"}, "exit_mode='skip'"),
    ({"output_loop_logits": True}, "output_loop_logits"),
] + REFUSALS)
def test_what_the_draft_cannot_serve_is_refused(kw, match):
    model = _model()
    ids, mask = _batch()
    with pytest.raises(ValueError, match=match):
        _greedy(model, ids, mask, draft_depth=1, **kw)


def test_refused_with_another_assistant():
    model = _model()
    ids, mask = _batch()
    with pytest.raises(ValueError, match="assistant_model"):
        _greedy(model, ids, mask, draft_depth=1, assistant_model=_model())


# the child of the families' remote-code test, up to its imports: blocks every import of the package
_BLOCK = _REMOTE_CHILD[: _REMOTE_CHILD.index("import torch, transformers")]
_CHILD = _BLOCK + textwrap.dedent(
    """
    import torch, transformers
    ckpt, io = sys.argv[1], sys.argv[2]
    model = transformers.AutoModelForCausalLM.from_pretrained(ckpt, trust_remote_code=True).eval()
    ids, mask = torch.load(io + "/inputs.pt")
    kw = dict(attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0, total_ut_steps=4)
    spec = model.generate(ids, draft_depth=2, num_assistant_tokens=3, **kw)
    try:
        model.generate(ids, draft_depth=4, **kw)
        error = None
    except ValueError as e:
        error = str(e)
    print(json.dumps({"module": type(model).__module__, "tokens": spec.tolist(), "error": error,
                      "library_loaded": sorted(m for m in sys.modules if m.startswith("hf_fixedpoint"))}))
    """
)


def test_the_export_decodes_speculatively_without_the_package(tmp_path):
    model = _model(0.6)
    ids, mask = _batch()
    model.save_pretrained(tmp_path / "ckpt")
    (tmp_path / "io").mkdir()
    torch.save((ids, mask), tmp_path / "io" / "inputs.pt")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf_home"), "PYTHONPATH": ""}
    proc = subprocess.run([sys.executable, "-c", _CHILD, str(tmp_path / "ckpt"), str(tmp_path / "io")], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["module"].startswith("transformers_modules.") and report["library_loaded"] == []
    full = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0,
                          total_ut_steps=4)
    assert torch.equal(torch.tensor(report["tokens"]), full)
    assert "draft_depth=4 is out of range" in report["error"] and "[1, 3]" in report["error"]
