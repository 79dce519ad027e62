from .configuration_trm import TRMConfig
from .modeling_trm import TRMForPuzzles, TRMModel, TRMPreTrainedModel

__all__ = ["TRMConfig", "TRMForPuzzles", "TRMModel", "TRMPreTrainedModel"]

from .. import register_family  # noqa: E402  (the Auto classes find this family from here on)

register_family(__name__)
