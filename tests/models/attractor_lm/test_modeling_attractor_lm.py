"""Attractor LM: the shared tests, float64 numerics of the attractor, cached generation, knobs, PEFT, bad input."""

import pytest
import torch
from transformers import StaticCache
from transformers.cache_utils import StaticSlidingWindowLayer

from hf_fixedpoint.core import fixed_point
from hf_fixedpoint.modeling import AttractorConfig, AttractorForCausalLM, AttractorModel
from tests.models.causal_lm_checks import CausalLMChecksMixin
from tests.models.fixed_point_tester import FixedPointModelTesterMixin

TINY = {"vocab_size": 99, "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4,
        "num_key_value_heads": 2, "num_backbone_layers": 1, "num_attractor_layers": 2,
        "max_position_embeddings": 64, "fp_max_iter": 30}
EXACT = {"fp_solver": "picard", "fp_tol": 1e-12, "fp_max_iter": 300}  # float64 solves to machine precision


class TestAttractorLM(CausalLMChecksMixin, FixedPointModelTesterMixin):
    config_class = AttractorConfig
    model_classes = ((AttractorModel, "AutoModel"), (AttractorForCausalLM, "AutoModelForCausalLM"))
    config_kwargs = TINY
    lm_class = AttractorForCausalLM
    lm_overrides = {"fp_tol": 1e-7, "fp_max_iter": 100}
    num_layers_reported = 3  # one backbone layer, two attractor layers (at the fixed point)

    def inputs(self, batch=2, length=6, seed=0):
        g = torch.Generator().manual_seed(seed)
        return torch.randint(0, 99, (batch, length), generator=g)

    # ---- numerics (float64) ----------------------------------------------------------------------------------
    def test_fixed_point_satisfied_per_token(self):
        model = self.build(AttractorModel, **EXACT).double().eval()
        ids = self.inputs()
        with torch.no_grad():
            out = model(ids, use_cache=False)
            y, y0 = out.attractor_state, out.proposal
            pos = torch.arange(ids.shape[1])[None].expand_as(ids)
            cos, sin = model.rotary_emb(y0, pos)
            image = model.attractor_map(y, y0, cos, sin, None)
        assert out.fp_stats.nstep.shape == ids.shape and out.fp_stats.converged.all()
        assert (image - y).norm() / y.norm() < 1e-11
        assert (y - y0).norm() / y0.norm() > 1e-3  # the attractor does move the proposal

    def test_t0_readout_decodes_the_backbone_proposal(self):
        model = self.build(AttractorForCausalLM).double().eval()
        ids = self.inputs()
        with torch.no_grad():
            proposal = model.model(ids).proposal
            t0 = model(ids, readout_iters=0)
            expected = model.lm_head(model.model.norm(proposal))
            converged = model(ids).logits
            for p in model.model.attractor.parameters():  # the T=0 readout never touches the attractor
                p.add_(1.0)
            t0_after = model(ids, readout_iters=0).logits
        assert t0.fp_stats is None
        torch.testing.assert_close(t0.logits, expected, rtol=0, atol=0)
        torch.testing.assert_close(t0_after, t0.logits, rtol=0, atol=0)
        assert not torch.allclose(converged, t0.logits)

    def test_ift_gradient_matches_finite_differences(self):
        model = self.build(AttractorForCausalLM, fp_backward="ift", fp_backward_tol=1e-12,
                           fp_backward_max_iter=300, **EXACT).double()
        ids = self.inputs()

        def loss():  # in float64 (transformers' loss_function upcasts to float32 only)
            logits = model(ids, use_cache=False).logits
            return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 99), ids[:, 1:].reshape(-1))

        loss().backward()
        checks = [(model.model.attractor[0].raw_gamma_mlp, 3), (model.model.attractor[1].mlp.up_proj.weight, 5),
                  (model.model.backbone[0].self_attn.v_proj.weight, 7)]
        for param, index in checks:
            flat = param.data.view(-1)
            eps = 1e-6
            with torch.no_grad():
                flat[index] += eps
                plus = loss()
                flat[index] -= 2 * eps
                minus = loss()
                flat[index] += eps
            fd = (plus - minus) / (2 * eps)
            grad = param.grad.view(-1)[index]
            assert abs(grad - fd) <= 1e-6 * max(1.0, abs(fd)), (float(grad), float(fd))

    def test_adjoint_clip(self):
        # Large clip: the same gradient as unclipped IFT; a tiny clip changes it (the adjoint is clipped).
        ids = self.inputs()
        grads = {}
        for clip in (None, 1e6, 1e-3):
            model = self.build(AttractorForCausalLM, fp_backward="ift", adjoint_clip=clip, fp_backward_tol=1e-12,
                               fp_backward_max_iter=300, **EXACT).double()
            model(ids, labels=ids, use_cache=False).loss.backward()
            grads[clip] = model.model.backbone[0].mlp.up_proj.weight.grad.clone()
        torch.testing.assert_close(grads[1e6], grads[None], rtol=1e-10, atol=1e-14)
        assert not torch.allclose(grads[1e-3], grads[None], rtol=1e-3, atol=0)

    def test_core_adjoint_clip_exact_on_a_scalar_map(self):
        # f(z) = a z + x, a = 0.5: dz*/dx = 1 / (1 - a) = 2. Clipping |J^T u| to 0.25 |u| gives 1 / (1 - 0.25).
        for clip, expected in [(None, 2.0), (0.25, 4.0 / 3.0)]:
            x = torch.ones(3, 1, dtype=torch.float64, requires_grad=True)
            z, _ = fixed_point(lambda z: 0.5 * z + x, torch.zeros_like(x), solver="picard", tol=1e-14, max_iter=200,
                               backward="ift", backward_kwargs={"clip": clip, "tol": 1e-14, "solver": "picard"})
            z.sum().backward()
            torch.testing.assert_close(x.grad, torch.full_like(x, expected), rtol=1e-10, atol=0)
        with pytest.raises(ValueError, match="clip"):
            fixed_point(lambda z: 0.5 * z, torch.ones(2, 1), backward="ift", backward_kwargs={"clip": 0.0})

    @pytest.mark.parametrize("backward", ["one_step", "phantom", "ift"])
    def test_backward_modes_same_values_different_gradients(self, backward):
        model = self.build(AttractorForCausalLM, fp_backward=backward, **EXACT).double()
        ids = self.inputs()
        ref = self.build(AttractorForCausalLM, fp_backward="bptt", fp_backward_steps=None, **EXACT).double()
        out, out_ref = model(ids, labels=ids, use_cache=False), ref(ids, labels=ids, use_cache=False)
        # The backward mode never changes values, only gradients.
        torch.testing.assert_close(out.logits, out_ref.logits, rtol=0, atol=0)
        out.loss.backward()
        out_ref.loss.backward()
        g, g_ref = model.model.backbone[0].mlp.up_proj.weight.grad, ref.model.backbone[0].mlp.up_proj.weight.grad
        err = float((g - g_ref).norm() / g_ref.norm())
        assert err < 1e-8 if backward == "ift" else 1e-8 < err < 0.5, err

    def test_injection_modes(self):
        ids = self.inputs()
        add = self.build(AttractorForCausalLM, **EXACT).double().eval()
        concat = self.build(AttractorForCausalLM, injection="concat", **EXACT).double().eval()
        missing = concat.load_state_dict(add.state_dict(), strict=False).missing_keys
        assert missing == ["model.inject_proj.weight"]
        with torch.no_grad():  # W = [I, I] at init: concat starts out as the additive injection
            torch.testing.assert_close(concat(ids).logits, add(ids).logits, rtol=1e-10, atol=1e-12)
        # initial_only: y0 is only the starting point, so the converged state forgets the proposal.
        init = self.build(AttractorForCausalLM, injection="initial_only", **EXACT).double().eval()
        with torch.no_grad():
            a = init(ids)
            for p in init.model.backbone.parameters():
                p.mul_(1.5)
            b = init(ids)
        assert a.fp_stats.converged.all() and b.fp_stats.converged.all()
        assert not torch.allclose(a.logits, init(ids, readout_iters=0).logits)
        torch.testing.assert_close(a.logits, b.logits, rtol=0, atol=1e-9)

    # ---- knobs and generation -----------------------------------------------------------------------------
    def test_readout_iters_per_call_and_at_load_time(self, tmp_path):
        model = self.build(AttractorForCausalLM, fp_tol=1e-12).eval()
        ids = self.inputs()
        with torch.no_grad():
            assert model(ids, readout_iters=2).fp_stats.nfe == 2
            assert model(ids, readout_iters=2, fp_overrides={"fp_min_iter": 5}).fp_stats.nfe == 2
            with pytest.raises(ValueError, match="readout_iters"):
                model(ids, readout_iters=-1)
        model.save_pretrained(tmp_path)
        loaded = AttractorForCausalLM.from_pretrained(tmp_path, readout_iters=0)
        with torch.no_grad():
            torch.testing.assert_close(loaded(ids).logits, model(ids, readout_iters=0).logits)
            gen = loaded.generate(ids, max_new_tokens=3, do_sample=False)
            gen_t1 = loaded.generate(ids, max_new_tokens=3, do_sample=False, readout_iters=1)
        assert gen.shape == gen_t1.shape == (2, 9)

    @pytest.mark.parametrize("padded", [False, True])
    def test_cached_generation_equals_uncached(self, padded):
        model = self.build(AttractorForCausalLM, fp_tol=1e-11, fp_max_iter=200).double().eval()
        ids = self.inputs(batch=3, length=5, seed=1)
        mask = torch.ones_like(ids)
        if padded:
            mask[0, :2] = 0
            mask[2, :1] = 0
        kw = {"attention_mask": mask, "max_new_tokens": 12, "do_sample": False, "output_scores": True,
              "return_dict_in_generate": True}
        with torch.no_grad():
            cached = model.generate(ids, use_cache=True, **kw)
            uncached = model.generate(ids, use_cache=False, **kw)
        assert torch.equal(cached.sequences, uncached.sequences)
        torch.testing.assert_close(torch.stack(cached.scores), torch.stack(uncached.scores), rtol=0, atol=1e-8)
        cache = cached.past_key_values
        n_layers = model.config.num_backbone_layers + model.config.num_attractor_layers
        assert len(cache.layers) == n_layers and all(c.get_seq_length() == 5 + 11 for c in cache.layers)

    @pytest.mark.parametrize("beams", [1, 3])
    def test_static_cache_generates_the_dynamic_cache_tokens(self, beams):
        """``cache_implementation="static"`` (compiled generation's cache) was refused: the attractor read the cached
        keys as tensors of exactly the cached length. Now it iterates against the whole static buffer (the iterate's
        keys placed at the new token's slot out of place) and gives the dynamic cache's tokens, greedy and beam
        search, on a left-padded batch."""
        model = self.build(AttractorForCausalLM, fp_tol=1e-11, fp_max_iter=200, pad_token_id=0).double().eval()
        ids = self.inputs(batch=3, length=6, seed=2)
        mask = torch.ones_like(ids)
        mask[0, :3] = 0
        ids = ids.masked_fill(mask == 0, 0)
        kw = {"attention_mask": mask, "max_new_tokens": 8, "do_sample": False, "pad_token_id": 0, "num_beams": beams}
        with torch.no_grad():
            dynamic = model.generate(ids, **kw)
            if beams == 1:
                cache = StaticCache(config=model.config, max_cache_len=16)
                static = model.generate(ids, past_key_values=cache, **kw)
            else:
                static = model.generate(ids, cache_implementation="static", **kw)
        assert torch.equal(static, dynamic)
        if beams == 1:  # every layer holds the 6 + 7 tokens that were fed, the attractor's at their fixed points
            assert all(int(layer.get_seq_length()) == 13 for layer in cache.layers)

    def test_static_cache_under_bf16_autocast(self):
        """Under autocast the normed keys are float32 and the values bfloat16; a static layer holds one dtype (its
        update failed in index_copy_), so the values are stored as the keys' dtype: same tokens and scores."""
        model = self.build(AttractorForCausalLM, fp_tol=1e-2, pad_token_id=0).eval()
        ids = self.inputs(seed=3)
        kw = {"max_new_tokens": 5, "do_sample": False, "output_scores": True, "return_dict_in_generate": True}
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            dynamic = model.generate(ids, **kw)
            static = model.generate(ids, cache_implementation="static", **kw)
        assert torch.equal(static.sequences, dynamic.sequences)
        torch.testing.assert_close(torch.stack(static.scores), torch.stack(dynamic.scores), rtol=0, atol=1e-6)

    def test_static_cache_filled_without_attractor_keys_is_refused(self):
        model = self.build(AttractorForCausalLM).eval()
        ids = self.inputs()
        cache = StaticCache(config=model.config, max_cache_len=10)
        with torch.no_grad():
            model(ids, past_key_values=cache, use_cache=True, readout_iters=0)
            with pytest.raises(ValueError, match="no attractor keys/values .* same readout_iters throughout"):
                model(ids[:, :1], past_key_values=cache, use_cache=True)

    def test_cache_layers_it_cannot_read_are_refused(self):
        model = self.build(AttractorForCausalLM).eval()
        cache = StaticCache(config=model.config, max_cache_len=10)
        cache.layers[0] = StaticSlidingWindowLayer(max_cache_len=10, sliding_window=4)
        with pytest.raises(ValueError, match="DynamicCache or a StaticCache .* got StaticCache with a "
                                             "StaticSlidingWindowLayer"):
            model(self.inputs(), past_key_values=cache, use_cache=True)
        old_release = StaticCache(config=model.config, max_cache_len=10)  # transformers 4.57's StaticLayer
        for layer in old_release.layers:
            del layer.cumulative_length
        with pytest.raises(ValueError, match="needs a StaticLayer that tracks its length"):
            model(self.inputs(), past_key_values=old_release, use_cache=True)

    def test_compiled_static_decode_step_breaks_only_in_the_solve(self):
        """What compiled generation compiles: a decoding step with a filled static cache. The solve's convergence
        test reads one number per iteration on the host, so the graph breaks there (torch._dynamo.explain); the
        embedding, the backbone, the masks and the cache reads before it trace without a break."""
        model = self.build(AttractorForCausalLM).eval()
        ids = self.inputs()
        cache = StaticCache(config=model.config, max_cache_len=10)
        with torch.no_grad():
            model(ids, past_key_values=cache, use_cache=True)
            explained = torch._dynamo.explain(model)(ids[:, -1:], past_key_values=cache, use_cache=True,
                                                     position_ids=torch.full((2, 1), 6))
        torch._dynamo.reset()
        assert explained.graph_break_count > 0
        first = explained.break_reasons[0]
        assert "item()" in first.reason and first.user_stack[-1].filename.endswith("fp_solvers.py"), first

    def test_unrolled_iters_is_the_capped_picard_solve_and_compiles_as_one_graph(self):
        """``unrolled_iters=k``: k plain steps from y0, the solve with picard, ``fp_min_iter = fp_max_iter = k`` and
        ``fp_return="last"``, without its per-iteration host read; a compiled static decoding step is one graph."""
        model = self.build(AttractorForCausalLM, pad_token_id=0).eval()
        ids = self.inputs(batch=3, length=6, seed=2)
        capped = {"fp_solver": "picard", "fp_min_iter": 3, "fp_max_iter": 3, "fp_return": "last"}
        with torch.no_grad():
            unrolled = model(ids, use_cache=False, unrolled_iters=3)
            torch.testing.assert_close(unrolled.logits, model(ids, use_cache=False, fp_overrides=capped).logits,
                                       rtol=0, atol=0)
            kw = {"max_new_tokens": 5, "do_sample": False, "pad_token_id": 0, "unrolled_iters": 3}
            assert torch.equal(model.generate(ids, cache_implementation="static", **kw), model.generate(ids, **kw))
            cache = StaticCache(config=model.config, max_cache_len=10)
            model(ids, past_key_values=cache, use_cache=True, unrolled_iters=3)
            explained = torch._dynamo.explain(model)(ids[:, -1:], past_key_values=cache, use_cache=True,
                                                     unrolled_iters=3)  # positions from the cache's length
            with pytest.raises(ValueError, match="unrolled_iters=0 is out of range"):
                model(ids, unrolled_iters=0)
        torch._dynamo.reset()
        assert unrolled.fp_stats is None
        assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons

    def test_decode_step_reports_per_token_stats(self):
        model = self.build(AttractorForCausalLM).eval()
        ids = self.inputs()
        with torch.no_grad():
            prefill = model(ids, use_cache=True)
            step = model(ids[:, :1], past_key_values=prefill.past_key_values, use_cache=True)
        assert prefill.fp_stats.nstep.shape == (2, 6) and step.fp_stats.nstep.shape == (2, 1)
        assert step.fp_stats.converged.all() and step.logits.shape == (2, 1, 99)
        assert model.train()(ids, labels=ids).past_key_values is None  # training builds no cache by default

    def test_peft_lora_wraps_the_linear_layers(self):
        from peft import LoraConfig, get_peft_model

        model = self.build(AttractorForCausalLM, injection="concat")
        ids = self.inputs()
        with torch.no_grad():
            base = model(ids, use_cache=False).logits
        lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj", "inject_proj"],
                          init_lora_weights=False, lora_dropout=0.0)
        peft_model = get_peft_model(model, lora)
        out = peft_model(input_ids=ids, labels=ids, use_cache=False, readout_iters=3)
        out.loss.backward()
        lora_grads = [p.grad for n, p in peft_model.named_parameters() if "lora_" in n]
        assert len(lora_grads) == (3 * 3 + 1) * 2  # q/v/up in 3 layers + inject_proj; A and B each
        assert all(g is not None and g.abs().sum() > 0 for g in lora_grads)
        with torch.no_grad():
            assert not torch.allclose(peft_model(input_ids=ids, use_cache=False).logits, base)
            gen = peft_model.generate(input_ids=ids, max_new_tokens=2, do_sample=False)
        assert gen.shape == (2, 8)

    # ---- bad input ----------------------------------------------------------------------------------------
    @pytest.mark.parametrize("kwargs,match", [
        ({"injection": "multiply"}, "injection='multiply' is not allowed. Allowed values: 'add', 'initial_only'"),
        ({"fp_backward": "adjoint"}, "fp_backward='adjoint' is not a known backward mode"),
        ({"fp_solver_kwargs": {"m": 0}}, "fp_solver_kwargs for solver .anderson.: m=0 is out of range"),
        ({"fp_min_iter": 5, "fp_max_iter": 3}, "fp_min_iter=5 must not exceed fp_max_iter=3"),
        ({"layer_scale_init": 0.8}, r"layer_scale_init=0.8 is out of range; allowed values lie in \(0.0, 0.75\)"),
        ({"layer_scale_max": 1.5}, "layer_scale_max=1.5 is out of range"),
        ({"layer_scale_init": 0.0}, "layer_scale_init=0.0 is out of range"),
        ({"adjoint_clip": -1.0}, "adjoint_clip=-1.0 is out of range"),
        ({"readout_iters": -1}, "readout_iters=-1 is out of range"),
        ({"num_attention_heads": 3}, "must be divisible by num_attention_heads=3"),
        ({"num_key_value_heads": 3}, "must be divisible by num_key_value_heads=3"),
        ({"num_attractor_layers": 0}, "num_attractor_layers=0 is out of range"),
    ])
    def test_bad_config_values(self, kwargs, match):
        with pytest.raises(ValueError, match=match):
            self.get_config(**kwargs)
