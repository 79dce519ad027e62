"""FPRM: the shared tests plus the residual-scaling algebra, the exact fixed point, windows and every option."""

import pytest
import torch

from hf_fixedpoint.modeling import FPRMConfig, FPRMForPuzzles, FPRMModel
from tests.models.puzzle_tester import PuzzleModelTesterMixin


class TestFPRM(PuzzleModelTesterMixin):
    config_class = FPRMConfig
    model_classes = ((FPRMModel, "AutoModel"),)
    puzzle_class = FPRMForPuzzles
    config_kwargs = {"vocab_size": 11, "seq_len": 9, "hidden_size": 16, "num_attention_heads": 2,
                     "mlp_multiple_of": 8, "num_layers": 2, "num_puzzle_identifiers": 3, "fp_max_iter": 30,
                     "bptt_window": 3, "init_std": 1.0, "fp_eval_max_iter": None}

    causal_overrides = {"fp_solver": "picard", "fp_tol": 1e-30, "fp_max_iter": 6, "conv": "1d", "conv_kernel": 4,
                        "puzzle_emb_len": 0, "pos_encodings": "none"}

    # Random tiny FPRM maps are not Picard contractions to 1e-12 (FPRM relies on its damped solver); the implicit
    # gradient is checked exactly on the linear case below instead.
    test_implicit_gradient_matches_unrolled_float64 = None

    def silent(self, **overrides):
        """A float64 model whose sublayers output zero: ``f(y) = a1^(2L) (a2 y + b2 x)``, fixed point ``a1^(2L) x``."""
        model = self.build(FPRMModel, fp_solver="picard", fp_norm="l2", fp_tol=1e-13, fp_max_iter=300,
                           **overrides).double()
        with torch.no_grad():
            for layer in model.layers:
                layer.mixer.o_proj.weight.zero_()
                layer.mlp.down_proj.weight.zero_()
        return model

    def test_beta_derivation_float64(self):
        model = self.build(FPRMModel, alpha_1_init=0.6, alpha_2_init=0.3, num_layers=3).double()
        a1, a2, b1, b2 = model.residual_scales()
        torch.testing.assert_close(a1, torch.full((16,), 0.6, dtype=torch.float64), rtol=1e-7, atol=0)
        torch.testing.assert_close(a2, torch.full((16,), 0.3, dtype=torch.float64), rtol=1e-7, atol=0)
        p = a1**6  # 2L sublayers with L = 3 blocks
        torch.testing.assert_close(b2, 1 - a2 * p, rtol=1e-15, atol=0)
        torch.testing.assert_close(b1, (1 - a2 * p) * (1 - a1) / (1 - p + 1e-5), rtol=1e-15, atol=0)

    @pytest.mark.parametrize("backward", ["ift", "bptt"])
    def test_implicit_gradient_of_the_linear_case_float64(self, backward):
        # y* = a1^4 x: the loss sum(y*^2) does not depend on alpha_2, and d/d theta_1 = sum 2 y* 4 a1^3 a1 (1 - a1) x.
        extra = {"fp_backward_steps": None} if backward == "bptt" else {"fp_backward_tol": 1e-13}
        model = self.silent(fp_backward=backward, **extra).train()
        inputs = self.prepare_inputs(model.config)
        out = model(**inputs)
        assert out.fp_stats.converged.all()
        out.last_hidden_state.pow(2).sum().backward()
        x = model.trunk.embed(inputs["input_ids"], inputs["puzzle_identifiers"]).detach()[:, 1:]
        a1 = torch.sigmoid(model.alpha_logits[0].detach())
        expected = (2 * a1**4 * x * 4 * a1**3 * a1 * (1 - a1) * x).sum((0, 1))
        torch.testing.assert_close(model.alpha_logits.grad[0], expected, rtol=1e-9, atol=1e-12)
        torch.testing.assert_close(model.alpha_logits.grad[1], torch.zeros(16, dtype=torch.float64), rtol=0,
                                   atol=1e-9)

    def test_exact_fixed_point_with_silent_sublayers_float64(self):
        # f(y) = a1^(2L) (a2 y + b2 x) has the fixed point a1^(2L) b2 x / (1 - a1^(2L) a2) = a1^(2L) x, because
        # b2 = 1 - a2 a1^(2L): the beta tying makes the fixed point independent of alpha_2.
        model = self.silent().eval()
        inputs = self.prepare_inputs(model.config)
        with torch.no_grad():
            out = model(**inputs)
            x = model.trunk.embed(inputs["input_ids"], inputs["puzzle_identifiers"])
            a1 = torch.sigmoid(model.alpha_logits[0])
        assert out.fp_stats.converged.all()
        torch.testing.assert_close(out.last_hidden_state, (a1**4 * x)[:, 1:], rtol=1e-10, atol=1e-10)

    def test_training_windows_halt_per_sample(self):
        model = self.build(FPRMForPuzzles, bptt_window=2, fp_max_iter=5, fp_tol=1e-12).train()
        batch = self.puzzle_batch(model.config)
        carry = model.initial_carry(4)
        out = model(**batch, carry=carry)
        assert out.fp_stats.nfe == 2 and (out.iterations == 2).all() and not out.carry["halted"].any()
        out = model(**batch, carry=out.carry)
        assert (out.carry["state"]["iterations"] == 4).all()
        out = model(**batch, carry=out.carry)  # the cap of 5 solver steps halts every puzzle after one more step
        assert (out.iterations == 5).all() and out.carry["halted"].all()
        assert "solver_s" in out.carry["state"]  # fpopt's per-sample step size travels with the carry

    def test_stop_fraction_ends_a_window_early(self):
        model = self.build(FPRMForPuzzles, bptt_window=6, fp_tol=1e9, fp_stop_fraction=0.5).train()
        out = model(**self.puzzle_batch(model.config), carry=model.initial_carry(4))
        assert out.fp_stats.nfe == 1 and out.carry["halted"].all()  # everything "converges" at once

    def test_window_needs_a_carryable_solver(self):
        model = self.build(FPRMForPuzzles, fp_solver="anderson").train()
        with pytest.raises(ValueError, match="deep-supervision windows need fp_solver"):
            model(**self.puzzle_batch(model.config), carry=model.initial_carry(4))

    @pytest.mark.parametrize("options", [{"conv": "1d", "conv_kernel": 4}, {"conv": "2d", "grid_shape": [3, 3]},
                                         {"spectral_norm": True}, {"output_norm": True},
                                         {"residual_scale": "fixed"}, {"init_mode": "fixed"},
                                         {"pos_encodings": "none", "loss_type": "softmax"}])
    def test_options_train(self, options):
        model = self.build(FPRMForPuzzles, **options).train()
        batch = self.puzzle_batch(model.config)
        out = model(**batch, carry=model.initial_carry(4))
        out.loss.backward()
        assert torch.isfinite(out.loss)
        assert all(p.grad is not None for p in model.parameters())
        names = dict(model.named_parameters())
        assert ("model.alpha_logits" in names) == (options.get("residual_scale", "learned") == "learned")
        assert ("model.conv.conv.weight" in names) == ("conv" in options)
        if options.get("spectral_norm"):
            assert any("parametrizations" in n for n in names)

    def test_noise_init_is_reproducible_at_evaluation(self):
        model = self.build(FPRMForPuzzles).eval()
        batch = self.puzzle_batch(model.config)
        with torch.no_grad():
            a, b = model(**batch).logits, model(**batch).logits
        torch.testing.assert_close(a, b, rtol=0, atol=0)

    def test_eval_waits_for_every_puzzle_with_the_slower_step_decay(self):
        model = self.build(FPRMModel, fp_stop_fraction=0.5).eval()
        kw = model._solver(None)
        assert kw["solver_kwargs"]["decay"] == 0.99 and kw["stop_fraction"] == 0.0
        kw = model.train()._solver(None)
        assert kw["solver_kwargs"] is None and kw["stop_fraction"] == 0.5  # training: fpopt's 0.9, the stop rule

    def test_longer_inputs_than_training(self):
        model = self.build(FPRMForPuzzles).eval()
        ids = torch.randint(0, 11, (2, 18))
        with torch.no_grad():
            out = model(ids)
        assert out.logits.shape == (2, 18, 11)

    def test_bad_fprm_values(self):
        with pytest.raises(ValueError, match=r"alpha_1_init=1.0 is out of range; allowed values lie in \(0.0, 1.0\)"):
            self.get_config(alpha_1_init=1.0)
        with pytest.raises(ValueError, match="alpha_2_init"):
            self.get_config(alpha_2_init=0.0)
        with pytest.raises(ValueError, match="conv='2d' needs grid_shape"):
            self.get_config(conv="2d")
        with pytest.raises(ValueError, match="does not cover|has 4 cells but seq_len=9"):
            self.get_config(conv="2d", grid_shape=[2, 2])
        with pytest.raises(ValueError, match="conv='3d' is not allowed"):
            self.get_config(conv="3d")
        with pytest.raises(ValueError, match="causal=True cannot use conv='2d'"):
            self.get_config(causal=True, conv="2d", grid_shape=[3, 3])
        with pytest.raises(ValueError, match="residual_scale"):
            self.get_config(residual_scale="input-dependent")

    def test_evaluation_output_does_not_depend_on_the_batch(self):
        # The seeded starting noise is the same for every slot: a puzzle alone, first or last in a batch gives the
        # same logits (it used to differ by about 2e-2 between slots).
        model = self.build(FPRMForPuzzles).eval()
        batch = self.puzzle_batch(model.config)
        flipped = {k: v.flip(0) for k, v in batch.items()}
        with torch.no_grad():
            full = model(**batch).logits
            alone = model(**{k: v[:1] for k, v in batch.items()}).logits
            reordered = model(**flipped).logits.flip(0)
        torch.testing.assert_close(alone[0], full[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(reordered, full, rtol=1e-5, atol=1e-5)
