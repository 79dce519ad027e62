"""``import hf_fixedpoint`` imports no model family; a family loads (and registers with the Auto classes) on first
use."""

import importlib
import subprocess
import sys
import textwrap

import pytest

from hf_fixedpoint import modeling

CHILD = textwrap.dedent(
    """
    import sys
    import hf_fixedpoint
    loaded = lambda: sorted({m.split(".")[2] for m in sys.modules if m.startswith("hf_fixedpoint.modeling.")})
    assert loaded() == [], loaded()
    assert "transformers.modeling_utils" not in sys.modules  # the costly part of a family import
    from transformers import AutoConfig, AutoModelForCausalLM
    config = AutoConfig.for_model("deq_lm", vocab_size=99, hidden_size=32, num_attention_heads=4)
    assert type(config).__name__ == "DEQLMConfig" and loaded() == ["deq_lm"], loaded()
    assert type(AutoModelForCausalLM.from_config(config)).__name__ == "DEQLMForCausalLM"
    from hf_fixedpoint.modeling import OuroConfig
    assert loaded() == ["deq_lm", "ouro"], loaded()
    print("ok")
    """
)


def test_import_loads_no_family_and_the_auto_classes_find_them_by_model_type():
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


@pytest.mark.parametrize("family", list(modeling.FAMILY_EXPORTS))
def test_family_table_matches_the_family(family):
    package = importlib.import_module(f"hf_fixedpoint.modeling.{family}")
    names = modeling.FAMILY_EXPORTS[family]
    config_class = getattr(package, names[0])
    assert config_class.model_type == family
    assert set(names) == {n for n in package.__all__ if not n.endswith("PreTrainedModel")}
    assert all(getattr(modeling, n) is getattr(package, n) for n in names)


def test_unknown_attribute_is_an_attribute_error():
    with pytest.raises(AttributeError, match="NoSuchConfig"):
        modeling.NoSuchConfig  # noqa: B018
