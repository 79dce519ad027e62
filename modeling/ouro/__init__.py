from .configuration_ouro import OuroConfig
from .modeling_ouro import OuroForCausalLM, OuroModel, OuroPreTrainedModel

__all__ = ["OuroConfig", "OuroForCausalLM", "OuroModel", "OuroPreTrainedModel"]
