"""Shared tests for every model family (cf. transformers' ``CausalLMModelTester``).

A family's test file subclasses ``FixedPointModelTesterMixin`` and sets ``config_class``, ``model_classes`` (pairs of
model class and the Auto class it registers with) and a tiny ``config_kwargs``; ``prepare_inputs`` and ``main_output``
can be overridden. Every common test then runs for that family.
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

# Blocks ``hf_fixedpoint`` (and a bare ``modeling``) in the child process so the checkpoint must load from its own
# copied files, as it would for a user who has only torch + transformers.
_CHILD = textwrap.dedent(
    """
    import importlib.abc, json, sys
    class _Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in ("hf_fixedpoint", "modeling"):
                raise ImportError(f"blocked import of {name}")
            return None
    sys.meta_path.insert(0, _Block())
    import torch, transformers
    ckpt, auto_name, io = sys.argv[1], sys.argv[2], sys.argv[3]
    model = getattr(transformers, auto_name).from_pretrained(ckpt, trust_remote_code=True)
    inputs = torch.load(io + "/inputs.pt")
    with torch.no_grad():
        out = model(**inputs)
    key = "logits" if getattr(out, "logits", None) is not None else "last_hidden_state"
    torch.save(out[key], io + "/child_out.pt")
    model.train()
    out = model(**inputs)
    out[key].float().pow(2).mean().backward()
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    print(json.dumps({
        "module": type(model).__module__,
        "hf_fixedpoint_loaded": any(m.startswith("hf_fixedpoint") for m in sys.modules),
        "n_grads": sum(g is not None and bool(torch.isfinite(g).all()) for g in grads),
        "n_params": len(grads),
    }))
    """
)


class FixedPointModelTesterMixin:
    config_class = None
    model_classes = ()  # ((model class, Auto class name), ...)
    config_kwargs = {}
    batch_size = 3
    seq_length = 7
    vocab_size = 99

    # ---- hooks a family may override --------------------------------------------------------------------------
    def get_config(self, **overrides):
        if self.config_class is None or not self.model_classes:
            raise TypeError(f"{type(self).__name__} must set config_class and model_classes")
        return self.config_class(**{**self.config_kwargs, **overrides})

    def prepare_inputs(self, config, batch_size=None):
        batch_size = batch_size or self.batch_size
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, config.vocab_size, (batch_size, self.seq_length), generator=g)
        mask = torch.ones_like(ids)
        mask[0, :2] = 0  # one left-padded row
        return {"input_ids": ids, "attention_mask": mask}

    def main_output(self, outputs):
        return outputs.logits if getattr(outputs, "logits", None) is not None else outputs.last_hidden_state

    def build(self, model_class, **overrides):
        torch.manual_seed(0)
        return model_class(self.get_config(**overrides))

    # ---- common tests -----------------------------------------------------------------------------------------
    def test_forward_shapes_and_stats(self):
        for model_class, _ in self.model_classes:
            model = self.build(model_class).eval()
            inputs = self.prepare_inputs(model.config)
            out = model(**inputs)
            y = self.main_output(out)
            assert y.shape[:2] == inputs["input_ids"].shape
            assert torch.isfinite(y).all()
            assert out.fp_stats is not None and out.fp_stats.nfe >= 1

    def test_config_rejects_bad_fixed_point_settings(self):
        with pytest.raises(ValueError, match="fp_solver"):
            self.get_config(fp_solver="newton")
        with pytest.raises(ValueError, match="Unknown fixed-point setting"):
            self.get_config(fp_max_iters=3)

    def test_save_and_load(self, tmp_path):
        for model_class, _ in self.model_classes:
            model = self.build(model_class).eval()
            inputs = self.prepare_inputs(model.config)
            model.save_pretrained(tmp_path / model_class.__name__)
            loaded = model_class.from_pretrained(tmp_path / model_class.__name__).eval()
            with torch.no_grad():
                torch.testing.assert_close(self.main_output(loaded(**inputs)), self.main_output(model(**inputs)))
            assert loaded.config.to_dict()["fp_solver"] == model.config.fp_solver

    def test_from_pretrained_overrides_fixed_point_settings(self, tmp_path):
        model_class = self.model_classes[0][0]
        self.build(model_class).save_pretrained(tmp_path)
        loaded = model_class.from_pretrained(tmp_path, fp_eval_max_iter=2)
        assert loaded.config.fp_eval_max_iter == 2
        out = loaded(**self.prepare_inputs(loaded.config))
        assert out.fp_stats.nfe <= 2

    def test_remote_code_round_trip(self, tmp_path):
        # save_pretrained -> fresh process without hf_fixedpoint -> AutoModel*.from_pretrained(trust_remote_code=True)
        for model_class, auto_name in self.model_classes:
            model = self.build(model_class).eval()
            ckpt, io = tmp_path / f"ckpt_{model_class.__name__}", tmp_path / f"io_{model_class.__name__}"
            io.mkdir()
            model.save_pretrained(ckpt)
            inputs = self.prepare_inputs(model.config)
            torch.save(inputs, io / "inputs.pt")
            env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf_home"), "PYTHONPATH": ""}
            proc = subprocess.run([sys.executable, "-c", _CHILD, str(ckpt), auto_name, str(io)], cwd=tmp_path,
                                  env=env, capture_output=True, text=True, timeout=300)
            assert proc.returncode == 0, proc.stderr[-3000:]
            report = json.loads(proc.stdout.strip().splitlines()[-1])
            assert report["module"].startswith("transformers_modules."), report
            assert not report["hf_fixedpoint_loaded"]
            assert report["n_grads"] == report["n_params"] > 0
            with torch.no_grad():
                expected = self.main_output(model(**inputs))
            torch.testing.assert_close(torch.load(io / "child_out.pt"), expected, rtol=1e-5, atol=1e-6)

    @pytest.mark.parametrize("backward", ["ift", "phantom", "one_step", "bptt"])
    def test_training_step_every_backward_mode(self, backward):
        model_class = self.model_classes[-1][0]
        model = self.build(model_class, fp_backward=backward).train()
        inputs = self.prepare_inputs(model.config)
        out = model(**inputs)
        self.main_output(out).float().pow(2).mean().backward()
        grads = [p.grad for p in model.parameters() if p.requires_grad]
        assert all(g is not None and torch.isfinite(g).all() for g in grads)

    @pytest.mark.parametrize("solver", ["picard", "fpopt", "picard_adaptive", "anderson", "broyden"])
    def test_every_solver_through_the_config(self, solver):
        model_class = self.model_classes[0][0]
        model = self.build(model_class, fp_solver=solver).eval()
        out = model(**self.prepare_inputs(model.config))
        assert torch.isfinite(self.main_output(out)).all() and out.fp_stats.solver == solver

    def test_gradients_flow_in_eval_mode(self):
        # from_pretrained() returns a model in eval(); fine-tuning it must still get implicit gradients.
        model_class = self.model_classes[-1][0]
        model = self.build(model_class).eval()
        self.main_output(model(**self.prepare_inputs(model.config))).float().pow(2).mean().backward()
        assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())

    def test_train_and_eval_iteration_budgets(self):
        model_class = self.model_classes[0][0]
        model = self.build(model_class, fp_max_iter=3, fp_eval_max_iter=1, fp_tol=1e-12)
        inputs = self.prepare_inputs(model.config)
        assert model.train()(**inputs).fp_stats.nfe == 3
        with torch.no_grad():
            assert model.eval()(**inputs).fp_stats.nfe == 1

    def test_per_call_overrides(self):
        model_class = self.model_classes[0][0]
        model = self.build(model_class, fp_tol=1e-12).eval()
        inputs = self.prepare_inputs(model.config)
        with torch.no_grad():
            assert model(**inputs, fp_overrides={"fp_max_iter": 2}).fp_stats.nfe == 2
            with pytest.raises(ValueError, match="Unknown fixed-point setting"):
                model(**inputs, fp_overrides={"fp_iters": 2})
        assert model.config.fp_max_iter == self.get_config().fp_max_iter  # the config itself is unchanged

    def test_deterministic(self):
        model_class = self.model_classes[0][0]
        model = self.build(model_class).eval()
        inputs = self.prepare_inputs(model.config)
        with torch.no_grad():
            torch.testing.assert_close(self.main_output(model(**inputs)), self.main_output(model(**inputs)),
                                       rtol=0, atol=0)

    def test_implicit_gradient_matches_unrolled_float64(self):
        # A converged float64 solve: IFT gradients equal backprop through a full converged Picard unroll.
        model_class = self.model_classes[-1][0]
        common = {"fp_solver": "picard", "fp_tol": 1e-12, "fp_max_iter": 400, "fp_backward_tol": 1e-12,
                  "fp_backward_max_iter": 400}
        grads = {}
        for backward, extra in [("ift", {}), ("bptt", {"fp_backward_steps": None})]:
            model = self.build(model_class, fp_backward=backward, **common, **extra).double().train()
            out = model(**self.prepare_inputs(model.config))
            assert out.fp_stats.converged.all()
            self.main_output(out).pow(2).mean().backward()
            grads[backward] = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
        err = (grads["ift"] - grads["bptt"]).norm() / grads["bptt"].norm()
        assert err < 1e-8, float(err)
