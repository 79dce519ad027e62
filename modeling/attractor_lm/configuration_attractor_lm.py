"""Configuration of Attractor LM ("Solve the Loop: Attractor Models for Language and Reasoning", Fein-Ashley and
Rashidinejad, arXiv 2605.12466): a causal transformer backbone proposes a state, a weight-tied attractor refines it
to a fixed point, and the tied embedding decodes it."""

from transformers import PretrainedConfig

from .fp_backward import fixed_point  # noqa: F401  (see vendor.direct_import_problems)
from .fp_registry import check_choice, check_number, complete_auto_map
from .fp_settings import FixedPointConfigMixin, pop_fp_kwargs
from .fp_solvers import solve  # noqa: F401  (see vendor.direct_import_problems)
from .fp_stats import FixedPointStats  # noqa: F401  (see vendor.direct_import_problems)

INJECTIONS = ("add", "initial_only", "concat")

# The paper's LM runs: Anderson (the core's defaults m=5, beta=1 are the paper's) forward, one-step gradient
# backward, a small iteration cap.
ATTRACTOR_FP_DEFAULTS = {
    "fp_solver": "anderson",
    "fp_tol": 3e-4,
    "fp_max_iter": 12,
    "fp_backward": "one_step",
    "fp_backward_solver": "anderson",
    "fp_backward_steps": 2,
}


class AttractorConfig(FixedPointConfigMixin, PretrainedConfig):
    r"""
    Args:
        vocab_size: size of the vocabulary (the embedding is tied to the unembedding).
        hidden_size: width of the residual stream, of the proposal and of the attractor state.
        intermediate_size: width of the ReLU² MLPs.
        num_attention_heads: query heads; must divide ``hidden_size``.
        num_key_value_heads: key/value heads (grouped-query attention); ``None`` means ``num_attention_heads``.
        num_backbone_layers: causal transformer layers of the backbone ``T_b`` (>= 1).
        num_attractor_layers: weight-tied layers of the attractor ``T_a``, applied once per solver iteration (>= 1).
        max_position_embeddings: longest sequence the rotary embedding is prepared for.
        rope_theta: rotary base.
        rms_norm_eps: epsilon of every RMSNorm (pre-norms, QK-norms, final norm).
        initializer_range: std of the normal initializer.
        injection: how the proposal ``y0`` enters the attractor: ``"add"`` (every step, ``T_a(y + y0)``: the paper's
            model), ``"initial_only"`` (only as the starting point of the solve) or ``"concat"`` (every step, through
            a learned projection of ``[y; y0]`` initialised to ``y + y0``). The last two exist for the ablation.
        layer_scale_init: initial per-channel gate ``gamma`` on every attractor sublayer, in ``(0, layer_scale_max)``.
        layer_scale_max: upper bound of the gates, ``gamma = layer_scale_max * sigmoid(raw)``, in ``(0, 1]``.
        adjoint_clip: with ``fp_backward="ift"``, rescale ``J^T u`` in the adjoint map so that
            ``||J^T u|| <= adjoint_clip * ||u||`` per sample (``None``: no clipping).
        readout_iters: solver iterations used when a call does not say otherwise: ``None`` solves to the fixed point
            under the ``fp_*`` settings, ``0`` decodes the backbone proposal (the paper's T=0 readout), ``k > 0``
            caps the solve at ``k`` iterations. Overridable per call (``model(..., readout_iters=0)``,
            ``generate(..., readout_iters=0)``) and at load time (``from_pretrained(dir, readout_iters=0)``).
        fp_*: fixed-point settings (see ``fp_settings.FP_DEFAULTS``); this family defaults to Anderson (``m=5``,
            ``beta=1``; set them with ``fp_solver_kwargs={"m": ..., "beta": ...}``), ``fp_tol=3e-4``,
            ``fp_max_iter=12`` and ``fp_backward="one_step"`` (``"phantom"`` with ``fp_backward_steps``, ``"ift"``
            with the ``fp_backward_*`` adjoint settings, and ``"bptt"`` are the alternatives).

    Example:
        >>> config = AttractorConfig(vocab_size=99, hidden_size=32, intermediate_size=64, num_backbone_layers=1)
        >>> model = AttractorForCausalLM(config)
    """

    model_type = "attractor_lm"
    # Every Auto class of the family: config.json gets them all whichever class saves (see complete_auto_map).
    family_auto_map = {"AutoConfig": "configuration_attractor_lm.AttractorConfig",
                       "AutoModel": "modeling_attractor_lm.AttractorModel",
                       "AutoModelForCausalLM": "modeling_attractor_lm.AttractorForCausalLM"}

    def __init__(
        self,
        vocab_size: int = 1024,
        hidden_size: int = 64,
        intermediate_size: int = 256,
        num_attention_heads: int = 4,
        num_key_value_heads: int = None,
        num_backbone_layers: int = 2,
        num_attractor_layers: int = 1,
        max_position_embeddings: int = 512,
        rope_theta: float = 10000.0,
        rms_norm_eps: float = 1e-6,
        initializer_range: float = 0.02,
        injection: str = "add",
        layer_scale_init: float = 0.5,
        layer_scale_max: float = 0.75,
        adjoint_clip: float = None,
        readout_iters: int = None,
        tie_word_embeddings: bool = True,
        **kwargs,
    ):
        for key, value in pop_fp_kwargs(kwargs, ATTRACTOR_FP_DEFAULTS).items():
            setattr(self, key, value)
        num_key_value_heads = num_attention_heads if num_key_value_heads is None else num_key_value_heads
        for name, value in [("vocab_size", vocab_size), ("hidden_size", hidden_size),
                            ("intermediate_size", intermediate_size), ("num_attention_heads", num_attention_heads),
                            ("num_key_value_heads", num_key_value_heads),
                            ("num_backbone_layers", num_backbone_layers),
                            ("num_attractor_layers", num_attractor_layers),
                            ("max_position_embeddings", max_position_embeddings)]:
            check_number(value, name, low=1, integer=True)
        if hidden_size % num_attention_heads or (hidden_size // num_attention_heads) % 2:
            raise ValueError(f"hidden_size={hidden_size} must be divisible by num_attention_heads="
                             f"{num_attention_heads} into an even head size (rotary embedding).")
        if num_attention_heads % num_key_value_heads:
            raise ValueError(f"num_attention_heads={num_attention_heads} must be divisible by "
                             f"num_key_value_heads={num_key_value_heads}.")
        check_number(rope_theta, "rope_theta", low=0.0, low_open=True)
        check_number(rms_norm_eps, "rms_norm_eps", low=0.0, low_open=True)
        check_number(initializer_range, "initializer_range", low=0.0, low_open=True)
        check_choice(injection, "injection", INJECTIONS)
        check_number(layer_scale_max, "layer_scale_max", low=0.0, high=1.0, low_open=True)
        check_number(layer_scale_init, "layer_scale_init", low=0.0, high=layer_scale_max, low_open=True,
                     high_open=True)
        if adjoint_clip is not None:
            check_number(adjoint_clip, "adjoint_clip", low=0.0, low_open=True)
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads
        self.head_dim = hidden_size // num_attention_heads
        self.num_backbone_layers = num_backbone_layers
        self.num_attractor_layers = num_attractor_layers
        self.max_position_embeddings = max_position_embeddings
        self.rope_theta = rope_theta
        self.rms_norm_eps = rms_norm_eps
        self.initializer_range = initializer_range
        self.injection = injection
        self.layer_scale_init = layer_scale_init
        self.layer_scale_max = layer_scale_max
        self.adjoint_clip = adjoint_clip
        self.readout_iters = readout_iters  # checked by check_setting
        # Derived, rewritten on every load: read by the rotary embedding and by DynamicCache (one cache layer per
        # backbone layer, then one per attractor layer).
        kwargs.pop("head_dim", None)
        kwargs.pop("num_hidden_layers", None)
        kwargs.pop("rope_parameters", None)
        self.num_hidden_layers = num_backbone_layers + num_attractor_layers
        self.rope_parameters = {"rope_type": "default", "rope_theta": rope_theta}
        self.use_cache = kwargs.pop("use_cache", True)
        kwargs["auto_map"] = complete_auto_map(kwargs.get("auto_map"), self.family_auto_map)
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)

    def check_setting(self, key: str, value) -> None:
        # readout_iters is a run-time knob: from_pretrained(dir, readout_iters=k) sets it after __init__.
        if key == "readout_iters" and value is not None:
            check_number(value, key, low=0, integer=True)
        super().check_setting(key, value)


__all__ = ["AttractorConfig"]
