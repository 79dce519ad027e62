from .configuration_urm import URMConfig
from .modeling_urm import URMForPuzzles, URMModel, URMPreTrainedModel

__all__ = ["URMConfig", "URMForPuzzles", "URMModel", "URMPreTrainedModel"]

from .. import register_family  # noqa: E402  (the Auto classes find this family from here on)

register_family(__name__)
