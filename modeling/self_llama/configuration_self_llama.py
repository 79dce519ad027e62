"""Configuration of SELF-LLaMA: a LLaMA decoder whose every attention layer is causal Fixed-Point Self-Attention.

Every ``LlamaConfig`` field keeps its meaning, so any LLaMA ``config.json`` + checkpoint loads with unchanged weight
names; the ``fp_*`` knobs (solver, ``fp_tol``, ``fp_max_iter``, backward mode...) and the ``fpsa_*`` knobs (update
form, step norm, temperature) are added on top.
"""

from transformers import LlamaConfig

from .fp_backward import fixed_point  # noqa: F401  (see vendor.direct_import_problems)
from .fp_fpsa_settings import (
    FPSA_FP_DEFAULTS,
    FPSAConfigMixin,
    check_decoder_fpsa,
    check_heads,
    pop_fpsa_kwargs,
    retrofit_config_dict,
)
from .fp_halting import ACTAccumulator  # noqa: F401  (see vendor.direct_import_problems)
from .fp_jacobian import jacobian_frobenius  # noqa: F401  (see vendor.direct_import_problems)
from .fp_registry import check_number, complete_auto_map  # noqa: F401  (see vendor.direct_import_problems)
from .fp_settings import pop_fp_kwargs
from .fp_solvers import solve  # noqa: F401  (see vendor.direct_import_problems)
from .fp_stats import FixedPointStats  # noqa: F401  (see vendor.direct_import_problems)

# Checkpoints whose config this class accepts: plain LLaMA (a retrofit) and SELF-LLaMA itself.
COMPATIBLE_MODEL_TYPES = ("llama", "self_llama")
# Decoder retrofits keep exactly the base model's parameters unless asked otherwise.
SELF_FPSA_DEFAULTS = {"fpsa_learn_temperature": False}


class SelfLlamaConfig(FPSAConfigMixin, LlamaConfig):
    r"""
    Args:
        **LlamaConfig fields**: ``vocab_size``, ``hidden_size``, ``num_hidden_layers``, ``num_attention_heads``,
            ``num_key_value_heads`` (GQA), ``rope_parameters``, ...
        fp_*: fixed-point settings (``fp_settings.FP_DEFAULTS``); FPSA defaults: ``fp_solver="picard"``,
            ``fp_tol=1e-3`` (relative change per token and head), ``fp_max_iter=16`` (counts the exact first step;
            ``fp_max_iter=1`` is the original LLaMA).
        fpsa_*: FPSA settings (``fp_fpsa_settings.FPSA_DEFAULTS``): ``fpsa_update`` (``residual_norm``:
            ``Z = norm(R + W_O O)`` with the layer's input RMSNorm, or ``plain``), ``fpsa_update_scale`` (in (0, 1]:
            the share of ``W_O O`` re-injected), ``fpsa_step_norm`` (``none`` |
            ``tanh``), ``fpsa_learn_temperature`` (default False here: the retrofit has exactly the base model's
            parameters), ``fpsa_adjoint_mask``. ``fpsa_halting`` must be ``tolerance`` and ``fpsa_spectral_norm``
            ``none``.

    Example:
        >>> config = SelfLlamaConfig(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        ...                          num_key_value_heads=2, intermediate_size=64, fp_max_iter=8)
    """

    model_type = "self_llama"
    # Every Auto class of the family: config.json gets them all whichever class saves (see complete_auto_map).
    family_auto_map = {"AutoConfig": "configuration_self_llama.SelfLlamaConfig",
                       "AutoModel": "modeling_self_llama.SelfLlamaModel",
                       "AutoModelForCausalLM": "modeling_self_llama.SelfLlamaForCausalLM"}

    def __init__(self, **kwargs):
        for key, value in {**pop_fp_kwargs(kwargs, FPSA_FP_DEFAULTS),
                           **pop_fpsa_kwargs(kwargs, SELF_FPSA_DEFAULTS)}.items():
            setattr(self, key, value)
        kwargs["auto_map"] = complete_auto_map(kwargs.get("auto_map"), self.family_auto_map)
        super().__init__(**kwargs)
        check_heads(self)
        check_decoder_fpsa(self)

    @classmethod
    def from_dict(cls, config_dict, **kwargs):
        return super().from_dict(retrofit_config_dict(cls, config_dict, COMPATIBLE_MODEL_TYPES), **kwargs)


__all__ = ["SelfLlamaConfig"]
