"""Configuration of URM ("Universal Reasoning Model"): a Universal Transformer with ConvSwiGLU, truncated backprop
through its loops and an ACT outer loop with a Q-halt head."""

from transformers import PretrainedConfig

from .fp_backward import fixed_point  # noqa: F401  (see vendor.direct_import_problems)
from .fp_reasoning import PuzzleConfigMixin, check_puzzle_config
from .fp_registry import check_number, complete_auto_map
from .fp_settings import pop_fp_kwargs
from .fp_solvers import solve  # noqa: F401  (see vendor.direct_import_problems)
from .fp_stats import FixedPointStats  # noqa: F401  (see vendor.direct_import_problems)

# URM's forward-only loops as an unrolled Picard solve: 6 loops (scripts: H_cycles=2, L_cycles=6), never early.
URM_FP_DEFAULTS = {"fp_solver": "picard", "fp_tol": 1e-9, "fp_max_iter": 6, "fp_return": "last"}


class URMConfig(PuzzleConfigMixin, PretrainedConfig):
    r"""
    Shared puzzle fields: see ``FPRMConfig``.

    URM fields:
        num_layers: post-norm blocks (attention + ConvSwiGLU) applied per loop ``h = blocks(h + x)`` (scripts: 4).
        L_cycles: loops with gradient per supervision step (truncated backprop through loops; scripts: 6).
        fp_*: the loops *before* them run forward-only, as a solve of ``h = blocks(h + x)``: ``fp_max_iter`` loops
            (URM's ``(H_cycles - 1) * L_cycles``, default 6), ``fp_eval_max_iter`` at evaluation (URM's extra
            evaluation loops), ``fp_solver`` (``picard`` reproduces URM; ``anderson`` accelerates) and ``fp_tol``
            (tiny by default, so every loop runs). The backward settings are unused: the ``L_cycles`` loops are
            backpropagated through directly.
    """

    model_type = "urm"
    # Every Auto class of the family: config.json gets them all whichever class saves (see complete_auto_map).
    family_auto_map = {"AutoConfig": "configuration_urm.URMConfig", "AutoModel": "modeling_urm.URMModel",
                       "AutoModelForTokenClassification": "modeling_urm.URMForPuzzles"}

    def __init__(
        self,
        vocab_size: int = 11,
        seq_len: int = 81,
        hidden_size: int = 64,
        num_attention_heads: int = 4,
        expansion: float = 4.0,
        mlp_multiple_of: int = 64,
        num_puzzle_identifiers: int = 1,
        puzzle_emb_len: int = 1,
        puzzle_emb_ndim: int = None,
        pos_encodings: str = "rope",
        causal: bool = False,
        rope_theta: float = 10000.0,
        rms_norm_eps: float = 1e-5,
        forward_dtype: str = "float32",
        grid_shape: list = None,
        halt_max_steps: int = 16,
        halt_exploration_prob: float = 0.1,
        loss_type: str = "stablemax",
        q_loss_weight: float = 0.5,
        num_layers: int = 4,
        L_cycles: int = 6,
        **kwargs,
    ):
        fields = {k: v for k, v in locals().items() if k not in ("self", "kwargs", "__class__")}
        for key, value in {**fields, **pop_fp_kwargs(kwargs, URM_FP_DEFAULTS)}.items():
            setattr(self, key, value)
        check_puzzle_config(self)
        check_number(num_layers, "num_layers", low=1, integer=True)
        check_number(L_cycles, "L_cycles", low=1, integer=True)
        kwargs["auto_map"] = complete_auto_map(kwargs.get("auto_map"), self.family_auto_map)
        super().__init__(**kwargs)


__all__ = ["URMConfig"]
