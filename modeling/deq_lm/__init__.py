from .configuration_deq_lm import DEQLMConfig
from .modeling_deq_lm import DEQLMForCausalLM, DEQLMModel, DEQLMPreTrainedModel

__all__ = ["DEQLMConfig", "DEQLMForCausalLM", "DEQLMModel", "DEQLMPreTrainedModel"]

from .. import register_family  # noqa: E402  (the Auto classes find this family from here on)

register_family(__name__)
