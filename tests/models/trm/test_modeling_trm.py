"""TRM and Attractor-reasoning (``deq=True``): the shared tests run on the fixed-point variant; the baseline,
the phantom gradient and the Jacobian regularizer are tested here."""

import pytest
import torch

from hf_fixedpoint.core.fp_solvers import solve
from hf_fixedpoint.modeling import TRMConfig, TRMForPuzzles, TRMModel
from tests.models.puzzle_tester import PuzzleModelTesterMixin


class TestAttractorReasoning(PuzzleModelTesterMixin):
    config_class = TRMConfig
    model_classes = ((TRMModel, "AutoModel"),)
    puzzle_class = TRMForPuzzles
    config_kwargs = {"vocab_size": 11, "seq_len": 9, "hidden_size": 16, "num_attention_heads": 2,
                     "mlp_multiple_of": 8, "num_layers": 1, "num_puzzle_identifiers": 3, "H_cycles": 2,
                     "L_cycles": 2, "deq": True, "fp_max_iter": 30, "fp_min_iter": 0}

    causal_overrides = {"fp_solver": "picard", "fp_tol": 1e-30, "fp_min_iter": 0, "fp_max_iter": 4}

    # TRM's post-norm map at random init is not a Picard contraction to 1e-12; the phantom gradient that
    # Attractor-reasoning trains with is checked exactly below instead.
    test_implicit_gradient_matches_unrolled_float64 = None

    def test_phantom_gradient_float64(self):
        # H_cycles=1: z* = solve(z = net(z, y0 + x)); the phantom gradient is backprop through K = 2 steps from z*
        # (value z*), then y = net(y0, z). Recomputed by hand from the same pieces.
        model = self.build(TRMModel, H_cycles=1, fp_backward="phantom", fp_backward_steps=2, fp_solver="anderson",
                           fp_tol=1e-12, forward_dtype="float64").double().train()
        inputs = self.prepare_inputs(model.config)
        model(**inputs).last_hidden_state.pow(2).sum().backward()
        got = [p.grad.clone() for p in model.parameters()]
        model.zero_grad()
        x = model.trunk.embed(inputs["input_ids"], inputs["puzzle_identifiers"])
        state = model.fresh_state(3, x.device, 9)
        z_star, _ = solve(model.net, state["z"], args=(state["y"] + x,), solver="anderson", tol=1e-12, max_iter=30)
        z = z_star
        for _ in range(2):
            z = model.net(z, state["y"] + x)
        z = z_star + (z - z.detach())
        model.net(state["y"], z)[:, 1:].pow(2).sum().backward()
        for g, p in zip(got, model.parameters()):
            torch.testing.assert_close(g, p.grad, rtol=1e-9, atol=1e-12)

    def test_jacobian_regularizer(self):
        model = self.build(TRMForPuzzles, jacobian_reg_weight=1e-2).train()
        out = model(**self.puzzle_batch(model.config))
        assert out.metrics["aux_loss"] > 0
        out.loss.backward()
        assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
        base = self.build(TRMForPuzzles).train()(**self.puzzle_batch(model.config))
        assert "aux_loss" not in base.metrics
        with pytest.raises(ValueError, match="jacobian_reg_weight > 0 needs deq=True"):
            self.get_config(deq=False, jacobian_reg_weight=1e-3)

    def test_trm_baseline_unrolled_cycles(self):
        model = self.build(TRMForPuzzles, deq=False, H_cycles=3, L_cycles=2).train()
        batch = self.puzzle_batch(model.config)
        out = model(**batch, carry=model.initial_carry(4))
        assert (out.iterations == 6).all() and out.fp_stats.solver == "unrolled" and out.fp_stats.nfe == 2
        out.loss.backward()
        assert all(p.grad is not None for n, p in model.named_parameters())

    def test_trm_baseline_matches_the_recurrence_float64(self):
        model = self.build(TRMModel, deq=False, H_cycles=2, L_cycles=2, forward_dtype="float64").double().eval()
        inputs = self.prepare_inputs(model.config)
        with torch.no_grad():
            out = model(**inputs)
            x = model.trunk.embed(inputs["input_ids"], inputs["puzzle_identifiers"])
            s = model.fresh_state(3, x.device, 9)
            y, z = s["y"], s["z"]
            for _ in range(2):
                for _ in range(2):
                    z = model.net(z, y + x)
                y = model.net(y, z)
        torch.testing.assert_close(out.last_hidden_state, y[:, 1:], rtol=0, atol=0)

    def test_mlp_t_variant(self):
        model = self.build(TRMForPuzzles, deq=False, mlp_t=True, pos_encodings="none").train()
        out = model(**self.puzzle_batch(model.config))
        out.loss.backward()
        assert type(model.model.layers[0].mixer).__name__ == "SequenceMLP"
        with pytest.raises(ValueError, match="causal=True needs attention: mlp_t=True"):
            self.get_config(mlp_t=True, causal=True)

    @pytest.mark.parametrize("mlp_t", [False, True])
    def test_trm_baseline_with_learned_positions(self, mlp_t):
        # TRM itself (deq=False) with the research code's pos_encodings="learned" (HRM's Sudoku-Hard setting).
        model = self.build(TRMForPuzzles, deq=False, mlp_t=mlp_t, pos_encodings="learned").train()
        out = model(**self.puzzle_batch(model.config), carry=model.initial_carry(4))
        out.loss.backward()
        assert all(p.grad is not None for p in model.parameters())
        assert model.model.trunk.input.embed_pos.weight.grad.abs().sum() > 0

    def test_bad_trm_values(self):
        with pytest.raises(ValueError, match="H_cycles"):
            self.get_config(H_cycles=0)
        with pytest.raises(ValueError, match="deq must be True or False"):
            self.get_config(deq="yes")
