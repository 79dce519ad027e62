"""Model families, one folder each (installed as ``hf_fixedpoint.modeling``).

Importing this package is cheap: a family is imported the first time it is used -- an attribute of this package
(``from hf_fixedpoint.modeling import DEQLMConfig``), its folder (``hf_fixedpoint.modeling.deq_lm``), or its
``model_type`` looked up by the transformers Auto classes (``AutoConfig.for_model("deq_lm")``, ``from_pretrained`` of a
checkpoint). On import a family registers itself with the Auto classes and marks its classes for ``auto_map`` so
``save_pretrained`` writes self-contained remote code. Each family folder imports only torch, transformers and its own
sibling files -- never ``hf_fixedpoint`` -- so a saved checkpoint loads with ``trust_remote_code=True`` where
hf-fixedpoint is not installed.
"""

import importlib
import types

import transformers
from transformers.models.auto import configuration_auto

# Every family: its folder (= its model_type) and the names this package exports from it, the config class first. Its
# config's ``family_auto_map`` (the Auto classes it implements: base model and every head; puzzle reasoners predict
# per cell, i.e. token classification) is the one list: it is written to every config.json and drives registration.
FAMILY_EXPORTS = {
    "attractor_lm": ("AttractorConfig", "AttractorForCausalLM", "AttractorModel"),
    "deq_lm": ("DEQLMConfig", "DEQLMForCausalLM", "DEQLMModel"),
    "ouro": ("OuroConfig", "OuroForCausalLM", "OuroModel"),
    "fprm": ("FPRMConfig", "FPRMForPuzzles", "FPRMModel"),
    "trm": ("TRMConfig", "TRMForPuzzles", "TRMModel"),
    "urm": ("URMConfig", "URMForPuzzles", "URMModel"),
    "fpsa_bert": (
        "FPSABertConfig",
        "FPSABertForMaskedLM",
        "FPSABertForQuestionAnswering",
        "FPSABertForSequenceClassification",
        "FPSABertForTokenClassification",
        "FPSABertModel",
    ),
    "fpsa_vit": ("FPSAViTConfig", "FPSAViTForImageClassification", "FPSAViTModel"),
    "self_llama": ("SelfLlamaConfig", "SelfLlamaForCausalLM", "SelfLlamaModel"),
    "self_mistral": ("SelfMistralConfig", "SelfMistralForCausalLM", "SelfMistralModel"),
}
_OWNER = {name: family for family, names in FAMILY_EXPORTS.items() for name in names}


def _family(config_class):
    """``(config class, [(Auto class, model class), ...])`` from the config's ``family_auto_map``."""
    package = importlib.import_module(config_class.__module__.rpartition(".")[0])
    return config_class, [(getattr(transformers, auto_class), getattr(package, ref.rpartition(".")[2]))
                          for auto_class, ref in config_class.family_auto_map.items() if auto_class != "AutoConfig"]


def register_family(package_name: str) -> None:
    """Register a family with the Auto classes; its ``__init__`` calls this once its classes exist."""
    package = importlib.import_module(package_name)
    config_class, models = _family(getattr(package, FAMILY_EXPORTS[package_name.rpartition(".")[2]][0]))
    transformers.AutoConfig.register(config_class.model_type, config_class, exist_ok=True)
    config_class.register_for_auto_class()
    for auto_class, model_class in models:
        auto_class.register(config_class, model_class, exist_ok=True)
        model_class.register_for_auto_class(auto_class.__name__)


class _LazyFamily(types.ModuleType):
    """Stands in for a family in transformers' config mapping: the first attribute asked for imports the family."""

    def __init__(self, family: str):
        super().__init__(f"{__name__}.{family}")
        self._family = family

    def __getattr__(self, name):
        return getattr(importlib.import_module(f"{__name__}.{self._family}"), name)


def _announce_model_types():
    """Make every family's model_type known to the Auto classes without importing the family.

    transformers resolves a model_type listed in its config mapping through an attribute of the module it keeps for
    that type (its own models load lazily this way); the module kept here is a ``_LazyFamily``. A model_type the
    installed transformers already knows is registered over it at once, as an eager import did.
    """
    mapping = configuration_auto.CONFIG_MAPPING
    if not (isinstance(getattr(mapping, "_mapping", None), dict) and isinstance(getattr(mapping, "_modules", None),
                                                                                  dict)):
        for family in FAMILY_EXPORTS:  # a transformers without the lazy mapping: import (and register) every family
            importlib.import_module(f"{__name__}.{family}")
        return
    for family, names in FAMILY_EXPORTS.items():
        if family in mapping:
            importlib.import_module(f"{__name__}.{family}")
            continue
        mapping._mapping[family] = names[0]
        mapping._modules[configuration_auto.model_type_to_module_name(family)] = _LazyFamily(family)


def __getattr__(name):
    if name == "FAMILIES":  # every family's (config class, [(Auto class, model class), ...]); imports them all
        families = [_family(getattr(importlib.import_module(f"{__name__}.{family}"), names[0]))
                    for family, names in FAMILY_EXPORTS.items()]
        globals()["FAMILIES"] = families
        return families
    family = _OWNER.get(name)
    if family is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{family}"), name)


def __dir__():
    return sorted(set(globals()) | set(__all__))


_announce_model_types()

__all__ = sorted(["FAMILIES", *_OWNER])
