from .configuration_self_llama import SelfLlamaConfig
from .modeling_self_llama import SelfLlamaForCausalLM, SelfLlamaModel, SelfLlamaPreTrainedModel

__all__ = ["SelfLlamaConfig", "SelfLlamaForCausalLM", "SelfLlamaModel", "SelfLlamaPreTrainedModel"]
