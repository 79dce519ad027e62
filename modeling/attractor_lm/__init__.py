from .configuration_attractor_lm import AttractorConfig
from .modeling_attractor_lm import AttractorForCausalLM, AttractorModel, AttractorPreTrainedModel

__all__ = ["AttractorConfig", "AttractorForCausalLM", "AttractorModel", "AttractorPreTrainedModel"]

from .. import register_family  # noqa: E402  (the Auto classes find this family from here on)

register_family(__name__)
