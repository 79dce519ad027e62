"""URM: the shared tests (the forward-only loops are a Picard solve) plus ConvSwiGLU and truncated backprop."""

import pytest
import torch

from hf_fixedpoint.core.fp_reasoning import ConvSwiGLU
from hf_fixedpoint.modeling import URMConfig, URMForPuzzles, URMModel
from tests.models.puzzle_tester import PuzzleModelTesterMixin


class TestURM(PuzzleModelTesterMixin):
    config_class = URMConfig
    model_classes = ((URMModel, "AutoModel"),)
    puzzle_class = URMForPuzzles
    config_kwargs = {"vocab_size": 11, "seq_len": 9, "hidden_size": 16, "num_attention_heads": 2,
                     "mlp_multiple_of": 8, "num_layers": 2, "num_puzzle_identifiers": 3, "L_cycles": 2,
                     "fp_max_iter": 3}
    causal_overrides = {"fp_tol": 1e-30}

    # URM backpropagates through its last L_cycles loops directly; the implicit/unrolled comparison of the
    # fixed-point tester does not apply (no fp_backward mode is used).
    test_implicit_gradient_matches_unrolled_float64 = None

    def test_loops_and_truncated_backprop_float64(self):
        model = self.build(URMModel, forward_dtype="float64").double().train()
        inputs = self.prepare_inputs(model.config)
        out = model(**inputs)
        assert (out.iterations == 5).all() and out.fp_stats.nfe == 3
        x = model.trunk.embed(inputs["input_ids"], inputs["puzzle_identifiers"])
        h = model.fresh_state(3, x.device, 9)["h"]
        with torch.no_grad():
            for _ in range(3):
                h = model.loop(h, x)
        h_free = h
        for _ in range(2):
            h = model.loop(h, x)
        torch.testing.assert_close(out.last_hidden_state, h[:, 1:], rtol=0, atol=0)
        # The forward-only loops carry no graph: the output's gradient w.r.t. their result exists only through
        # the last two loops.
        assert not h_free.requires_grad and out.last_hidden_state.requires_grad

    def test_conv_swiglu_is_causal_over_tokens(self):
        torch.manual_seed(0)
        mlp = ConvSwiGLU(8, 16).double()
        x = torch.randn(2, 5, 8, dtype=torch.float64)
        x2 = x.clone()
        x2[:, 3] += 1.0
        a, b = mlp(x), mlp(x2)
        torch.testing.assert_close(a[:, :3], b[:, :3], rtol=0, atol=0)
        assert not torch.allclose(a[:, 3:], b[:, 3:])
        assert type(self.build(URMModel).layers[0].mlp).__name__ == "ConvSwiGLU"

    def test_eval_loop_budget(self):
        model = self.build(URMModel, fp_eval_max_iter=7).eval()
        with torch.no_grad():
            out = model(**self.prepare_inputs(model.config))
        assert out.fp_stats.nfe == 7 and (out.iterations == 9).all()

    def test_bad_urm_values(self):
        with pytest.raises(ValueError, match="L_cycles"):
            self.get_config(L_cycles=0)
