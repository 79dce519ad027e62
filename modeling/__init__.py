"""Model families, one folder each (installed as ``hf_fixedpoint.modeling``).

Importing this package registers every family with the transformers Auto classes (for users who have the library
installed) and marks the classes for ``auto_map`` so ``save_pretrained`` writes self-contained remote code. Each family
folder imports only torch, transformers and its own sibling files -- never ``hf_fixedpoint`` -- so a saved checkpoint
loads with ``trust_remote_code=True`` where hf-fixedpoint is not installed.
"""

from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForImageClassification,
    AutoModelForMaskedLM,
    AutoModelForQuestionAnswering,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
)

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

# (config class, [(Auto class, model class), ...]) for every family.
FAMILIES = [
    (AttractorConfig, [(AutoModel, AttractorModel), (AutoModelForCausalLM, AttractorForCausalLM)]),
    (DEQLMConfig, [(AutoModel, DEQLMModel), (AutoModelForCausalLM, DEQLMForCausalLM)]),
    (OuroConfig, [(AutoModel, OuroModel), (AutoModelForCausalLM, OuroForCausalLM)]),
    # Puzzle reasoners: per-cell prediction over the puzzle tokens, i.e. token classification.
    (FPRMConfig, [(AutoModel, FPRMModel), (AutoModelForTokenClassification, FPRMForPuzzles)]),
    (TRMConfig, [(AutoModel, TRMModel), (AutoModelForTokenClassification, TRMForPuzzles)]),
    (URMConfig, [(AutoModel, URMModel), (AutoModelForTokenClassification, URMForPuzzles)]),
    (FPSABertConfig, [(AutoModel, FPSABertModel), (AutoModelForMaskedLM, FPSABertForMaskedLM),
                      (AutoModelForSequenceClassification, FPSABertForSequenceClassification),
                      (AutoModelForTokenClassification, FPSABertForTokenClassification),
                      (AutoModelForQuestionAnswering, FPSABertForQuestionAnswering)]),
    (FPSAViTConfig, [(AutoModel, FPSAViTModel),
                     (AutoModelForImageClassification, FPSAViTForImageClassification)]),
    # Pretrained decoders retrofitted with causal FPSA.
    (SelfLlamaConfig, [(AutoModel, SelfLlamaModel), (AutoModelForCausalLM, SelfLlamaForCausalLM)]),
    (SelfMistralConfig, [(AutoModel, SelfMistralModel), (AutoModelForCausalLM, SelfMistralForCausalLM)]),
]


def _register():
    for config_class, models in FAMILIES:
        AutoConfig.register(config_class.model_type, config_class, exist_ok=True)
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
