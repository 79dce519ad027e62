from .configuration_trm import TRMConfig
from .modeling_trm import TRMForPuzzles, TRMModel, TRMPreTrainedModel

__all__ = ["TRMConfig", "TRMForPuzzles", "TRMModel", "TRMPreTrainedModel"]
