from .configuration_fprm import FPRMConfig
from .modeling_fprm import FPRMForPuzzles, FPRMModel, FPRMPreTrainedModel

__all__ = ["FPRMConfig", "FPRMForPuzzles", "FPRMModel", "FPRMPreTrainedModel"]
