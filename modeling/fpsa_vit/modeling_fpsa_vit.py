"""FPSA-ViT (SELF-ViT): transformers' ViT with every self-attention layer replaced by Fixed-Point Self-Attention.

``q_proj``/``k_proj``/``v_proj``/``o_proj`` keep their names and places, so ViT checkpoints load, including those
saved with the transformers-4 names (``encoder.layer.N.attention.attention.query``...): transformers converts those for
``ViTModel`` only and skips the conversion for custom classes, so this file registers the same conversion for
``FPSAViTModel``. With ``fp_max_iter=1`` the model computes exactly what the ViT checkpoint computes.
"""

from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn
from transformers import ViTForImageClassification, ViTModel, ViTPreTrainedModel
from transformers.modeling_outputs import BaseModelOutputWithPooling, ImageClassifierOutput
from transformers.models.vit import modeling_vit
from transformers.models.vit.modeling_vit import (
    ViTAttention,
    ViTEmbeddings,
    ViTLayer,
    ViTPooler,
    eager_attention_forward,
)
from transformers.utils import can_return_tuple

from .configuration_fpsa_vit import FPSAViTConfig
from .fp_backward import fixed_point  # noqa: F401  (see vendor.direct_import_problems)
from .fp_compat import attention_function, require_transformers
from .fp_fpsa import FPSAHaltingGate, FPSAOptions, fpsa_attention
from .fp_fpsa_layers import FPSAHeadMixin, apply_spectral_norm, init_fpsa_weights
from .fp_fpsa_settings import FPSA_DEFAULTS  # noqa: F401  (see vendor.direct_import_problems)
from .fp_fpsa_stats import FPSAStats, FPSAStatsSink
from .fp_halting import ACTAccumulator  # noqa: F401  (see vendor.direct_import_problems)
from .fp_jacobian import jacobian_frobenius  # noqa: F401  (see vendor.direct_import_problems)
from .fp_registry import check_number  # noqa: F401  (see vendor.direct_import_problems)
from .fp_settings import call_knobs, fixed_point_kwargs
from .fp_solvers import defer_finite_checks
from .fp_stats import FixedPointStats  # noqa: F401  (see vendor.direct_import_problems)

try:
    from transformers.conversion_mapping import (
        get_checkpoint_conversion_mapping,
        register_checkpoint_conversion_mapping,
    )
except ImportError:  # 4.57: no checkpoint conversion mappings
    require_transformers("5.12", "FPSA-ViT", "transformers.conversion_mapping does not exist")
if hasattr(modeling_vit, "ViTEncoder"):  # up to 5.5 at least, ViTModel kept its layers in encoder.layer
    require_transformers("5.12", "FPSA-ViT", "ViTModel keeps its layers in encoder.layer")

# Old (transformers 4) ViT checkpoints: the renaming transformers applies to ViTModel, for our class name too.
register_checkpoint_conversion_mapping("FPSAViTModel", get_checkpoint_conversion_mapping("ViTModel"), overwrite=True)


class FPSAViTAttention(ViTAttention):
    """``ViTAttention`` run as an FPSA loop; the layer passes its residual stream and input norm for the iterate."""

    def __init__(self, config):
        super().__init__(config)
        heads = config.num_attention_heads
        self.fpsa_log_tau = nn.Parameter(torch.zeros(heads)) if config.fpsa_learn_temperature else None
        self.fpsa_halt_gate = FPSAHaltingGate(heads) if config.fpsa_halting == "learned" else None
        if config.fpsa_spectral_norm != "none":
            apply_spectral_norm([self.q_proj, self.k_proj] + ([self.o_proj] if config.fpsa_spectral_norm == "qko"
                                                              else []))

    def forward(self, hidden_states, attention_mask=None, *, fpsa_residual: torch.Tensor, fpsa_norm: nn.Module,
                fpsa_fp_kwargs: Optional[dict] = None, fpsa_stats: Optional[FPSAStats] = None, fpsa_margin_fn=None,
                fp_overrides: Optional[dict] = None, **kwargs):
        config = self.config
        if fpsa_fp_kwargs is None:
            fpsa_fp_kwargs = fixed_point_kwargs(config, self.training, fp_overrides)

        def split(t):  # (B, T, H * d) -> (B, H, T, d)
            return t.view(*t.shape[:-1], -1, self.head_dim).transpose(1, 2)

        learned = config.fpsa_halting == "learned"
        attention_fn = eager_attention_forward if learned else attention_function(
            config._attn_implementation, eager_attention_forward)
        result = fpsa_attention(
            self, hidden_states,
            query=lambda z: split(self.q_proj(z)), key=lambda z: split(self.k_proj(z)),
            value=split(self.v_proj(hidden_states)), out_proj=self.o_proj, norm=fpsa_norm, residual=fpsa_residual,
            attention_fn=attention_fn, scaling=self.scaling, fp_kwargs=fpsa_fp_kwargs,
            attention_mask=attention_mask, log_temperature=self.fpsa_log_tau, halting_gate=self.fpsa_halt_gate,
            margin_fn=fpsa_margin_fn, attention_kwargs=kwargs,
            options=FPSAOptions.from_config(
                config, dropout=self.attention_dropout if self.training else 0.0,
                return_weights=bool(kwargs.get("output_attentions", config.output_attentions))),  # output capturing
        )
        if fpsa_stats is not None:
            fpsa_stats.add(result, layer=self)
        return self.o_proj(result.output), result.attn_weights


class FPSAViTLayer(ViTLayer):
    def __init__(self, config):
        super().__init__(config)
        self.attention = FPSAViTAttention(config)

    def forward(self, hidden_states, attention_mask=None, **kwargs):
        return super().forward(hidden_states, attention_mask, fpsa_residual=hidden_states,
                               fpsa_norm=self.layernorm_before, **kwargs)


class FPSAViTPreTrainedModel(ViTPreTrainedModel):
    config_class = FPSAViTConfig
    _no_split_modules = ["ViTEmbeddings", "FPSAViTLayer"]

    @torch.no_grad()
    def _init_weights(self, module):
        super()._init_weights(module)
        init_fpsa_weights(self, module)


@dataclass
class FPSAViTModelOutput(BaseModelOutputWithPooling):
    """ViT's output plus ``fp_stats`` (``FPSAStats``)."""

    fp_stats: Optional[FPSAStats] = None


@dataclass
class FPSAImageClassifierOutput(ImageClassifierOutput):
    fp_stats: Optional[FPSAStats] = None


class FPSAViTModel(FPSAViTPreTrainedModel, ViTModel):
    """``ViTModel`` with FPSA self-attention; ``forward`` takes ``fp_overrides`` and returns ``fp_stats``."""

    def __init__(self, config: FPSAViTConfig, add_pooling_layer: bool = True, use_mask_token: bool = False):
        ViTPreTrainedModel.__init__(self, config)
        self.config = config
        self.embeddings = ViTEmbeddings(config, use_mask_token=use_mask_token)
        self.layers = nn.ModuleList([FPSAViTLayer(config) for _ in range(config.num_hidden_layers)])
        self.layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.pooler = ViTPooler(config) if add_pooling_layer else None
        self.post_init()

    @can_return_tuple
    @defer_finite_checks
    def forward(self, pixel_values=None, bool_masked_pos=None, interpolate_pos_encoding=None, attention_mask=None,
                fp_max_iter: Optional[int] = None, fp_tol: Optional[float] = None,
                fp_overrides: Optional[dict] = None, fpsa_stats: Optional[FPSAStats] = None, **kwargs):
        overrides = call_knobs(self.config, kwargs, type(self).__name__, fp_overrides, fp_max_iter, fp_tol,
                               allowed=("fpsa_margin_fn",))
        stats = FPSAStats() if fpsa_stats is None else fpsa_stats
        out = super().forward(pixel_values, bool_masked_pos=bool_masked_pos,
                              interpolate_pos_encoding=interpolate_pos_encoding, attention_mask=attention_mask,
                              fpsa_fp_kwargs=fixed_point_kwargs(self.config, self.training, overrides),
                              fpsa_stats=FPSAStatsSink(stats), **kwargs)
        return FPSAViTModelOutput(**out, fp_stats=stats)


class FPSAViTForImageClassification(FPSAHeadMixin, FPSAViTPreTrainedModel, ViTForImageClassification):
    output_class = FPSAImageClassifierOutput

    def __init__(self, config: FPSAViTConfig):
        ViTPreTrainedModel.__init__(self, config)
        self.num_labels = config.num_labels
        self.vit = FPSAViTModel(config, add_pooling_layer=False)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels) if config.num_labels > 0 else nn.Identity()
        self.post_init()

    def fpsa_margin_fn(self):
        # Learned halting: the classifier read on every token's iterate (the CLS token's is the prediction's margin).
        return self.classifier if self.config.num_labels > 1 else None


__all__ = ["FPSAViTForImageClassification", "FPSAViTModel", "FPSAViTPreTrainedModel"]
