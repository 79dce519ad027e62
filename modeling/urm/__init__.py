from .configuration_urm import URMConfig
from .modeling_urm import URMForPuzzles, URMModel, URMPreTrainedModel

__all__ = ["URMConfig", "URMForPuzzles", "URMModel", "URMPreTrainedModel"]
