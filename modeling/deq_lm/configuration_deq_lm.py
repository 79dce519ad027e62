"""Configuration of DEQ-LM, the reference family of hf-fixedpoint: a causal language model whose single
weight-tied transformer block is solved to its fixed point (Bai et al., "Deep Equilibrium Models", 2019)."""

from transformers import PretrainedConfig

from .fp_backward import fixed_point  # noqa: F401  (see vendor.direct_import_problems)
from .fp_registry import check_number, complete_auto_map  # noqa: F401  (see vendor.direct_import_problems)
from .fp_settings import FixedPointConfigMixin, pop_fp_kwargs
from .fp_solvers import solve  # noqa: F401  (see vendor.direct_import_problems)
from .fp_stats import FixedPointStats  # noqa: F401  (see vendor.direct_import_problems)


class DEQLMConfig(FixedPointConfigMixin, PretrainedConfig):
    r"""
    Args:
        vocab_size: size of the vocabulary.
        hidden_size: width of the state ``z`` and of the token embeddings.
        intermediate_size: width of the MLP.
        num_attention_heads: attention heads; must divide ``hidden_size``.
        max_position_embeddings: longest sequence (learned absolute positions).
        rms_norm_eps: epsilon of the RMS norms.
        initializer_range: std of the normal initializer; small values keep the map contractive at init.
        fp_*: fixed-point settings, see ``fp_settings.FP_DEFAULTS`` (e.g. ``fp_solver="anderson"``,
            ``fp_max_iter=30``, ``fp_backward="ift"``).

    Example:
        >>> from transformers import AutoModelForCausalLM
        >>> config = DEQLMConfig(vocab_size=99, hidden_size=32, fp_max_iter=20)
        >>> model = AutoModelForCausalLM.from_config(config)
    """

    model_type = "deq_lm"
    # Every Auto class of the family: config.json gets them all whichever class saves (see complete_auto_map).
    family_auto_map = {"AutoConfig": "configuration_deq_lm.DEQLMConfig", "AutoModel": "modeling_deq_lm.DEQLMModel",
                       "AutoModelForCausalLM": "modeling_deq_lm.DEQLMForCausalLM"}

    def __init__(
        self,
        vocab_size: int = 1024,
        hidden_size: int = 64,
        intermediate_size: int = 128,
        num_attention_heads: int = 4,
        max_position_embeddings: int = 256,
        rms_norm_eps: float = 1e-6,
        initializer_range: float = 0.02,
        tie_word_embeddings: bool = True,
        **kwargs,
    ):
        for key, value in pop_fp_kwargs(kwargs).items():
            setattr(self, key, value)
        for name, value in [("vocab_size", vocab_size), ("hidden_size", hidden_size),
                            ("intermediate_size", intermediate_size), ("num_attention_heads", num_attention_heads),
                            ("max_position_embeddings", max_position_embeddings)]:
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}.")
        if hidden_size % num_attention_heads:
            raise ValueError(
                f"hidden_size={hidden_size} must be divisible by num_attention_heads={num_attention_heads}."
            )
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_attention_heads = num_attention_heads
        self.max_position_embeddings = max_position_embeddings
        self.rms_norm_eps = rms_norm_eps
        self.initializer_range = initializer_range
        self.num_hidden_layers = 1  # one weight-tied block (read by generation utilities)
        kwargs.setdefault("use_cache", False)  # no KV cache: each step re-solves the fixed point over the prefix
        kwargs["auto_map"] = complete_auto_map(kwargs.get("auto_map"), self.family_auto_map)
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)


__all__ = ["DEQLMConfig"]
