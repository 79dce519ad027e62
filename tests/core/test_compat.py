"""fp_compat: the transformers API differences the model files rely on, including an emulation of 5.24's rename."""

from dataclasses import dataclass, fields

import pytest
import torch

from hf_fixedpoint.core import fp_compat


class _Renaming(type):
    """What transformers 5.24's ``ModelOutput`` metaclass does: every dataclass ``__init__`` set on a subclass is
    wrapped to turn a ``past_key_values=`` keyword into ``cache=``."""

    def __setattr__(cls, name, value):
        if name == "__init__":
            init = value

            def value(self, *args, **kwargs):
                if "past_key_values" in kwargs:
                    kwargs["cache"] = kwargs.pop("past_key_values")
                init(self, *args, **kwargs)

        super().__setattr__(name, value)


class _Output(metaclass=_Renaming):
    @property
    def past_key_values(self):
        return self.cache


def test_cache_field_survives_the_524_keyword_rename(monkeypatch):
    with pytest.raises(TypeError, match="cache"):  # today's failure without the decorator

        @dataclass
        class Plain(_Output):
            logits: object = None
            past_key_values: object = None

        Plain(logits=1, past_key_values=2)

    monkeypatch.setattr(fp_compat, "CACHE_NAME", "cache")

    @dataclass
    @fp_compat.cache_field
    class Out(_Output):
        logits: object = None
        past_key_values: object = None
        extra: object = None

    out = Out(logits=1, past_key_values=2, extra=3)
    assert [f.name for f in fields(Out)] == ["logits", "cache", "extra"]  # same place: tuple order unchanged
    assert out.past_key_values == 2 and out.cache == 2 and Out(cache=4).past_key_values == 4


def test_model_outputs_take_and_give_the_cache_under_both_names():
    from hf_fixedpoint.modeling.attractor_lm.modeling_attractor_lm import AttractorCausalLMOutput
    from hf_fixedpoint.modeling.ouro.modeling_ouro import OuroCausalLMOutput, OuroModelOutput

    cache = object()
    for cls in (OuroModelOutput, OuroCausalLMOutput, AttractorCausalLMOutput):
        assert cls(past_key_values=cache).past_key_values is cache
        assert getattr(cls(**{fp_compat.CACHE_NAME: cache}), fp_compat.CACHE_NAME) is cache


def test_pop_cache():
    cache, kwargs = object(), {"cache": None, "x": 1}
    assert fp_compat.pop_cache(cache, kwargs) is cache and kwargs == {"x": 1}
    kwargs = {"cache": cache}
    assert fp_compat.pop_cache(None, kwargs) is cache and kwargs == {}
    with pytest.raises(ValueError, match="once"):
        fp_compat.pop_cache(object(), {"cache": cache})


def test_create_causal_mask_matches_an_explicit_mask():
    from transformers import LlamaConfig
    from transformers.cache_utils import DynamicCache

    config = LlamaConfig(hidden_size=8, num_attention_heads=2, num_hidden_layers=1, vocab_size=10)
    config._attn_implementation = "eager"
    embeds = torch.zeros(1, 3, 8)
    mask = fp_compat.create_causal_mask(config, embeds, torch.ones(1, 3, dtype=torch.long), DynamicCache(),
                                        position_ids=torch.arange(3)[None])
    allowed = mask[0, 0] == 0
    assert torch.equal(allowed, torch.ones(3, 3).tril().bool())


def test_require_transformers_names_the_release():
    with pytest.raises(ImportError, match=r"FPSA-ViT needs transformers>=5\.12: .* 'transformers>=5\.12'"):
        fp_compat.require_transformers("5.12", "FPSA-ViT", "ViTModel keeps its layers in encoder.layer")


def test_compat_tool_summarises_families_and_updates_the_readme_block(monkeypatch):
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    sys.path.insert(0, str(root / "tools"))
    try:
        import compat_check
    finally:
        sys.path.pop(0)
    saved = [("a", "AModel"), ("a", "AForX"), ("b", "BModel")]
    classes = {"AModel": {"status": "ok", "detail": ""}, "AForX": {"status": "refused", "detail": "A needs x"},
               "BModel": {"status": "failed", "detail": "forward: boom"}}
    assert compat_check.family_status(classes, saved) == {"a": "refused: A needs x",
                                                          "b": "failed: BModel: forward: boom"}
    assert compat_check._shown_args(["--keep", "/tmp/x", "--suite"]) == ["--suite"]
    readme = (root / "README.md").read_text()
    assert compat_check.TABLE_START in readme and compat_check.TABLE_END in readme

    # The newest release checked is the newest pip can install from the index: a newer one whose own dependency the
    # index lacks (transformers 5.25.0 needed kernels>=0.19.1 while the index had 0.17.2) is skipped with pip's reason.
    import subprocess
    import types

    def fake_run(cmd, **kwargs):  # `pip index versions transformers`
        return types.SimpleNamespace(stdout="transformers (5.25.0)\nAvailable versions: 5.25.0, 5.24.0, 5.23.0\n")

    def fake_subprocess_run(cmd, **kwargs):  # `pip install --dry-run transformers==X`
        bad = cmd[-1] == "transformers==5.25.0"
        return types.SimpleNamespace(returncode=int(bad), stderr="ERROR: No matching distribution found for kernels"
                                     if bad else "")

    monkeypatch.setattr(compat_check, "run", fake_run)
    monkeypatch.setattr(subprocess, "run", fake_subprocess_run)
    skipped = []
    assert compat_check.newest_release(skipped) == "5.24.0"
    assert skipped == [("5.25.0", "ERROR: No matching distribution found for kernels")]


@pytest.mark.parametrize("family", ["ouro", "attractor_lm", "self_llama", "self_mistral"])
def test_causal_lms_fill_a_cache_passed_as_cache(family):
    """``generate`` passes ``cache=`` from transformers 5.24; SELF once ignored it silently (wrong cached tokens)."""
    import importlib

    from transformers import DynamicCache

    from hf_fixedpoint.modeling import FAMILIES

    config_class, models = next((c, m) for c, m in FAMILIES if c.model_type == family)
    module = importlib.import_module(f"tests.models.{family}.test_modeling_{family}")
    tester = next(cls for cls in vars(module).values()
                  if getattr(cls, "config_class", None) is config_class and hasattr(cls, "get_config"))()
    lm_class = models[-1][1]
    model = lm_class(tester.get_config()).eval()
    ids = torch.randint(1, 50, (1, 5))
    cache = DynamicCache()
    with torch.no_grad():
        out = model(input_ids=ids, cache=cache, use_cache=True)
    assert cache.get_seq_length() == 5 and getattr(out, fp_compat.CACHE_NAME) is cache


def test_sliding_window_static_cache_is_refused_with_the_reason():
    """A static cache with sliding-window layers is refused with the reason (SELF writes each new token's converged
    keys at its slot, which such a layer rolls). A full-attention static cache works (tests/models/test_compile.py);
    Ouro and Attractor LM support it too (tests/models/ouro, tests/models/attractor_lm)."""
    from hf_fixedpoint.modeling import FAMILIES
    from tests.helpers import family_tester

    config_class, models = next((c, m) for c, m in FAMILIES if c.model_type == "self_mistral")
    model = models[-1][1](family_tester(config_class).get_config()).eval()
    assert model.config.sliding_window is not None
    with pytest.raises(ValueError, match="^SELF models needs a DynamicCache or a StaticCache without sliding-window "
                                         "layers; got StaticCache: .+ Use the default cache"):
        model.generate(torch.randint(1, 50, (1, 5)), max_new_tokens=2, do_sample=False, cache_implementation="static")
