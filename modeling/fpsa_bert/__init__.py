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
