"""Configuration of FPSA-BERT: BERT whose self-attention layers are Fixed-Point Self-Attention (FPSA) loops.

Every ``BertConfig`` field keeps its meaning, so any BERT ``config.json`` + checkpoint loads with unchanged weight
names; the ``fp_*`` knobs (solver, ``fp_tol``, ``fp_max_iter``, backward mode...) and the ``fpsa_*`` knobs
(update form, temperature, spectral norm, learned halting) are added on top.
"""

from transformers import BertConfig

from .fp_backward import fixed_point  # noqa: F401  (see vendor.direct_import_problems)
from .fp_fpsa_settings import FPSA_FP_DEFAULTS, FPSAConfigMixin, check_heads, pop_fpsa_kwargs, retrofit_config_dict
from .fp_halting import ACTAccumulator  # noqa: F401  (see vendor.direct_import_problems)
from .fp_jacobian import jacobian_frobenius  # noqa: F401  (see vendor.direct_import_problems)
from .fp_registry import check_number, complete_auto_map  # noqa: F401  (see vendor.direct_import_problems)
from .fp_settings import pop_fp_kwargs
from .fp_solvers import solve  # noqa: F401  (see vendor.direct_import_problems)
from .fp_stats import FixedPointStats  # noqa: F401  (see vendor.direct_import_problems)

# Checkpoints whose config this class accepts: plain BERT (a retrofit) and FPSA-BERT itself.
COMPATIBLE_MODEL_TYPES = ("bert", "fpsa_bert")


class FPSABertConfig(FPSAConfigMixin, BertConfig):
    r"""
    Args:
        **BertConfig fields**: ``vocab_size``, ``hidden_size``, ``num_hidden_layers``, ``num_attention_heads`` (must
            divide ``hidden_size``), ``intermediate_size``, ...
        fp_*: fixed-point settings (``fp_settings.FP_DEFAULTS``); FPSA defaults: ``fp_solver="picard"``,
            ``fp_tol=1e-3`` (relative change per token and head), ``fp_max_iter=16`` (counts the exact first step;
            ``fp_max_iter=1`` is the original BERT).
        fpsa_*: FPSA settings (``fp_fpsa_settings.FPSA_DEFAULTS``): ``fpsa_update`` (``residual_norm`` | ``plain``),
            ``fpsa_update_scale`` (in (0, 1]), ``fpsa_step_norm`` (``none`` | ``tanh``), ``fpsa_learn_temperature``,
            ``fpsa_spectral_norm`` (``none`` | ``qk`` | ``qko``), ``fpsa_adjoint_mask``, ``fpsa_halting``
            (``tolerance`` | ``learned``), ``fpsa_ponder_budget``, ``fpsa_ponder_weight``, ``fpsa_halt_threshold``.

    Example:
        >>> config = FPSABertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        ...                         intermediate_size=37, fp_max_iter=8)
    """

    model_type = "fpsa_bert"
    # Every Auto class of the family: config.json gets them all whichever class saves (see complete_auto_map).
    family_auto_map = {"AutoConfig": "configuration_fpsa_bert.FPSABertConfig",
                       "AutoModel": "modeling_fpsa_bert.FPSABertModel",
                       "AutoModelForMaskedLM": "modeling_fpsa_bert.FPSABertForMaskedLM",
                       "AutoModelForSequenceClassification": "modeling_fpsa_bert.FPSABertForSequenceClassification",
                       "AutoModelForTokenClassification": "modeling_fpsa_bert.FPSABertForTokenClassification",
                       "AutoModelForQuestionAnswering": "modeling_fpsa_bert.FPSABertForQuestionAnswering"}

    def __init__(self, **kwargs):
        for key, value in {**pop_fp_kwargs(kwargs, FPSA_FP_DEFAULTS), **pop_fpsa_kwargs(kwargs)}.items():
            setattr(self, key, value)
        kwargs["auto_map"] = complete_auto_map(kwargs.get("auto_map"), self.family_auto_map)
        super().__init__(**kwargs)
        check_heads(self)
        if self.is_decoder or self.add_cross_attention:
            raise ValueError("FPSA-BERT is an encoder: is_decoder and add_cross_attention must be False.")

    @classmethod
    def from_dict(cls, config_dict, **kwargs):
        return super().from_dict(retrofit_config_dict(cls, config_dict, COMPATIBLE_MODEL_TYPES), **kwargs)


__all__ = ["FPSABertConfig"]
