from .configuration_fpsa_vit import FPSAViTConfig
from .modeling_fpsa_vit import FPSAViTForImageClassification, FPSAViTModel, FPSAViTPreTrainedModel

__all__ = ["FPSAViTConfig", "FPSAViTForImageClassification", "FPSAViTModel", "FPSAViTPreTrainedModel"]
