"""DEQ-LM: the shared tests plus generation and the causal structure."""

import torch

from hf_fixedpoint.modeling import DEQLMConfig, DEQLMForCausalLM, DEQLMModel
from tests.models.causal_lm_checks import CausalLMChecksMixin
from tests.models.fixed_point_tester import FixedPointModelTesterMixin


class TestDEQLM(CausalLMChecksMixin, FixedPointModelTesterMixin):
    config_class = DEQLMConfig
    model_classes = ((DEQLMModel, "AutoModel"), (DEQLMForCausalLM, "AutoModelForCausalLM"))
    config_kwargs = {"vocab_size": 99, "hidden_size": 32, "intermediate_size": 37, "num_attention_heads": 4,
                     "max_position_embeddings": 64, "fp_max_iter": 30}
    lm_class = DEQLMForCausalLM
    lm_overrides = {"fp_tol": 1e-7, "fp_max_iter": 100}
    num_layers_reported = 1  # one weight-tied block: hidden_states = (injection, fixed point)

    def test_causal(self):
        # Changing a later token must not change earlier positions' outputs (per-token exactness up to tolerance).
        model = self.build(DEQLMForCausalLM, fp_tol=1e-10, fp_max_iter=200).eval()
        ids = torch.randint(0, 99, (1, 7))
        ids2 = ids.clone()
        ids2[0, -1] = (ids[0, -1] + 1) % 99
        with torch.no_grad():
            a, b = model(ids).logits, model(ids2).logits
        torch.testing.assert_close(a[:, :-1], b[:, :-1], rtol=0, atol=1e-6)

    def test_loss_and_generate_with_knobs(self):
        model = self.build(DEQLMForCausalLM).eval()
        ids = torch.randint(0, 99, (2, 5))
        out = model(ids, labels=ids)
        assert out.loss.ndim == 0 and torch.isfinite(out.loss)
        gen = model.generate(ids, max_new_tokens=3, do_sample=False, fp_overrides={"fp_max_iter": 4})
        assert gen.shape == (2, 8) and torch.equal(gen[:, :5], ids)

    def test_bad_architecture_values(self):
        import pytest

        with pytest.raises(ValueError, match="hidden_size=30 must be divisible by num_attention_heads=4"):
            DEQLMConfig(hidden_size=30, num_attention_heads=4)
        with pytest.raises(ValueError, match="vocab_size must be a positive integer"):
            DEQLMConfig(vocab_size=0)
