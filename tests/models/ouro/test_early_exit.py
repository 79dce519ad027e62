"""Ouro's early exit that skips compute (``exit_mode="skip"``): the same tokens batched and alone, the full depth when
no exit fires, the cache against a reference built by the documented rule (every token runs every loop; an exited
token's state is frozen and its later cache entries are copies of its exit loop's), the reported exit loops and
FLOPs, and bad input."""

import math

import pytest
import torch
from transformers import DynamicCache, StaticCache

from hf_fixedpoint.modeling import OuroConfig, OuroForCausalLM
from hf_fixedpoint.modeling.ouro import modeling_ouro
from hf_fixedpoint.modeling.ouro.fp_compat import create_causal_mask
from hf_fixedpoint.modeling.ouro.modeling_ouro import ExitRule, adaptive_gate_loss, loop_change

TINY = {"vocab_size": 99, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "max_position_embeddings": 64, "total_ut_steps": 4, "pad_token_id": 0,
        "loop_guard_tol": None}


def _model(**overrides):
    """A random model whose exit gate is sharpened: at threshold 0.6 its tokens exit at different loops."""
    torch.manual_seed(0)
    model = OuroForCausalLM(OuroConfig(**{**TINY, **overrides})).double().eval()
    with torch.no_grad():
        model.model.early_exit_gate.weight.mul_(6.0)
    return model


def _padded_batch():
    """Three prompts of lengths 4, 7 and 5, left-padded to 7."""
    torch.manual_seed(1)
    prompts = [torch.randint(1, 99, (n,)) for n in (4, 7, 5)]
    ids = torch.zeros(3, 7, dtype=torch.long)
    mask = torch.zeros(3, 7, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, -len(prompt):], mask[row, -len(prompt):] = prompt, 1
    return prompts, ids, mask


@pytest.mark.parametrize("exit_kw", [{"exit_mode": "select", "exit_threshold": 0.6},
                                     {"exit_mode": "skip", "exit_threshold": 0.6},
                                     {"exit_mode": "skip", "exit_tol": 0.6}])
def test_left_padded_batch_generates_the_tokens_of_each_prompt_alone(exit_kw):
    model = _model()
    prompts, ids, mask = _padded_batch()
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0, return_dict_in_generate=True, **exit_kw)
    with torch.no_grad():
        batched = model.generate(ids, attention_mask=mask, **kw)
        for row, prompt in enumerate(prompts):
            alone = model.generate(prompt[None], attention_mask=torch.ones(1, len(prompt), dtype=torch.long), **kw)
            assert torch.equal(batched.sequences[row, 7:], alone.sequences[0, len(prompt):])
            assert torch.equal(batched.exit_loop[row], alone.exit_loop[0])
    if exit_kw["exit_mode"] == "skip":  # the exit fired for some tokens and not for others
        assert (batched.exit_loop < 3).any() and (batched.exit_loop == 3).any()


def test_a_threshold_that_never_fires_runs_the_full_depth_exactly():
    model = _model()
    _, ids, mask = _padded_batch()
    with torch.no_grad():
        full = model(ids, attention_mask=mask, exit_threshold=1.0, use_cache=True)
        skip = model(ids, attention_mask=mask, exit_threshold=1.0, exit_mode="skip", use_cache=True)
        assert torch.equal(skip.logits, full.logits)
        assert (skip.exit_loop == 3).all() and torch.equal(skip.flops, full.flops)
        for a, b in zip(skip.past_key_values.layers, full.past_key_values.layers):
            assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
        kw = dict(attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0, exit_threshold=1.0)
        assert torch.equal(model.generate(ids, exit_mode="skip", **kw), model.generate(ids, **kw))


class _RuleCache:
    """The documented rule, written independently of the gathered computation: every token runs every loop, and a
    write of an exited token's keys and values to slot ``(t, l)`` is replaced by its entries of slot ``(t - 1, l)``."""

    def __init__(self, cache, num_layers, seq):
        self.cache, self.num_layers, self.seq, self.exited = cache, num_layers, seq, None

    def update(self, keys, values, slot, *args, **kwargs):
        if self.exited is not None:
            latest = self.cache.layers[slot - self.num_layers]
            frozen = self.exited[:, None, :, None]
            keys = torch.where(frozen, latest.keys[:, :, -self.seq:], keys)
            values = torch.where(frozen, latest.values[:, :, -self.seq:], values)
        return self.cache.update(keys, values, slot, *args, **kwargs)


def _reference_step(model, ids, mask, position_ids, cache, threshold):
    """One call under the rule: returns the last state (an exited token's is its exit state) and the exit loops."""
    inner, loops, num_layers = model.model, model.config.total_ut_steps, model.config.num_hidden_layers
    embeds = inner.embed_tokens(ids)
    inner._prepare_cache(cache, loops)
    causal = create_causal_mask(config=model.config, inputs_embeds=embeds, attention_mask=mask,
                                past_key_values=cache, position_ids=position_ids)
    rope = inner.rotary_emb(embeds, position_ids=position_ids)
    rule, exit_rule = _RuleCache(cache, num_layers, ids.shape[1]), ExitRule(threshold)
    state = embeds
    exited = torch.zeros(ids.shape, dtype=torch.bool)
    exit_loop = torch.full(ids.shape, loops - 1)
    for t in range(loops):
        rule.exited = exited if t else None
        new = torch.where(exited[..., None], state, inner.loop(state, causal, rope, rule, offset=t * num_layers))
        if t < loops - 1:
            fired = ~exited & exit_rule(inner.early_exit_gate(new), state if t else None, new)
            exit_loop[fired] = t
            exited = exited | fired
        state = new
    return state, exit_loop


def _record_running_sets(monkeypatch):
    """Counts the kinds of running sets built (decoding; packed prompt with every row running, or with the rows
    gathered) and the partial loops that reused the previous loop's set and states."""
    seen = {"decode": 0, "every row": 0, "rows gathered": 0, "reused": 0, "built": 0}
    build, run = modeling_ouro._RunningSet.__init__, modeling_ouro.OuroModel._loop_running

    def counted_build(self, *args):
        build(self, *args)
        seen["decode" if self.valid is None else "every row" if self.rows is None else "rows gathered"] += 1

    def counted_run(self, hidden_states, running, cache, offset, x=None):
        seen["built" if x is None else "reused"] += 1
        return run(self, hidden_states, running, cache, offset, x)

    monkeypatch.setattr(modeling_ouro._RunningSet, "__init__", counted_build)
    monkeypatch.setattr(modeling_ouro.OuroModel, "_loop_running", counted_run)
    return seen


def test_cache_and_outputs_equal_a_reference_built_by_the_rule_float64(monkeypatch):
    seen = _record_running_sets(monkeypatch)
    model = _model()
    _, ids, mask = _padded_batch()
    position_ids = (mask.cumsum(-1) - 1).clamp_min(0)
    cache, reference = DynamicCache(), DynamicCache()
    exits = []
    with torch.no_grad():
        for step in range(3):  # the prompt, then two decoding steps
            out = model(ids, attention_mask=mask, position_ids=position_ids, past_key_values=cache, use_cache=True,
                        exit_mode="skip", exit_threshold=0.6)
            state, exit_loop = _reference_step(model, ids, mask, position_ids, reference, 0.6)
            valid = mask[:, -ids.shape[1]:].bool()
            assert torch.equal(out.exit_loop[valid], exit_loop[valid])
            torch.testing.assert_close(out.logits[valid], model.lm_head(state)[valid])
            for ours, theirs in zip(cache.layers, reference.layers):  # padding positions are never attended
                keep = mask.bool()[:, None, :, None]
                for a, b in ((ours.keys, theirs.keys), (ours.values, theirs.values)):
                    torch.testing.assert_close(torch.where(keep, a, 0.0), torch.where(keep, b, 0.0))
            exits.append(exit_loop[valid])
            ids = out.logits[:, -1:].argmax(-1)
            mask = torch.cat([mask, torch.ones_like(ids)], dim=-1)
            position_ids = position_ids[:, -1:] + 1
    exits = torch.cat(exits)
    assert (exits < 3).any() and (exits == 3).any() and len(set(exits.tolist())) >= 2
    # every kind of running set was built, and a loop reused the previous loop's set (no token exited in between)
    assert min(seen.values()) > 0, seen


def test_loop_change_of_loops_run_on_no_token_is_zero_float64():
    model = _model(total_ut_steps=6)
    _, ids, mask = _padded_batch()
    with torch.no_grad():
        # threshold 0: every token exits after loop 0; tolerance 10: after loop 1 (its change is below 10)
        for kw, exit_at in (({"exit_threshold": 0.0}, 0), ({"exit_tol": 10.0}, 1)):
            out = model(ids, attention_mask=mask, exit_mode="skip", **kw)
            states = out.loop_hidden_states
            assert (out.exit_loop == exit_at).all() and all(s is states[exit_at] for s in states[exit_at:])
            assert (out.loop_change[:, :exit_at] > 0).all() and (out.loop_change[:, exit_at:] == 0).all()
            copies = [s.clone() for s in states]  # no repeated objects: every pair computed
            torch.testing.assert_close(out.loop_change, loop_change(copies, mask), rtol=0, atol=0)


def test_reported_flops_follow_the_loops_run():
    model = _model()
    _, ids, mask = _padded_batch()
    kw = dict(attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0, return_dict_in_generate=True,
              exit_threshold=0.6)
    with torch.no_grad():
        skip = model.generate(ids, exit_mode="skip", **kw)
        full = model.generate(ids, **kw)
    cfg, head = model.config, 2 * model.config.hidden_size * model.config.vocab_size
    for step in range(4):
        keys = 7 + step  # positions attended by the token of this step
        expected = (skip.exit_loop[:, step] + 1).double() * model.model.loop_flops(keys) + head
        torch.testing.assert_close(skip.flops[:, step].double(), expected)
        torch.testing.assert_close(full.flops[:, step].double(),
                                   torch.full((3,), cfg.total_ut_steps * model.model.loop_flops(keys) + head,
                                              dtype=torch.float64))
    assert (skip.flops < full.flops).any() and (skip.flops <= full.flops).all()


def test_exit_settings_are_validated_and_load_time_overrides_apply(tmp_path):
    model = _model()
    ids = torch.randint(1, 99, (2, 5))
    with pytest.raises(ValueError, match="exit_mode='fast' is not allowed. Allowed values: 'select', 'skip'"):
        model(ids, exit_mode="fast")
    with pytest.raises(ValueError, match=r"exit_threshold=1.5 is out of range; allowed values lie in \[0.0, 1.0\]"):
        model(ids, exit_threshold=1.5, exit_mode="skip")
    with pytest.raises(ValueError, match=r"exit_tol=-0.1 is out of range"):
        model(ids, exit_tol=-0.1)
    with pytest.raises(ValueError, match="early_exit_mode='fast' is not allowed"):
        OuroConfig(**TINY, early_exit_mode="fast")
    with pytest.raises(ValueError, match="early_exit_tol=-1 is out of range"):
        OuroConfig(**TINY, early_exit_tol=-1)
    with pytest.raises(ValueError, match="exit_at_step.*use exit_mode='select'"):
        model(ids, exit_mode="skip", exit_at_step=1)
    with pytest.raises(ValueError, match="needs a DynamicCache; got StaticCache"):
        model(ids, exit_mode="skip", past_key_values=StaticCache(config=model.config, max_cache_len=8),
              use_cache=True)
    with pytest.raises(ValueError, match="output_hidden_states=True is not supported with exit_mode='skip'"):
        model(ids, exit_mode="skip", output_hidden_states=True)
    model.save_pretrained(tmp_path)
    loaded = OuroForCausalLM.from_pretrained(tmp_path, early_exit_mode="skip", early_exit_threshold=0.6,
                                             early_exit_tol=0.3).double().eval()
    assert (loaded.config.early_exit_mode, loaded.config.early_exit_tol) == ("skip", 0.3)
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids, exit_mode="skip", exit_threshold=0.6,
                                                             exit_tol=0.3).logits)


def test_adaptive_gate_loss_is_the_stage_two_bce_float64():
    """BCE(1 - lambda_t, sigmoid(k (max(0, L_{t-1} - L_t) - gamma))) over t = 2..T, by hand."""
    gate = torch.tensor([[[0.3, -1.2, 2.0], [1.0, 0.5, -0.5]]], dtype=torch.float64, requires_grad=True)  # (1, 2, 3)
    losses = torch.tensor([[[2.0, 1.0, 0.999], [0.5, 0.7, 0.69]]], dtype=torch.float64, requires_grad=True)
    k, gamma = 50.0, 0.005

    def bce(g, improvement):
        lam, w = 1 / (1 + math.exp(-g)), 1 / (1 + math.exp(-k * (improvement - gamma)))
        return -(w * math.log(1 - lam) + (1 - w) * math.log(lam))

    # token 0: loop 2 improves by 1.0 (continue), loop 3 by 0.001 (< gamma: exit); token 1: no improvement, then 0.01
    tok0 = (bce(-1.2, 1.0) + bce(2.0, 0.001)) / 2
    tok1 = (bce(0.5, 0.0) + bce(-0.5, 0.01)) / 2
    loss = adaptive_gate_loss(gate, losses, k=k, gamma=gamma)
    assert loss.item() == pytest.approx((tok0 + tok1) / 2, rel=1e-12)
    masked = adaptive_gate_loss(gate, losses, torch.tensor([[False, True]]), k=k, gamma=gamma)
    assert masked.item() == pytest.approx(tok1, rel=1e-12)
    loss.backward()
    assert losses.grad is None  # the LM losses are targets
    assert gate.grad[..., 0].abs().max() == 0 and gate.grad[..., 1:].abs().min() > 0  # loop 1 has no target
    with pytest.raises(ValueError, match="T >= 2 loops"):
        adaptive_gate_loss(gate[..., :1], losses[..., :1])
