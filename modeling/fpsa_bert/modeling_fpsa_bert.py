"""FPSA-BERT: transformers' BERT with every self-attention layer replaced by Fixed-Point Self-Attention.

Only the self-attention module changes (``fp_fpsa.fpsa_attention``): ``query``/``key``/``value`` and the attention
output ``dense``/``LayerNorm`` keep their names, so ``FPSABertForX.from_pretrained(<any BERT checkpoint>)`` loads the
weights unchanged, and with ``fp_max_iter=1`` the model computes exactly what the BERT checkpoint computes. Every class
restates the short BERT ``__init__`` with the FPSA modules and reuses the rest of the BERT code (embeddings, FFN,
heads, losses, masks, attention functions).

Outputs carry ``fp_stats`` (``FPSAStats``: iterations per layer, token and head; ``.summary()`` gives median / p90 /
p99 and the cap-hit rate). Per-call knobs: ``model(..., fp_max_iter=32, fp_tol=1e-4)`` (or ``fp_overrides={...}``).
"""

from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn
from transformers import (
    BertForMaskedLM,
    BertForQuestionAnswering,
    BertForSequenceClassification,
    BertForTokenClassification,
    BertModel,
    BertPreTrainedModel,
)
from transformers.modeling_outputs import (
    BaseModelOutputWithPoolingAndCrossAttentions,
    MaskedLMOutput,
    QuestionAnsweringModelOutput,
    SequenceClassifierOutput,
    TokenClassifierOutput,
)
from transformers.models.bert.modeling_bert import (
    BertAttention,
    BertEmbeddings,
    BertEncoder,
    BertLayer,
    BertOnlyMLMHead,
    BertPooler,
    BertSelfAttention,
    BertSelfOutput,
)
from transformers.utils import can_return_tuple

from .configuration_fpsa_bert import FPSABertConfig
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
    from transformers.models.bert.modeling_bert import eager_attention_forward
except ImportError:  # 4.57: BERT's attention is not written against attention functions yet
    require_transformers("5.0", "FPSA-BERT", "BERT has no eager_attention_forward")


class FPSABertSelfAttention(BertSelfAttention):
    """``BertSelfAttention`` run as an FPSA loop; needs the sibling ``BertSelfOutput`` (``W_O`` and the norm)."""

    def __init__(self, config, is_causal=False, layer_idx=None):
        super().__init__(config, is_causal=is_causal, layer_idx=layer_idx)
        heads = config.num_attention_heads
        self.fpsa_log_tau = nn.Parameter(torch.zeros(heads)) if config.fpsa_learn_temperature else None
        self.fpsa_halt_gate = FPSAHaltingGate(heads) if config.fpsa_halting == "learned" else None

    def forward(self, hidden_states, attention_mask=None, past_key_values=None, *, fpsa_output: BertSelfOutput,
                fpsa_fp_kwargs: Optional[dict] = None, fpsa_stats: Optional[FPSAStats] = None,
                fpsa_margin_fn=None, fp_overrides: Optional[dict] = None, **kwargs):
        if past_key_values is not None:
            raise ValueError("FPSA-BERT is an encoder and takes no past_key_values.")
        kwargs.pop("encoder_hidden_states", None)
        config = self.config
        if fpsa_fp_kwargs is None:
            fpsa_fp_kwargs = fixed_point_kwargs(config, self.training, fp_overrides)
        head_dim = self.attention_head_size

        def split(t):  # (B, T, H * d) -> (B, H, T, d)
            return t.view(*t.shape[:-1], -1, head_dim).transpose(1, 2)

        learned = config.fpsa_halting == "learned"
        # Entropy features need the attention weights: learned halting uses BERT's eager attention.
        attention_fn = eager_attention_forward if learned else attention_function(
            config._attn_implementation, eager_attention_forward)
        result = fpsa_attention(
            self, hidden_states,
            query=lambda z: split(self.query(z)), key=lambda z: split(self.key(z)),
            value=split(self.value(hidden_states)), out_proj=fpsa_output.dense, norm=fpsa_output.LayerNorm,
            attention_fn=attention_fn, scaling=self.scaling, fp_kwargs=fpsa_fp_kwargs,
            attention_mask=attention_mask, log_temperature=self.fpsa_log_tau, halting_gate=self.fpsa_halt_gate,
            margin_fn=fpsa_margin_fn, attention_kwargs=kwargs,
            options=FPSAOptions.from_config(
                config, dropout=self.dropout.p if self.training else 0.0,
                return_weights=bool(kwargs.get("output_attentions", config.output_attentions))),  # output capturing
        )
        if fpsa_stats is not None:
            fpsa_stats.add(result, layer=self)
        return result.output, result.attn_weights


class FPSABertAttention(BertAttention):
    """``BertAttention`` with the FPSA self-attention (same ``self`` / ``output`` submodule names)."""

    def __init__(self, config, is_causal=False, layer_idx=None, is_cross_attention=False):
        nn.Module.__init__(self)
        self.is_cross_attention = False
        self.self = FPSABertSelfAttention(config, is_causal=is_causal, layer_idx=layer_idx)
        self.output = BertSelfOutput(config)
        if config.fpsa_spectral_norm != "none":
            extra = [self.output.dense] if config.fpsa_spectral_norm == "qko" else []
            apply_spectral_norm([self.self.query, self.self.key, *extra])

    def forward(self, hidden_states, attention_mask=None, encoder_hidden_states=None, encoder_attention_mask=None,
                past_key_values=None, **kwargs):
        context, weights = self.self(hidden_states, attention_mask=attention_mask, past_key_values=past_key_values,
                                     fpsa_output=self.output, **kwargs)
        return self.output(context, hidden_states), weights


class FPSABertLayer(BertLayer):
    def __init__(self, config, layer_idx=None):
        super().__init__(config, layer_idx=layer_idx)
        self.attention = FPSABertAttention(config, layer_idx=layer_idx)


class FPSABertEncoder(BertEncoder):
    def __init__(self, config):
        nn.Module.__init__(self)
        self.config = config
        self.layer = nn.ModuleList([FPSABertLayer(config, layer_idx=i) for i in range(config.num_hidden_layers)])


class FPSABertPreTrainedModel(BertPreTrainedModel):
    config_class = FPSABertConfig
    _no_split_modules = ["BertEmbeddings", "FPSABertLayer"]

    # Plain BERT checkpoints store W_Q, W_K (W_O) as `.weight`; with spectral norm the model keeps them under the
    # parametrization. Applied by from_pretrained unless the caller passes its own key_mapping.
    _SPECTRAL_KEYS = {
        "qk": {rf"attention\.self\.{name}\.weight$": f"attention.self.{name}.parametrizations.weight.original"
               for name in ("query", "key")},
    }
    _SPECTRAL_KEYS["qko"] = {**_SPECTRAL_KEYS["qk"], r"attention\.output\.dense\.weight$":
                             "attention.output.dense.parametrizations.weight.original"}

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        spectral = kwargs.get("fpsa_spectral_norm")
        config = kwargs.get("config")
        if spectral is None and isinstance(config, FPSABertConfig):
            spectral = config.fpsa_spectral_norm
        if spectral in cls._SPECTRAL_KEYS and "key_mapping" not in kwargs:
            kwargs["key_mapping"] = cls._SPECTRAL_KEYS[spectral]
        return super().from_pretrained(pretrained_model_name_or_path, *args, **kwargs)

    @torch.no_grad()
    def _init_weights(self, module):
        super()._init_weights(module)
        init_fpsa_weights(self, module)


@dataclass
class FPSABertModelOutput(BaseModelOutputWithPoolingAndCrossAttentions):
    """BERT's output plus ``fp_stats`` (``FPSAStats``)."""

    fp_stats: Optional[FPSAStats] = None


class FPSABertModel(FPSABertPreTrainedModel, BertModel):
    """``BertModel`` with FPSA self-attention; ``forward`` takes ``fp_overrides`` and returns ``fp_stats``."""

    def __init__(self, config: FPSABertConfig, add_pooling_layer: bool = True):
        BertPreTrainedModel.__init__(self, config)
        self.config = config
        self.gradient_checkpointing = False
        self.embeddings = BertEmbeddings(config)
        self.encoder = FPSABertEncoder(config)
        self.pooler = BertPooler(config) if add_pooling_layer else None
        self.post_init()

    @can_return_tuple
    @defer_finite_checks
    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None, inputs_embeds=None,
                fp_max_iter: Optional[int] = None, fp_tol: Optional[float] = None,
                fp_overrides: Optional[dict] = None, fpsa_stats: Optional[FPSAStats] = None, **kwargs):
        overrides = call_knobs(self.config, kwargs, type(self).__name__, fp_overrides, fp_max_iter, fp_tol,
                               allowed=("fpsa_margin_fn",))
        stats = FPSAStats() if fpsa_stats is None else fpsa_stats
        if attention_mask is not None and attention_mask.dim() == 2:
            stats.token_mask = attention_mask.bool()
        fp_kwargs = fixed_point_kwargs(self.config, self.training, overrides)
        kwargs["return_dict"] = True
        out = super().forward(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids,
                              position_ids=position_ids, inputs_embeds=inputs_embeds, fpsa_fp_kwargs=fp_kwargs,
                              fpsa_stats=FPSAStatsSink(stats), **kwargs)
        return FPSABertModelOutput(**out, fp_stats=stats)


@dataclass
class FPSAMaskedLMOutput(MaskedLMOutput):
    fp_stats: Optional[FPSAStats] = None


@dataclass
class FPSASequenceClassifierOutput(SequenceClassifierOutput):
    fp_stats: Optional[FPSAStats] = None


@dataclass
class FPSATokenClassifierOutput(TokenClassifierOutput):
    fp_stats: Optional[FPSAStats] = None


@dataclass
class FPSAQuestionAnsweringModelOutput(QuestionAnsweringModelOutput):
    fp_stats: Optional[FPSAStats] = None


class FPSABertForMaskedLM(FPSAHeadMixin, FPSABertPreTrainedModel, BertForMaskedLM):
    output_class = FPSAMaskedLMOutput

    def __init__(self, config: FPSABertConfig):
        BertPreTrainedModel.__init__(self, config)
        self.bert = FPSABertModel(config, add_pooling_layer=False)
        self.cls = BertOnlyMLMHead(config)
        self.post_init()


class FPSABertForSequenceClassification(FPSAHeadMixin, FPSABertPreTrainedModel, BertForSequenceClassification):
    output_class = FPSASequenceClassifierOutput

    def __init__(self, config: FPSABertConfig):
        BertPreTrainedModel.__init__(self, config)
        self.num_labels = config.num_labels
        self.config = config
        self.bert = FPSABertModel(config)
        dropout = config.classifier_dropout if config.classifier_dropout is not None else config.hidden_dropout_prob
        self.dropout = nn.Dropout(dropout)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)
        self.post_init()


class FPSABertForTokenClassification(FPSAHeadMixin, FPSABertPreTrainedModel, BertForTokenClassification):
    output_class = FPSATokenClassifierOutput

    def __init__(self, config: FPSABertConfig):
        BertPreTrainedModel.__init__(self, config)
        self.num_labels = config.num_labels
        self.bert = FPSABertModel(config, add_pooling_layer=False)
        dropout = config.classifier_dropout if config.classifier_dropout is not None else config.hidden_dropout_prob
        self.dropout = nn.Dropout(dropout)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)
        self.post_init()

    def fpsa_margin_fn(self):
        return self.classifier


class FPSABertForQuestionAnswering(FPSAHeadMixin, FPSABertPreTrainedModel, BertForQuestionAnswering):
    output_class = FPSAQuestionAnsweringModelOutput

    def __init__(self, config: FPSABertConfig):
        BertPreTrainedModel.__init__(self, config)
        self.num_labels = config.num_labels
        self.bert = FPSABertModel(config, add_pooling_layer=False)
        self.qa_outputs = nn.Linear(config.hidden_size, config.num_labels)
        self.post_init()


__all__ = [
    "FPSABertForMaskedLM",
    "FPSABertForQuestionAnswering",
    "FPSABertForSequenceClassification",
    "FPSABertForTokenClassification",
    "FPSABertModel",
    "FPSABertPreTrainedModel",
]
