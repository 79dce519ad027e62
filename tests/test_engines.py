"""Generic inference-engine backends are refused (``fp_engines``): vLLM's Transformers backend asks a remote-code class
``is_backend_compatible()`` (or ``_can_set_attn_implementation()``) before running it; every causal-LM export answers
with an error naming hf-fixedpoint, while transformers' own attention switching keeps working."""

import importlib

import pytest
import torch
from transformers.dynamic_module_utils import get_class_from_dynamic_module

from hf_fixedpoint.modeling import FAMILY_EXPORTS
from tests.helpers import family_tester

LM_FAMILIES = ("attractor_lm", "deq_lm", "ouro", "self_llama", "self_mistral")
NATIVE = {"ouro"}  # served natively by the package's vLLM plugin


def lm_class(family):
    names = FAMILY_EXPORTS[family]
    package = importlib.import_module(f"hf_fixedpoint.modeling.{family}")
    return getattr(package, names[0]), getattr(package, next(n for n in names if n.endswith("ForCausalLM")))


def export(family, path):
    config_class, model_class = lm_class(family)
    model = family_tester(config_class).build(model_class).eval()
    model.save_pretrained(path)
    return model


def vllm_backend_check(cls):
    """What vLLM's model registry asks before falling back to its Transformers backend."""
    return cls.is_backend_compatible() or cls._can_set_attn_implementation()


@pytest.mark.parametrize("family", LM_FAMILIES)
def test_export_refuses_generic_engine_backend(family, tmp_path):
    model = export(family, tmp_path)
    ref = model.config.auto_map["AutoModelForCausalLM"]
    remote = get_class_from_dynamic_module(ref, str(tmp_path))  # the export's own code, as vLLM loads it
    assert not remote.__module__.startswith("hf_fixedpoint")
    for cls in (remote, type(model)):
        with pytest.raises(ValueError, match=r"\(hf-fixedpoint\) cannot run on a generic Transformers backend") as err:
            vllm_backend_check(cls)
        message = str(err.value)
        assert cls.__name__ in message and cls._engine_refusal in message
        if family in NATIVE:
            assert "`pip install hf-fixedpoint` into vLLM's environment" in message
        else:
            assert "does not serve this family" in message and "run the model with transformers" in message


@pytest.mark.parametrize("family", ["ouro", "self_llama"])
def test_attention_implementations_still_switch(family, tmp_path):
    """``attn_implementation`` at load and ``set_attn_implementation`` afterwards are untouched by the guard."""
    export(family, tmp_path)
    _, model_class = lm_class(family)
    ids = torch.tensor([[3, 5, 7, 9, 11]])
    logits = {}
    for impl in ("eager", "sdpa"):
        model = model_class.from_pretrained(tmp_path, attn_implementation=impl).eval()
        assert model.config._attn_implementation == impl
        with torch.no_grad():
            logits[impl] = model(ids).logits
    model.set_attn_implementation("eager")
    assert model.config._attn_implementation == "eager"
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, logits["eager"])
    torch.testing.assert_close(logits["sdpa"], logits["eager"], atol=1e-5, rtol=1e-4)
