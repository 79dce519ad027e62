"""Checks every causal-LM family shares (DEQ-LM, Attractor LM, Ouro): transformers' standard output switches, loss
keyword arguments, and left-padded batched generation against one-by-one generation.

A family's test class mixes ``CausalLMChecksMixin`` into its ``FixedPointModelTesterMixin`` subclass (or uses it
alone with ``build``) and sets ``lm_class``; ``lm_overrides`` are config overrides that make the solve converge
tightly enough for the padding comparison.
"""

import torch
from torch.nn import functional as F


class CausalLMChecksMixin:
    lm_class = None
    lm_overrides = {}
    num_layers_reported = None  # len(hidden_states) - 1 and len(attentions)

    def _lm(self, **overrides):
        return self.build(self.lm_class, **{**self.lm_overrides, **overrides}).eval()

    def _ids(self, model, batch_size=2, length=6, seed=0):
        g = torch.Generator().manual_seed(seed)
        return torch.randint(1, model.config.vocab_size, (batch_size, length), generator=g)

    def test_standard_output_switches(self):
        model = self._lm(attn_implementation="eager")
        ids = self._ids(model)
        with torch.no_grad():
            out = model(ids, output_hidden_states=True, output_attentions=True)
            as_tuple = model(ids, return_dict=False)
            base_tuple = model.base_model(ids, return_dict=False)
        n = self.num_layers_reported
        assert len(out.hidden_states) == n + 1 and len(out.attentions) == n
        assert all(h.shape == (2, 6, model.config.hidden_size) for h in out.hidden_states)
        for a in out.attentions:
            assert a.shape[0] == 2 and a.shape[-2:] == (6, 6)
            torch.testing.assert_close(a.sum(-1), torch.ones_like(a.sum(-1)))
            assert (a.triu(1) == 0).all()  # causal
        assert isinstance(as_tuple, tuple) and isinstance(base_tuple, tuple)
        torch.testing.assert_close(as_tuple[0], out.logits, rtol=1e-6, atol=1e-6)
        model.config.output_hidden_states = True
        with torch.no_grad():
            assert len(model(ids).hidden_states) == n + 1

    def test_loss_receives_the_loss_keyword_arguments(self):
        # Trainer passes num_items_in_batch; sequence / context parallel training passes shift_labels.
        model = self._lm()
        ids = self._ids(model)
        shift = self._ids(model, seed=1)
        with torch.no_grad():
            out = model(ids, labels=ids, shift_labels=shift)
            summed = model(ids, labels=ids, num_items_in_batch=torch.tensor(3))
        V = model.config.vocab_size
        expected = F.cross_entropy(out.logits.float().view(-1, V), shift.view(-1))
        torch.testing.assert_close(out.loss, expected)
        targets = F.pad(ids, (0, 1), value=-100)[:, 1:]
        total = F.cross_entropy(out.logits.float().view(-1, V), targets.reshape(-1), reduction="sum")
        torch.testing.assert_close(summed.loss, total / 3)

    def test_left_padded_batch_generates_as_one_by_one(self):
        model = self._lm(pad_token_id=0)
        prompts = [self._ids(model, 1, n, seed=n)[0] for n in (3, 6)]
        T = 6
        ids = torch.zeros(2, T, dtype=torch.long)
        mask = torch.zeros(2, T, dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, T - len(p):], mask[i, T - len(p):] = p, 1
        kw = {"max_new_tokens": 4, "do_sample": False, "pad_token_id": 0, "output_scores": True,
              "return_dict_in_generate": True}
        with torch.no_grad():
            batched = model.generate(ids, attention_mask=mask, **kw)
            for i, p in enumerate(prompts):
                alone = model.generate(p[None], **kw)
                torch.testing.assert_close(batched.sequences[i, T:], alone.sequences[0, len(p):])
                for step_b, step_a in zip(batched.scores, alone.scores):
                    torch.testing.assert_close(step_b[i], step_a[0], rtol=1e-4, atol=1e-4)
