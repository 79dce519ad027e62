from .configuration_fpsa_vit import FPSAViTConfig
from .modeling_fpsa_vit import FPSAViTForImageClassification, FPSAViTModel, FPSAViTPreTrainedModel

__all__ = ["FPSAViTConfig", "FPSAViTForImageClassification", "FPSAViTModel", "FPSAViTPreTrainedModel"]

from .. import register_family  # noqa: E402  (the Auto classes find this family from here on)

register_family(__name__)
