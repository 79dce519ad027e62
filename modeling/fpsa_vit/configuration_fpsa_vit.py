"""Configuration of FPSA-ViT: a Vision Transformer whose self-attention layers are Fixed-Point Self-Attention loops.

Every ``ViTConfig`` field keeps its meaning, so ViT checkpoints load; the ``fp_*`` and ``fpsa_*`` knobs are those of
FPSA-BERT (see ``fp_fpsa_settings.FPSA_DEFAULTS``).
"""

from transformers import ViTConfig

from .fp_backward import fixed_point  # noqa: F401  (see vendor.direct_import_problems)
from .fp_fpsa_settings import FPSA_FP_DEFAULTS, FPSAConfigMixin, check_heads, pop_fpsa_kwargs, retrofit_config_dict
from .fp_halting import ACTAccumulator  # noqa: F401  (see vendor.direct_import_problems)
from .fp_jacobian import jacobian_frobenius  # noqa: F401  (see vendor.direct_import_problems)
from .fp_registry import check_number, complete_auto_map  # noqa: F401  (see vendor.direct_import_problems)
from .fp_settings import pop_fp_kwargs
from .fp_solvers import solve  # noqa: F401  (see vendor.direct_import_problems)
from .fp_stats import FixedPointStats  # noqa: F401  (see vendor.direct_import_problems)

# Checkpoints whose config this class accepts: plain ViT (a retrofit) and FPSA-ViT itself.
COMPATIBLE_MODEL_TYPES = ("vit", "fpsa_vit")


class FPSAViTConfig(FPSAConfigMixin, ViTConfig):
    r"""
    Args:
        **ViTConfig fields**: ``hidden_size``, ``num_hidden_layers``, ``num_attention_heads`` (must divide
            ``hidden_size``), ``intermediate_size``, ``image_size``, ``patch_size``, ...
        fp_*: fixed-point settings; FPSA defaults ``fp_solver="picard"``, ``fp_tol=1e-3``, ``fp_max_iter=16``
            (``fp_max_iter=1`` is the original ViT).
        fpsa_*: FPSA settings (``fp_fpsa_settings.FPSA_DEFAULTS``). In the pre-norm ViT the ``residual_norm``
            iterate is ``layernorm_before(h + W_O O)``: the layer's own input norm applied to the updated residual
            stream.

    Example:
        >>> config = FPSAViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37,
        ...                        image_size=16, patch_size=4, num_labels=10)
    """

    model_type = "fpsa_vit"
    # Every Auto class of the family: config.json gets them all whichever class saves (see complete_auto_map).
    family_auto_map = {"AutoConfig": "configuration_fpsa_vit.FPSAViTConfig",
                       "AutoModel": "modeling_fpsa_vit.FPSAViTModel",
                       "AutoModelForImageClassification": "modeling_fpsa_vit.FPSAViTForImageClassification"}

    def __init__(self, **kwargs):
        for key, value in {**pop_fp_kwargs(kwargs, FPSA_FP_DEFAULTS), **pop_fpsa_kwargs(kwargs)}.items():
            setattr(self, key, value)
        kwargs["auto_map"] = complete_auto_map(kwargs.get("auto_map"), self.family_auto_map)
        super().__init__(**kwargs)
        check_heads(self)

    @classmethod
    def from_dict(cls, config_dict, **kwargs):
        if config_dict.get("model_type") == "vit" and kwargs.get("fpsa_spectral_norm", "none") != "none":
            raise ValueError("fpsa_spectral_norm cannot be set while loading a plain ViT checkpoint (its weight names "
                             "are converted on load); load it first, then call fp_fpsa.apply_spectral_norm on "
                             "q_proj/k_proj (o_proj) of every layer's attention.")
        return super().from_dict(retrofit_config_dict(cls, config_dict, COMPATIBLE_MODEL_TYPES), **kwargs)


__all__ = ["FPSAViTConfig"]
