"""Checks of self-speculative decoding (``generate(..., draft_depth=d)``, ``fp_speculative``) shared by the families
whose draft is their own ``forward`` at a smaller depth (SELF-LLaMA, SELF-Mistral: ``fp_max_iter=d``; Attractor LM:
``readout_iters=d``). Each family's ``test_speculative.py`` calls them with its tiny models."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from tests.models.fixed_point_tester import _CHILD as _REMOTE_CHILD

NEW = 8
EVERY_DRAFT = {"assistant_confidence_threshold": 0.0}  # drafts of the full length (no early stop on confidence)
# settings of the draft length: constant, one token a round, transformers' adaptive heuristic
DRAFT_SETTINGS = ({"num_assistant_tokens": 3, **EVERY_DRAFT}, {"num_assistant_tokens": 1},
                  {"num_assistant_tokens": 2, "num_assistant_tokens_schedule": "heuristic", **EVERY_DRAFT})


# SELF models: damped Picard to a tight tolerance, so that every solve of the tiny models converges (cached decoding
# equals a full recomputation only there, see docs/self_llama.md)
SELF_CONVERGED = {"fp_max_iter": 300, "fp_tol": 1e-6, "fp_solver": "picard", "fp_solver_kwargs": {"damping": 0.5}}


def self_model(model_class, config_class, tiny: dict, sharp: bool = True, dtype=torch.float64, **overrides):
    """A random SELF model. ``sharp``: larger weights and query / key projections scaled by 4, so that the iteration
    moves each layer's attention away from the base model's and the base model's tokens (``fp_max_iter=1``) are
    mostly not the full depth's; otherwise (initializer_range 0.02) the iteration barely moves the states and drafts
    are mostly accepted."""
    torch.manual_seed(0)
    config = config_class(**{**tiny, **SELF_CONVERGED, "initializer_range": 0.05 if sharp else 0.02, **overrides})
    model = model_class(config).to(dtype).eval()
    if sharp:
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.q_proj.weight.mul_(4.0)
                layer.self_attn.k_proj.weight.mul_(4.0)
    return model


def padded_batch(vocab: int = 99):
    """Three prompts of 6 tokens, two of them left-padded (by 3 and 1)."""
    ids = torch.randint(1, vocab, (3, 6), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    mask[2, :1] = 0
    return ids.masked_fill(mask == 0, 0), mask


def greedy(model, ids, mask, new=NEW, **kw):
    return model.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False, pad_token_id=0,
                          return_dict_in_generate=True, **kw)


def check_full_depth_tokens(model, depth: int, new=NEW, **kw):
    """``draft_depth`` greedy gives the tokens of full-depth greedy, for the padded batch (every draft-length
    setting) and for each row alone; returns the batch's output with its draft statistics."""
    ids, mask = padded_batch(model.config.vocab_size)
    full = greedy(model, ids, mask, new, **kw).sequences
    for setting in DRAFT_SETTINGS:
        spec = greedy(model, ids, mask, new, draft_depth=depth, **setting, **kw)
        assert torch.equal(spec.sequences, full), setting
    for row in range(ids.shape[0]):  # batch 1, no padding; it may stop early at the end token
        prompt = ids[row : row + 1, mask[row].bool()]
        alone = model.generate(prompt, max_new_tokens=new, do_sample=False, draft_depth=depth, num_assistant_tokens=3,
                               **EVERY_DRAFT, **kw)[0, prompt.shape[1]:]
        assert torch.equal(alone, full[row, ids.shape[1] : ids.shape[1] + len(alone)]), row
    return greedy(model, ids, mask, new, draft_depth=depth, num_assistant_tokens=3, **EVERY_DRAFT, **kw)


def acceptance(out) -> float:
    return float(out.accepted_draft_tokens.sum() / out.draft_tokens.sum())


def cache_entries(cache):
    """Per cache layer, the keys and values of its stored positions (a static layer's up to its length; a sliding
    window's last ones)."""
    return [(layer.keys[..., : int(layer.get_seq_length()), :], layer.values[..., : int(layer.get_seq_length()), :])
            for layer in cache.layers]


def check_cache_is_full_depth_greedy_s(model, make_cache, depth: int, draft_kwargs: dict, tol: float):
    """After speculative greedy decoding the cache holds full-depth greedy's entries (to within ``tol``: both come
    from solves stopped at a tolerance), not the draft's: a greedy run at the draft's depth (``draft_kwargs``)
    leaves entries further off. Rejected drafts were rolled back (the lengths agree)."""
    ids, mask = padded_batch(model.config.vocab_size)
    full = greedy(model, ids, mask, past_key_values=make_cache())
    spec = greedy(model, ids, mask, draft_depth=depth, num_assistant_tokens=3, past_key_values=make_cache(),
                  **EVERY_DRAFT)
    shallow = greedy(model, ids, mask, past_key_values=make_cache(), **draft_kwargs)
    assert torch.equal(spec.sequences, full.sequences)
    assert 0 < spec.accepted_draft_tokens.sum() < spec.draft_tokens.sum()  # drafts kept and drafts rolled back
    got, want = cache_entries(spec.past_key_values), cache_entries(full.past_key_values)
    assert len(got) == len(want) > 0
    worst = 0.0
    for layer, layer_ref in zip(spec.past_key_values.layers, full.past_key_values.layers):
        assert int(layer.get_seq_length()) == int(layer_ref.get_seq_length()) == ids.shape[1] + NEW - 1
    for (k, v), (k_ref, v_ref), (k_draft, _) in zip(got, want, cache_entries(shallow.past_key_values)):
        assert k.shape == k_ref.shape
        torch.testing.assert_close(k, k_ref, rtol=0, atol=tol)
        torch.testing.assert_close(v, v_ref, rtol=0, atol=tol)
        worst = max(worst, float((k_draft - k_ref).abs().max()))
    assert worst > 100 * tol, worst  # the draft's own keys are far from the full depth's


def distribution(tokens, vocab: int):
    """The empirical joint distribution of two token columns ``(N, 2)``."""
    codes = tokens[:, 0] * vocab + tokens[:, 1]
    return torch.bincount(codes, minlength=vocab * vocab).double() / len(tokens)


def check_sampling_keeps_the_full_depth_distribution(model, depth: int, draft_kwargs: dict, rows: int = 3000):
    """The speculative acceptance rule: the second and third sampled tokens (one draft, then the verification's next
    token) are distributed as full-depth sampling's, not as the draft's (total variation distance over the vocab^2
    outcomes; ``model`` has a vocabulary of 3)."""
    ids = torch.tensor([[1, 2, 1]]).repeat(rows, 1)
    kw = {"max_new_tokens": 3, "min_new_tokens": 3, "do_sample": True, "top_k": 0, "pad_token_id": 0}
    torch.manual_seed(1)
    full = distribution(model.generate(ids, **kw)[:, 4:], 3)
    torch.manual_seed(2)
    out = model.generate(ids, draft_depth=depth, num_assistant_tokens=2, return_dict_in_generate=True, **EVERY_DRAFT,
                         **kw)
    assert bool((out.draft_tokens == 1).all())  # one draft per row, accepted or not by the rule
    assert 0.2 < float(out.accepted_draft_tokens.double().mean()) < 0.95
    torch.manual_seed(3)
    draft = distribution(model.generate(ids, **draft_kwargs, **kw)[:, 4:], 3)
    tv = 0.5 * float((distribution(out.sequences[:, 4:], 3) - full).abs().sum())
    assert tv < 0.06, tv
    assert 0.5 * float((draft - full).abs().sum()) > 0.2  # the draft's own distribution is far off


def check_draft_depth_is_validated(model, full_depth: int, **kw):
    ids, mask = padded_batch(model.config.vocab_size)
    for depth in (0, full_depth, full_depth + 1, 1.5, -1):
        with pytest.raises(ValueError, match=rf"draft_depth.*(\[1, {full_depth - 1}\]|integer)"):
            greedy(model, ids, mask, draft_depth=depth, **kw)


# generate keywords the speculative loop refuses, and the error each gives
REFUSALS = [
    ({"num_beams": 2}, "num_beams=2"),
    ({"use_cache": False}, "use_cache=True"),
    ({"num_assistant_tokens": 0}, "num_assistant_tokens=0"),
    ({"num_assistant_tokens_schedule": "fast"}, "num_assistant_tokens_schedule"),
    ({"output_hidden_states": True}, "output_hidden_states"),
    ({"prompt_lookup_num_tokens": 3}, "prompt_lookup_num_tokens"),
]


def check_refused(model, match: str, **kw):
    ids, mask = padded_batch(model.config.vocab_size)
    with pytest.raises(ValueError, match=match):
        greedy(model, ids, mask, **kw)


# the child of the families' remote-code test, up to its imports: blocks every import of the package
_BLOCK = _REMOTE_CHILD[: _REMOTE_CHILD.index("import torch, transformers")]
_CHILD = _BLOCK + textwrap.dedent(
    """
    import torch, transformers
    ckpt, io, depth, bad = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    model = transformers.AutoModelForCausalLM.from_pretrained(ckpt, trust_remote_code=True).eval()
    ids, mask = torch.load(io + "/inputs.pt")
    kw = dict(attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
    spec = model.generate(ids, draft_depth=depth, num_assistant_tokens=3, **kw)
    try:
        model.generate(ids, draft_depth=bad, **kw)
        error = None
    except ValueError as e:
        error = str(e)
    print(json.dumps({"module": type(model).__module__, "tokens": spec.tolist(), "error": error,
                      "library_loaded": sorted(m for m in sys.modules if m.startswith("hf_fixedpoint"))}))
    """
)


def check_the_export_decodes_speculatively(model, tmp_path, depth: int, full_depth: int):
    """The saved checkpoint, loaded with torch + transformers only (every import of the package blocked), decodes
    with ``draft_depth`` to full-depth greedy's tokens and refuses ``draft_depth=full_depth`` naming the range."""
    ids, mask = padded_batch(model.config.vocab_size)
    model.save_pretrained(tmp_path / "ckpt")
    (tmp_path / "io").mkdir()
    torch.save((ids, mask), tmp_path / "io" / "inputs.pt")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf_home"), "PYTHONPATH": ""}
    proc = subprocess.run([sys.executable, "-c", _CHILD, str(tmp_path / "ckpt"), str(tmp_path / "io"), str(depth),
                           str(full_depth)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["module"].startswith("transformers_modules.") and report["library_loaded"] == []
    full = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert torch.equal(torch.tensor(report["tokens"]), full)
    assert f"draft_depth={full_depth} is out of range" in report["error"]
    assert f"[1, {full_depth - 1}]" in report["error"]
