from .configuration_fpsa_bert import FPSABertConfig
from .modeling_fpsa_bert import (
    FPSABertForMaskedLM,
    FPSABertForQuestionAnswering,
    FPSABertForSequenceClassification,
    FPSABertForTokenClassification,
    FPSABertModel,
    FPSABertPreTrainedModel,
)

__all__ = [
    "FPSABertConfig",
    "FPSABertForMaskedLM",
    "FPSABertForQuestionAnswering",
    "FPSABertForSequenceClassification",
    "FPSABertForTokenClassification",
    "FPSABertModel",
    "FPSABertPreTrainedModel",
]

from .. import register_family  # noqa: E402  (the Auto classes find this family from here on)

register_family(__name__)
