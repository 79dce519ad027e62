"""Generic inference-engine backends are refused (``fp_engines``): vLLM's Transformers backend asks a remote-code class
``is_backend_compatible()`` (or ``_can_set_attn_implementation()``) before running it; every causal-LM export answers
with an error naming hf-fixedpoint, while transformers' own attention switching keeps working."""

import importlib

import pytest
import torch
from transformers.dynamic_module_utils import get_class_from_dynamic_module

from hf_fixedpoint.modeling import FAMILY_EXPORTS
from tests.helpers import family_tester

LM_FAMILIES = ("attractor_lm", "deq_lm", "ouro", "self_llama", "self_mistral")  # each served by the vLLM plugin


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
        assert "`pip install hf-fixedpoint` into vLLM's environment" in message


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


# ---- the vLLM plugin's parts that need no vLLM ----------------------------------------------------------------------
def test_plugin_is_declared_and_importing_the_package_does_not_import_vllm():
    import subprocess
    import sys

    pyproject = open("pyproject.toml", encoding="utf-8").read()  # (tomllib: Python 3.11+)
    assert ('[project.entry-points."vllm.general_plugins"]\nhf_fixedpoint = "hf_fixedpoint.vllm_plugin:register"\n'
            in pyproject)
    assert ('[project.entry-points."vllm.logits_processors"]\n'
            'hf_fixedpoint_ouro = "hf_fixedpoint.vllm_plugin.knobs:OuroRequestKnobs"\n' in pyproject)
    assert '"hf_fixedpoint.vllm_plugin",' in pyproject  # packaged
    child = ("import sys, hf_fixedpoint, hf_fixedpoint.vllm_plugin, hf_fixedpoint.vllm_plugin.settings\n"
             "from hf_fixedpoint.modeling import OuroForCausalLM\n"
             "assert not any(m.partition('.')[0] == 'vllm' for m in sys.modules)\n"
             "assert callable(hf_fixedpoint.vllm_plugin.register)\n")
    out = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]


def test_request_settings_are_checked():
    from hf_fixedpoint.vllm_plugin.settings import check_request

    assert check_request(None, 4) == {} and check_request({"other": 1}, 4) == {}
    assert check_request({"total_ut_steps": 2, "exit_threshold": 0.5, "x": 0}, 4) == {"total_ut_steps": 2,
                                                                                      "exit_threshold": 0.5}
    assert check_request({"total_ut_steps": 9}, None) == {"total_ut_steps": 9}  # the bound unknown: lower bound only
    for bad in (0, 5, 2.0, "2", True):
        with pytest.raises(ValueError, match=r"\['total_ut_steps'\]=.* Allowed values: an integer from 1 to 4"):
            check_request({"total_ut_steps": bad}, 4)
    for bad in (-0.1, 1.5, "0.5", False):
        with pytest.raises(ValueError, match=r"\['exit_threshold'\]=.* Allowed values: a number in \[0, 1\]"):
            check_request({"exit_threshold": bad}, 4)
