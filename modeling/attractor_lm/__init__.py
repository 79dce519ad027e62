from .configuration_attractor_lm import AttractorConfig
from .modeling_attractor_lm import AttractorForCausalLM, AttractorModel, AttractorPreTrainedModel

__all__ = ["AttractorConfig", "AttractorForCausalLM", "AttractorModel", "AttractorPreTrainedModel"]
