from .configuration_self_mistral import SelfMistralConfig
from .modeling_self_mistral import SelfMistralForCausalLM, SelfMistralModel, SelfMistralPreTrainedModel

__all__ = ["SelfMistralConfig", "SelfMistralForCausalLM", "SelfMistralModel", "SelfMistralPreTrainedModel"]

from .. import register_family  # noqa: E402  (the Auto classes find this family from here on)

register_family(__name__)
