from .configuration_deq_lm import DEQLMConfig
from .modeling_deq_lm import DEQLMForCausalLM, DEQLMModel, DEQLMPreTrainedModel

__all__ = ["DEQLMConfig", "DEQLMForCausalLM", "DEQLMModel", "DEQLMPreTrainedModel"]
