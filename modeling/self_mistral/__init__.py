from .configuration_self_mistral import SelfMistralConfig
from .modeling_self_mistral import SelfMistralForCausalLM, SelfMistralModel, SelfMistralPreTrainedModel

__all__ = ["SelfMistralConfig", "SelfMistralForCausalLM", "SelfMistralModel", "SelfMistralPreTrainedModel"]
