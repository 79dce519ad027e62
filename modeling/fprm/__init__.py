from .configuration_fprm import FPRMConfig
from .modeling_fprm import FPRMForPuzzles, FPRMModel, FPRMPreTrainedModel

__all__ = ["FPRMConfig", "FPRMForPuzzles", "FPRMModel", "FPRMPreTrainedModel"]

from .. import register_family  # noqa: E402  (the Auto classes find this family from here on)

register_family(__name__)
