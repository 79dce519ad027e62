from .configuration_self_llama import SelfLlamaConfig
from .modeling_self_llama import SelfLlamaForCausalLM, SelfLlamaModel, SelfLlamaPreTrainedModel

__all__ = ["SelfLlamaConfig", "SelfLlamaForCausalLM", "SelfLlamaModel", "SelfLlamaPreTrainedModel"]

from .. import register_family  # noqa: E402  (the Auto classes find this family from here on)

register_family(__name__)
