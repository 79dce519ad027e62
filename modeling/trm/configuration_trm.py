"""Configuration of TRM ("Less is More: Recursive Reasoning with Tiny Networks") and of its fixed-point variant,
Attractor-reasoning / TRM-DEQ ("Solve the Loop: Attractor Models", puzzle experiments), selected by ``deq``."""

from transformers import PretrainedConfig

from .fp_backward import fixed_point  # noqa: F401  (see vendor.direct_import_problems)
from .fp_reasoning import PuzzleConfigMixin, check_puzzle_config
from .fp_registry import check_number, complete_auto_map
from .fp_settings import pop_fp_kwargs
from .fp_solvers import solve  # noqa: F401  (see vendor.direct_import_problems)
from .fp_stats import FixedPointStats  # noqa: F401  (see vendor.direct_import_problems)

# Attractor-reasoning's inner solve: Anderson, 4 to 8 iterations, tol 1e-3, phantom gradient through 2 iterates.
TRM_FP_DEFAULTS = {"fp_solver": "anderson", "fp_tol": 1e-3, "fp_max_iter": 8, "fp_min_iter": 4,
                   "fp_backward": "phantom", "fp_backward_steps": 2}


class TRMConfig(PuzzleConfigMixin, PretrainedConfig):
    r"""
    Shared puzzle fields: see ``FPRMConfig`` (vocab_size, seq_len, hidden_size, num_attention_heads, expansion,
    mlp_multiple_of, num_puzzle_identifiers, puzzle_emb_len, puzzle_emb_ndim, pos_encodings, causal,
    rope_theta, rms_norm_eps, forward_dtype, grid_shape, halt_max_steps, halt_exploration_prob, loss_type,
    q_loss_weight).

    TRM fields:
        num_layers: post-norm blocks of the one network that updates both latents (TRM's ``L_layers``, 2).
        H_cycles, L_cycles: per supervision step ``H_cycles`` cycles of ``L_cycles`` updates ``z = net(z, y + x)``
            and one ``y = net(y, z)``; only the last cycle carries gradient (TRM: 3 and 6).
        mlp_t: replace attention by a SwiGLU over the sequence axis (TRM-MLP, for Sudoku; use with
            ``pos_encodings="none"``).
        deq: Attractor-reasoning -- each cycle's ``L_cycles`` updates are replaced by a fixed-point solve of
            ``z = net(z, y + x)`` with the ``fp_*`` settings (defaults: Anderson, ``fp_min_iter=4``,
            ``fp_max_iter=8``, ``fp_tol=1e-3``, phantom gradient through ``fp_backward_steps=2`` iterates).
        jacobian_reg_weight: with ``deq``, weight of the Hutchinson estimate of ``||J||_F^2 / d`` at the fixed
            point, added to the training loss (Attractor: 1e-3; 0 disables).
    """

    model_type = "trm"
    # Every Auto class of the family: config.json gets them all whichever class saves (see complete_auto_map).
    family_auto_map = {"AutoConfig": "configuration_trm.TRMConfig", "AutoModel": "modeling_trm.TRMModel",
                       "AutoModelForTokenClassification": "modeling_trm.TRMForPuzzles"}

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
        num_layers: int = 2,
        H_cycles: int = 3,
        L_cycles: int = 6,
        mlp_t: bool = False,
        deq: bool = False,
        jacobian_reg_weight: float = 0.0,
        **kwargs,
    ):
        fields = {k: v for k, v in locals().items() if k not in ("self", "kwargs", "__class__")}
        for key, value in {**fields, **pop_fp_kwargs(kwargs, TRM_FP_DEFAULTS)}.items():
            setattr(self, key, value)
        check_puzzle_config(self)
        for name in ("num_layers", "H_cycles", "L_cycles"):
            check_number(getattr(self, name), name, low=1, integer=True)
        for name in ("mlp_t", "deq"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}.")
        check_number(jacobian_reg_weight, "jacobian_reg_weight", low=0.0)
        if jacobian_reg_weight > 0 and not deq:
            raise ValueError("jacobian_reg_weight > 0 needs deq=True (the regularizer acts on the fixed point).")
        kwargs["auto_map"] = complete_auto_map(kwargs.get("auto_map"), self.family_auto_map)
        super().__init__(**kwargs)


__all__ = ["TRMConfig"]
