"""FPSA-ViT: the shared tests, exactness against transformers' ViT (checkpoints saved with the transformers-4 key
names), the fixed point itself, and the bad-input errors."""

import inspect

import pytest
import torch
from transformers import BertConfig, BertModel, ViTConfig, ViTForImageClassification, ViTModel

from hf_fixedpoint.modeling import FPSAViTConfig, FPSAViTForImageClassification, FPSAViTModel
from tests.models.fixed_point_tester import FixedPointModelTesterMixin

TINY = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 37,
        "image_size": 16, "patch_size": 4, "num_labels": 3}


def _pixels(batch_size=3):
    return torch.randn(batch_size, 3, 16, 16, generator=torch.Generator().manual_seed(0))


class TestFPSAViT(FixedPointModelTesterMixin):
    config_class = FPSAViTConfig
    model_classes = ((FPSAViTModel, "AutoModel"), (FPSAViTForImageClassification, "AutoModelForImageClassification"))
    config_kwargs = TINY

    def prepare_inputs(self, config, batch_size=None):
        return {"pixel_values": _pixels(batch_size or self.batch_size)}

    def test_forward_shapes_and_stats(self):
        inputs = self.prepare_inputs(self.get_config())
        hidden = self.build(FPSAViTModel).eval()(**inputs)
        assert hidden.last_hidden_state.shape == (3, 17, 32) and hidden.fp_stats.iterations.shape == (2, 3, 17, 4)
        logits = self.build(FPSAViTForImageClassification).eval()(**inputs).logits
        assert logits.shape == (3, 3) and torch.isfinite(logits).all()

    def test_remote_code_round_trip(self, tmp_path):
        # The child backpropagates from last_hidden_state, which never reaches ViTModel's pooler: run the head.
        self.model_classes = self.model_classes[1:]
        super().test_remote_code_round_trip(tmp_path)


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_one_iteration_is_exactly_vit_from_a_saved_checkpoint(tmp_path, impl):
    torch.manual_seed(0)
    ViTForImageClassification(ViTConfig(**TINY)).double().save_pretrained(tmp_path)  # transformers-4 key names
    # Both sides load the same file the same way (an in-memory copy differs in weight memory layout, ~1e-16).
    base = ViTForImageClassification.from_pretrained(tmp_path, attn_implementation=impl, dtype=torch.float64).eval()
    model = FPSAViTForImageClassification.from_pretrained(tmp_path, fp_max_iter=1, attn_implementation=impl,
                                                          dtype=torch.float64).eval()
    x = _pixels(2).double()
    with torch.no_grad():
        torch.testing.assert_close(model(x).logits, base(x).logits, rtol=0, atol=0)
        more = model(x, fp_overrides={"fp_max_iter": 50, "fp_tol": 1e-12})
    assert more.fp_stats.all_converged and (more.logits - base(x).logits).abs().max() > 1e-9


def test_converged_output_is_a_fixed_point_of_the_attention_block():
    torch.manual_seed(0)
    model = FPSAViTModel(FPSAViTConfig(**TINY, fp_tol=1e-13, fp_max_iter=300)).double().eval()
    layer = model.layers[0]
    captured = {}
    layer.attention.register_forward_hook(
        lambda mod, args, kw, out: captured.update(h=kw["fpsa_residual"], out=out[0]), with_kwargs=True)
    with torch.no_grad():
        model(_pixels(2).double())
        h, o = captured["h"], captured["out"]  # o = W_O O*, the block's attention output at the fixed point
        att = layer.attention
        z = layer.layernorm_before(h + o)  # residual_norm iterate at the fixed point
        B, T, D = z.shape

        def heads(t):
            return t.view(B, T, 4, D // 4).transpose(1, 2)

        a = torch.softmax(heads(att.q_proj(z)) @ heads(att.k_proj(z)).transpose(-1, -2) * att.scaling, -1)
        again = att.o_proj((a @ heads(att.v_proj(layer.layernorm_before(h)))).transpose(1, 2).reshape(B, T, D))
    torch.testing.assert_close(again, o, rtol=0, atol=1e-10)


def test_learned_halting_and_spectral_norm_on_vit():
    torch.manual_seed(0)
    model = FPSAViTForImageClassification(FPSAViTConfig(**TINY, fpsa_halting="learned", fpsa_spectral_norm="qko",
                                                        fp_max_iter=5)).train()
    out = model(_pixels(2), labels=torch.tensor([0, 2]))
    out.loss.backward()
    assert torch.isfinite(out.loss) and int(out.fp_stats.iterations.max()) <= 5
    gate = model.vit.layers[0].attention.fpsa_halt_gate
    assert gate.bias.grad is not None
    assert (gate.weight.grad != 0).all()  # all three features (change, entropy, classifier margin) reach the gate


def test_bad_input_errors(tmp_path):
    with pytest.raises(ValueError, match="hidden_size=30 must be divisible by num_attention_heads=4"):
        FPSAViTConfig(**{**TINY, "hidden_size": 30})
    with pytest.raises(ValueError, match="fp_tol"):
        FPSAViTConfig(**TINY, fp_tol=-1.0)
    with pytest.raises(ValueError, match="fp_max_iter"):
        FPSAViTConfig(**TINY, fp_max_iter=0)
    with pytest.raises(ValueError, match="fpsa_step_norm='l2'"):
        FPSAViTConfig(**TINY, fpsa_step_norm="l2")
    BertModel(BertConfig(vocab_size=50, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                         intermediate_size=37)).save_pretrained(tmp_path / "bert")
    with pytest.raises(ValueError, match="model_type='bert' is not one of"):
        FPSAViTModel.from_pretrained(tmp_path / "bert")
    ViTModel(ViTConfig(**TINY)).save_pretrained(tmp_path / "vit")
    with pytest.raises(ValueError, match="fpsa_spectral_norm cannot be set while loading a plain ViT"):
        FPSAViTModel.from_pretrained(tmp_path / "vit", fpsa_spectral_norm="qk")


def test_head_signature_and_standard_output_switches():
    # Trainer keeps the inputs forward's signature names; config.output_attentions is read like the call argument;
    # return_dict=False gives tuples.
    config = FPSAViTConfig(**TINY, attn_implementation="eager", output_attentions=True)
    torch.manual_seed(0)
    model = FPSAViTForImageClassification(config).eval()
    assert {"pixel_values", "labels", "fp_overrides"} <= set(inspect.signature(model.forward).parameters)
    with torch.no_grad():
        out = model(_pixels(2))
        as_tuple = model(_pixels(2), return_dict=False)
        base_tuple = model.vit(_pixels(2), return_dict=False)
    assert len(out.attentions) == 2 and all(a.shape == (2, 4, 17, 17) for a in out.attentions)
    assert isinstance(as_tuple, tuple) and isinstance(base_tuple, tuple)
    torch.testing.assert_close(as_tuple[0], out.logits, rtol=0, atol=0)
