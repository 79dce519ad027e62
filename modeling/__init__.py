"""Model families, one folder each (installed as ``hf_fixedpoint.modeling``).

Importing this package registers every family with the transformers Auto classes (for users who have the library
installed) and marks the classes for ``auto_map`` so ``save_pretrained`` writes self-contained remote code. Each family
folder imports only torch, transformers and its own sibling files -- never ``hf_fixedpoint`` -- so a saved checkpoint
loads with ``trust_remote_code=True`` where hf-fixedpoint is not installed.
"""

import importlib

import transformers

from .attractor_lm import AttractorConfig, AttractorForCausalLM, AttractorModel
from .deq_lm import DEQLMConfig, DEQLMForCausalLM, DEQLMModel
from .fprm import FPRMConfig, FPRMForPuzzles, FPRMModel
from .fpsa_bert import (
    FPSABertConfig,
    FPSABertForMaskedLM,
    FPSABertForQuestionAnswering,
    FPSABertForSequenceClassification,
    FPSABertForTokenClassification,
    FPSABertModel,
)
from .fpsa_vit import FPSAViTConfig, FPSAViTForImageClassification, FPSAViTModel
from .ouro import OuroConfig, OuroForCausalLM, OuroModel
from .self_llama import SelfLlamaConfig, SelfLlamaForCausalLM, SelfLlamaModel
from .self_mistral import SelfMistralConfig, SelfMistralForCausalLM, SelfMistralModel
from .trm import TRMConfig, TRMForPuzzles, TRMModel
from .urm import URMConfig, URMForPuzzles, URMModel

# Every family's config class. Its ``family_auto_map`` (the Auto classes it implements: base model and every head;
# puzzle reasoners predict per cell, i.e. token classification) is the one list: it is written to every config.json
# and drives the registration below.
CONFIGS = [AttractorConfig, DEQLMConfig, OuroConfig, FPRMConfig, TRMConfig, URMConfig, FPSABertConfig, FPSAViTConfig,
           SelfLlamaConfig, SelfMistralConfig]


def _family(config_class):
    """``(config class, [(Auto class, model class), ...])`` from the config's ``family_auto_map``."""
    package = importlib.import_module(config_class.__module__.rpartition(".")[0])
    return config_class, [(getattr(transformers, auto_class), getattr(package, ref.rpartition(".")[2]))
                          for auto_class, ref in config_class.family_auto_map.items() if auto_class != "AutoConfig"]


FAMILIES = [_family(config_class) for config_class in CONFIGS]


def _register():
    for config_class, models in FAMILIES:
        transformers.AutoConfig.register(config_class.model_type, config_class, exist_ok=True)
        config_class.register_for_auto_class()
        for auto_class, model_class in models:
            auto_class.register(config_class, model_class, exist_ok=True)
            model_class.register_for_auto_class(auto_class.__name__)


_register()

__all__ = [
    "FAMILIES",
    "AttractorConfig",
    "AttractorForCausalLM",
    "AttractorModel",
    "DEQLMConfig",
    "DEQLMForCausalLM",
    "DEQLMModel",
    "FPRMConfig",
    "FPRMForPuzzles",
    "FPRMModel",
    "FPSABertConfig",
    "FPSABertForMaskedLM",
    "FPSABertForQuestionAnswering",
    "FPSABertForSequenceClassification",
    "FPSABertForTokenClassification",
    "FPSABertModel",
    "FPSAViTConfig",
    "FPSAViTForImageClassification",
    "FPSAViTModel",
    "OuroConfig",
    "OuroForCausalLM",
    "OuroModel",
    "SelfLlamaConfig",
    "SelfLlamaForCausalLM",
    "SelfLlamaModel",
    "SelfMistralConfig",
    "SelfMistralForCausalLM",
    "SelfMistralModel",
    "TRMConfig",
    "TRMForPuzzles",
    "TRMModel",
    "URMConfig",
    "URMForPuzzles",
    "URMModel",
]
