from .configuration_ouro import OuroConfig
from .modeling_ouro import OuroForCausalLM, OuroModel, OuroPreTrainedModel

__all__ = ["OuroConfig", "OuroForCausalLM", "OuroModel", "OuroPreTrainedModel"]

from .. import register_family  # noqa: E402  (the Auto classes find this family from here on)

register_family(__name__)
